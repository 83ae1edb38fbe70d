"""Stragglers and starved learners from step counters and merge counters, on a hand clock."""

from __future__ import annotations

from ray_diloco.control.degradation import SLOW, STARVED, DegradationMonitor
from ray_diloco.control.events import LearnerDegraded, LearnerRecovered


def drive(mon: DegradationMonitor, rate: float, t0: float, t1: float, step0: int) -> tuple:
    """Report steps at `rate` every 0.25 s from t0 to t1; returns (events, last step)."""
    events, t, step = [], t0, step0
    while t < t1 - 1e-9:
        t += 0.25
        step += round(rate * 0.25)
        events += mon.steps("a", step, t)
    return events, step


def test_a_straggler_is_detected_against_its_own_baseline_and_recovers():
    mon = DegradationMonitor(["a"], window_s=1.0, slow_ratio=2.5, confirm_windows=2)
    events, step = drive(mon, 40, 0.0, 5.0, 0)
    assert events == []
    events, step = drive(mon, 8, 5.0, 8.0, step)  # 5x slower
    (slow,) = events
    assert isinstance(slow, LearnerDegraded) and slow.cause == SLOW
    assert 6.2 < slow.t < 7.3 and mon.degraded("a") == [SLOW]
    events, step = drive(mon, 40, 8.0, 10.0, step)
    (back,) = events
    assert isinstance(back, LearnerRecovered) and back.degraded_s == back.t - slow.t


def test_a_slow_start_does_not_hide_a_later_straggler():
    # The first window still compiles (0.3 steps/s): the baseline is the learner's best early
    # window, so a 3x slowdown later is seen.
    mon = DegradationMonitor(["a"], window_s=1.0, slow_ratio=2.5, confirm_windows=2)
    events, step = drive(mon, 0.3, 0.0, 1.05, 0)
    events, step = drive(mon, 30, 1.05, 3.1, step)
    assert events == []
    events, _ = drive(mon, 10, 6.0, 9.0, step)
    assert [e.cause for e in events if isinstance(e, LearnerDegraded)] == [SLOW]


def test_a_slower_learner_is_not_a_straggler():
    mon = DegradationMonitor(["a"])
    events, _ = drive(mon, 10, 0.0, 10.0, 0)
    assert events == []


def test_no_merge_while_training_is_starvation_until_a_merge_arrives():
    mon = DegradationMonitor(["a"], window_s=1.0, starve_s=3.0, baseline_windows=2)
    mon.merged("a", 0, now=0.0)
    drive(mon, 20, 0.0, 2.5, 0)  # windows end at 1.25 and 2.25: baseline ready at t=2.25
    assert mon.check_starved("a", now=5.2) == []  # time before the baseline does not count
    (starved,) = mon.check_starved("a", now=5.3)
    assert isinstance(starved, LearnerDegraded) and starved.cause == STARVED
    assert mon.check_starved("a", now=6.0) == []  # reported once
    assert mon.merged("a", 0, now=6.5) == []  # same counter: still nothing new
    (back,) = mon.merged("a", 3, now=7.0)
    assert isinstance(back, LearnerRecovered) and back.cause == STARVED
    assert abs(back.degraded_s - 1.7) < 1e-9


def test_reset_closes_open_degradations():
    mon = DegradationMonitor(["a"], starve_s=1.0)
    mon.merged("a", 1, now=0.0)
    drive(mon, 20, 0.0, 3.0, 0)
    assert mon.check_starved("a", now=4.5)
    (closed,) = mon.reset("a", now=5.0)
    assert isinstance(closed, LearnerRecovered) and closed.cause == STARVED
    assert mon.degraded("a") == [] and mon.check_starved("a", now=20.0) == []


def test_a_ledger_rolled_back_by_a_synchronizer_restore_is_no_progress():
    mon = DegradationMonitor(["a"], starve_s=1.0)
    mon.merged("a", 10, now=0.0)
    drive(mon, 20, 0.0, 3.0, 0)
    assert mon.check_starved("a", now=4.5)
    assert mon.merged("a", 7, now=5.0) == []  # restored from a checkpoint: not a merge
    (back,) = mon.merged("a", 8, now=5.5)
    assert isinstance(back, LearnerRecovered) and back.t == 5.5


def test_a_rejected_contribution_degrades_until_a_merge():
    mon = DegradationMonitor(["a"])
    mon.merged("a", 4, now=0.0)
    (bad,) = mon.rejected("a", "norm_outlier", now=1.0)
    assert isinstance(bad, LearnerDegraded) and bad.cause == "norm_outlier"
    assert mon.rejected("a", "norm_outlier", now=1.5) == []
    (back,) = mon.merged("a", 5, now=2.0)
    assert isinstance(back, LearnerRecovered) and back.cause == "norm_outlier"
    assert back.degraded_s == 1.0 and mon.degraded("a") == []
