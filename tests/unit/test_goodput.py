"""Goodput and uptime accounting (docs/algorithm.md section 9), against hand-computed numbers."""

from __future__ import annotations

import pytest

from ray_diloco.control.events import (
    FailureDetected,
    FailureKind,
    LearnerRejoined,
    LearnerRestarted,
    LearnerState,
    LearnerStateChanged,
    RoundClosed,
    RunFinished,
    RunStarted,
    WorkLost,
)
from ray_diloco.control.goodput import compute_goodput, uptime

S = LearnerState


def change(t: float, state: LearnerState, learner: str = "a", inc: int = 0) -> LearnerStateChanged:
    return LearnerStateChanged(t, learner, inc, state)


def rounds(*ts: float) -> list[RoundClosed]:
    return [RoundClosed(t, 0, i + 1, 1, 100) for i, t in enumerate(ts)]


FAIL_AND_RECOVER = [
    change(0.0, S.TRAINING),
    change(10.0, S.DEAD),
    change(15.0, S.RESTARTING, inc=1),
    change(20.0, S.TRAINING, inc=1),
]


def test_always_training_is_full_goodput():
    rep = compute_goodput([change(0.0, S.TRAINING)], end_t=100.0, uptime_window_s=10.0)
    assert rep.goodput == 1.0
    assert rep.allocated_s == rep.productive_s == 100.0


def test_dead_and_restarting_time_is_allocated_but_not_productive():
    rep = compute_goodput(FAIL_AND_RECOVER, end_t=40.0, uptime_window_s=10.0)
    assert rep.goodput == pytest.approx(30.0 / 40.0)
    b = rep.learners["a"]
    assert b.seconds["training"] == 30.0
    assert b.seconds["dead"] == 5.0
    assert b.seconds["restarting"] == 5.0
    assert b.seconds["compiling"] == 0.0
    assert (b.allocated_s, b.productive_s) == (40.0, 30.0)


def test_work_lost_subtracts_from_productive_only():
    evs = [*FAIL_AND_RECOVER, WorkLost(15.0, "a", steps=60, seconds=6.0)]
    rep = compute_goodput(evs, end_t=40.0, uptime_window_s=10.0)
    assert rep.productive_s == 24.0
    assert rep.allocated_s == 40.0
    assert rep.goodput == pytest.approx(24.0 / 40.0)
    assert rep.learners["a"].work_lost_s == 6.0


def test_gave_up_and_finished_time_is_not_allocated():
    evs = [
        change(0.0, S.TRAINING),
        change(10.0, S.GAVE_UP),
        change(0.0, S.COMPILING, "b"),
        change(5.0, S.TRAINING, "b"),
        change(25.0, S.FINISHED, "b"),
    ]
    rep = compute_goodput(evs, end_t=100.0, uptime_window_s=10.0)
    assert rep.learners["a"].allocated_s == 10.0
    assert rep.learners["b"].allocated_s == 25.0
    assert rep.learners["b"].seconds["finished"] == 75.0
    assert rep.goodput == pytest.approx(30.0 / 35.0)


def test_learners_sum_and_late_joiner_starts_at_its_first_event():
    evs = [
        change(0.0, S.TRAINING),
        LearnerRestarted(50.0, "b", incarnation=0, attempt=1, recovered_in_s=0.0),
        change(60.0, S.COMPILING, "b"),
        change(70.0, S.TRAINING, "b"),
    ]
    rep = compute_goodput(evs, end_t=100.0, uptime_window_s=10.0)
    b = rep.learners["b"]
    assert b.seconds["starting"] == 10.0  # before its first state change
    assert b.allocated_s == 50.0
    assert rep.goodput == pytest.approx((100.0 + 30.0) / (100.0 + 50.0))


def test_order_and_horizon():
    evs = [change(20.0, S.TRAINING, inc=1), change(0.0, S.TRAINING), change(10.0, S.DEAD)]
    evs.append(change(50.0, S.DEAD))  # after end_t: ignored
    rep = compute_goodput(evs, end_t=40.0, uptime_window_s=10.0)
    assert rep.learners["a"].seconds["training"] == 30.0
    assert rep.learners["a"].seconds["dead"] == 10.0


def test_no_learners():
    rep = compute_goodput(rounds(1.0), end_t=10.0, uptime_window_s=5.0)
    assert rep.goodput == 0.0
    assert rep.learners == {}


def test_uptime_with_a_gap():
    # Windows of 10 s over [5, 100] (from the first round): rounds in windows 0, 1, 2, 6 and
    # the partial 9th [95, 100] -> 45 s up of 95.
    rep = compute_goodput(rounds(5, 15, 16, 25, 65, 95), end_t=100.0, uptime_window_s=10.0)
    assert rep.uptime == pytest.approx(45.0 / 95.0)


def test_uptime_window_edges_and_partial_window():
    # [0, 95]: windows [0,10) ... [80,90), then the partial [90, 95].
    assert uptime([10.0], 0.0, 95.0, 10.0) == pytest.approx(10.0 / 95.0)  # 10.0 opens window 1
    assert uptime([1.0, 95.0], 0.0, 95.0, 10.0) == pytest.approx(15.0 / 95.0)  # end_t counts
    assert uptime([1.0, 92.0], 0.0, 95.0, 10.0) == pytest.approx(15.0 / 95.0)
    assert uptime([float(t) for t in range(0, 95, 3)], 0.0, 95.0, 10.0) == pytest.approx(1.0)
    assert uptime([], 0.0, 95.0, 10.0) == 0.0
    assert uptime([1.0], 5.0, 5.0, 10.0) == 0.0


def test_a_live_runs_open_window_is_not_counted_down_before_its_round_arrives():
    # Every round of [0, 95] reached the tape but the last window's, still on its way.
    closed = [float(t) for t in range(0, 90, 3)]
    assert uptime(closed, 0.0, 95.0, 10.0) == pytest.approx(90.0 / 95.0)  # the run is over
    assert uptime(closed, 0.0, 95.0, 10.0, open_end=True) == pytest.approx(1.0)
    # A round in the open window counts it, and a closed window without one stays down.
    assert uptime([*closed, 91.0], 0.0, 95.0, 10.0, open_end=True) == pytest.approx(1.0)
    gap = [t for t in closed if not 40 <= t < 50]
    assert uptime(gap, 0.0, 95.0, 10.0, open_end=True) == pytest.approx(80.0 / 90.0)
    # One window so far, no round in it: as when the run is over.
    assert uptime([], 0.0, 5.0, 10.0, open_end=True) == 0.0
    rep = compute_goodput(rounds(*closed), end_t=95.0, uptime_window_s=10.0, live=True)
    assert rep.uptime == pytest.approx(1.0)


def test_uptime_starts_at_the_first_round_of_the_run():
    # The round at 5 s is before the run started; booting until 25 s is no downtime:
    # [25, 40] in windows [25, 35) (up) and [35, 40] (down).
    evs = [RunStarted(20.0, "d"), *rounds(25.0, 5.0)]
    rep = compute_goodput(evs, end_t=40.0, uptime_window_s=10.0)
    assert rep.uptime == pytest.approx(10.0 / 15.0)
    assert compute_goodput([RunStarted(0.0, "d")], end_t=40.0, uptime_window_s=10.0).uptime == 0


def test_a_live_run_without_a_round_yet_has_no_uptime_not_zero():
    # Booting and compiling (all learners starting, no round on the tape): uptime is not
    # measured yet, so the live progress line shows none instead of an outage; the same tape
    # for a run that is over is a run that never advanced (0).
    evs = [RunStarted(0.0, "d"), change(0.0, S.STARTING), change(12.0, S.COMPILING)]
    assert compute_goodput(evs, end_t=18.0, uptime_window_s=10.0, live=True).uptime is None
    assert compute_goodput(evs, end_t=18.0, uptime_window_s=10.0).uptime == 0.0
    # The first round to reach the tape starts the measure.
    live = compute_goodput([*evs, *rounds(17.0)], end_t=18.0, uptime_window_s=10.0, live=True)
    assert live.uptime == pytest.approx(1.0)


def test_the_window_a_run_finished_in_is_no_stall():
    # Rounds every 3 s until 89 s; the learners hand in their last work and the run finishes
    # at 95 s: the partial window [90, 95] has no round and is left out.
    closed = [RunStarted(0.0, "d"), *rounds(*(float(t) for t in range(0, 90, 3)))]
    over = compute_goodput([*closed, RunFinished(95.0, 1_000, "budget")], 95.0, 10.0)
    assert over.uptime == pytest.approx(1.0)
    assert compute_goodput(closed, 95.0, 10.0).uptime == pytest.approx(90.0 / 95.0)
    # A resumed session (a RunStarted after the RunFinished) is a run going on again.
    again = [*closed, RunFinished(95.0, 1_000, "budget"), RunStarted(95.0, "d")]
    assert compute_goodput(again, 105.0, 10.0).uptime == pytest.approx(90.0 / 105.0)


def test_a_resumed_run_starts_every_learner_anew():
    # The first driver stopped at 30 s while `a` trained; the resumed session's RunStarted at
    # 30 s makes its boot (30..36 s) starting time, not training.
    evs = [RunStarted(0.0, "d"), change(0.0, S.TRAINING), RunStarted(30.0, "d")]
    evs.append(change(36.0, S.TRAINING))
    rep = compute_goodput(evs, end_t=40.0, uptime_window_s=10.0)
    assert rep.learners["a"].seconds["training"] == pytest.approx(34.0)
    assert rep.learners["a"].seconds["starting"] == pytest.approx(6.0)
    assert rep.goodput == pytest.approx(34.0 / 40.0)


def test_uptime_window_must_be_positive():
    with pytest.raises(ValueError):
        compute_goodput([], end_t=1.0, uptime_window_s=0.0)


def test_recovery_times_per_failure_kind():
    evs = [
        change(0.0, S.TRAINING),
        LearnerRejoined(1.0, "a", 0, {0: 1}, recovered_in_s=0.5),  # no failure yet: not recovery
        change(10.0, S.DEAD),
        FailureDetected(11.5, "a", FailureKind.CRASH, detection_s=1.5),
        LearnerRestarted(14.5, "a", incarnation=1, attempt=1, recovered_in_s=3.0),
        LearnerRejoined(18.5, "a", 1, {0: 3}, recovered_in_s=7.0),
        FailureDetected(30.0, "a", FailureKind.PREEMPTION, detection_s=0.2),
        FailureDetected(31.0, "b", FailureKind.CRASH, detection_s=2.5),
    ]
    rep = compute_goodput(evs, end_t=40.0, uptime_window_s=10.0)
    assert rep.num_failures == 3
    crash = rep.recovery["crash"]
    assert crash.detection_s == [1.5, 2.5]
    assert crash.restarted_in_s == [3.0]
    assert crash.rejoined_in_s == [7.0]
    assert rep.recovery["preemption"].rejoined_in_s == []
    assert rep.to_dict()["recovery"]["crash"]["detection_s"] == [1.5, 2.5]
