"""The supervisor's pure controller on a hand-driven clock."""

from __future__ import annotations

from ray_diloco.config import SupervisorConfig
from ray_diloco.control.events import (
    FailureDetected,
    FailureKind,
    LearnerRejoined,
    LearnerRestarted,
    LearnerState,
    LearnerStateChanged,
)
from ray_diloco.control.protocol import LearnerRow
from ray_diloco.control.supervision import KillLearner, StartLearner, Supervision

CFG = SupervisorConfig(
    heartbeat_timeout_s=2.0, startup_timeout_s=10.0, restart_backoff_s=0.5, max_crash_restarts=1
)


def kinds(events):
    return [type(e).__name__ for e in events]


def test_crash_is_fenced_restarted_and_rejoins_in_order():
    sup = Supervision(CFG, ["a", "b"], now=0.0)
    sup.heartbeat("a", 0, now=1.0)
    events, commands = sup.failed("a", 0, FailureKind.CRASH, now=1.5)
    assert kinds(events) == ["FailureDetected", "LearnerStateChanged", "LearnerStateChanged"]
    assert events[0].detection_s == 0.5
    assert commands == [KillLearner("a", 0, rebuild_group=False)]
    assert sup.tick(now=1.9) == ([], [])  # backoff 0.5 s not over
    events, commands = sup.tick(now=2.0)
    assert commands == [StartLearner("a", 1)]
    assert isinstance(events[0], LearnerRestarted) and events[0].recovered_in_s == 0.5
    # a late answer from the fenced incarnation changes nothing
    assert sup.heartbeat("a", 0, now=2.1) == []
    (state,) = sup.heartbeat("a", 1, now=3.0)
    assert state.state is LearnerState.TRAINING
    (rejoined,) = sup.contributed("a", 1, now=4.0, versions={0: 7})
    assert isinstance(rejoined, LearnerRejoined) and rejoined.recovered_in_s == 2.5
    assert sup.contributed("a", 1, now=5.0, versions={0: 8}) == []  # only the first counts


def test_silence_is_a_hang_and_rebuilds_the_group():
    sup = Supervision(CFG, ["a"], now=0.0)
    sup.heartbeat("a", 0, now=1.0)
    assert sup.tick(now=3.0) == ([], [])  # exactly at the timeout: not yet
    events, commands = sup.tick(now=3.1)
    detected = next(e for e in events if isinstance(e, FailureDetected))
    assert detected.failure is FailureKind.HANG and abs(detected.detection_s - 2.1) < 1e-9
    assert commands == [KillLearner("a", 0, rebuild_group=True)]


def test_starting_learner_gets_the_startup_timeout_and_budget_runs_out():
    sup = Supervision(CFG, ["a"], now=0.0)
    assert sup.tick(now=9.0) == ([], [])  # still starting: 10 s allowed
    sup.heartbeat("a", 0, now=9.5)
    sup.failed("a", 0, FailureKind.CRASH, now=10.0)
    sup.tick(now=11.0)  # restarted as incarnation 1
    sup.heartbeat("a", 1, now=11.5)
    events, commands = sup.failed("a", 1, FailureKind.CRASH, now=12.0)
    assert isinstance(commands[0], KillLearner)
    gave_up = [e for e in events if isinstance(e, LearnerStateChanged)][-1]
    assert gave_up.state is LearnerState.GAVE_UP
    assert sup.tick(now=100.0) == ([], [])  # never restarted again


def test_preemption_has_its_own_budget():
    sup = Supervision(CFG, ["a"], now=0.0)
    for i in range(3):  # crash budget is 1, preemption budget the default 20
        sup.heartbeat("a", i, now=10.0 * i + 1)
        _, commands = sup.failed("a", i, FailureKind.PREEMPTION, now=10.0 * i + 2)
        assert commands == [KillLearner("a", i, rebuild_group=False)]
        _, started = sup.tick(now=10.0 * i + 9)
        assert started == [StartLearner("a", i + 1)]


def test_multi_host_learner_is_heard_when_every_host_answered_and_as_fresh_as_the_stalest():
    sup = Supervision(CFG, ["a"], now=0.0, num_hosts={"a": 2})
    assert sup.heartbeat("a", 0, now=1.0, host=0, state=LearnerState.COMPILING) == []
    (changed,) = sup.heartbeat("a", 0, now=1.2, host=1)
    assert changed.state is LearnerState.COMPILING  # host 0 speaks for the learner
    (changed,) = sup.heartbeat("a", 0, now=2.0, host=0, state=LearnerState.TRAINING)
    assert changed.state is LearnerState.TRAINING
    # host 1 hangs: host 0 keeps answering, but the learner is as fresh as host 1 (t=1.2)
    for t in (3.0, 3.2):
        assert sup.heartbeat("a", 0, now=t, host=0, state=LearnerState.TRAINING) == []
    events, commands = sup.tick(now=3.3)
    detected = next(e for e in events if isinstance(e, FailureDetected))
    assert detected.failure is FailureKind.HANG and abs(detected.detection_s - 2.1) < 1e-9
    assert commands == [KillLearner("a", 0, rebuild_group=True)]
    # the new incarnation must hear from both hosts again
    _, started = sup.tick(now=3.8)
    assert started == [StartLearner("a", 1)]
    assert sup.heartbeat("a", 1, now=4.0, host=1) == []
    (changed,) = sup.heartbeat("a", 1, now=4.1, host=0)
    assert changed.state is LearnerState.TRAINING


def test_numerical_failure_restarts_without_rebuild_and_finished_is_final():
    sup = Supervision(CFG, ["a", "b"], now=0.0)
    sup.heartbeat("a", 0, now=1.0)
    _, commands = sup.failed("a", 0, FailureKind.NUMERICAL, now=1.5, detail="non_finite")
    assert commands == [KillLearner("a", 0, rebuild_group=False)]
    assert sup.snapshot()["a"].state is LearnerState.RESTARTING
    (done,) = sup.finished("a", now=1.6, reason="run over")
    assert done.state is LearnerState.FINISHED and done.reason == "run over"
    assert sup.finished("a", now=1.7) == []
    assert sup.tick(now=10.0)[1] == []  # the pending restart was cancelled
    snap = sup.snapshot()
    assert snap["a"].restarts == snap["a"].crash_restarts == 1
    assert snap["b"] == LearnerRow(
        state=LearnerState.STARTING,
        incarnation=0,
        restarts=0,
        crash_restarts=0,
        preemption_restarts=0,
    )


def test_a_learner_answering_slowly_under_load_is_not_hung_but_a_hang_is_found():
    sup = Supervision(CFG, ["a"], now=0.0)
    t = 0.0
    for _ in range(20):  # a busy machine: answers 1.5 s apart, past none of the timeouts
        t += 1.5
        sup.heartbeat("a", 0, now=t)
        assert sup.tick(now=t) == ([], [])
    assert sup.timeouts("a") == {0: 4.5}  # 3 x the 99th percentile gap, above the 2 s floor
    assert sup.tick(now=t + 3.0) == ([], [])  # a slow answer (3 s > the floor) is no hang
    assert sup.overdue(now=t + 4.5) == []
    assert sup.overdue(now=t + 4.6) == ["a"]
    events, commands = sup.tick(now=t + 4.6)
    detected = next(e for e in events if isinstance(e, FailureDetected))
    assert detected.failure is FailureKind.HANG and detected.timeout_s == 4.5
    assert "host 0 silent for 4.6s" in detected.detail
    assert commands == [KillLearner("a", 0, rebuild_group=True)]


def test_an_idle_machine_keeps_the_configured_timeout():
    sup = Supervision(CFG, ["a"], now=0.0)
    for i in range(1, 200):
        sup.heartbeat("a", 0, now=0.25 * i)
    assert sup.timeouts("a") == {0: 2.0}
    last = 0.25 * 199
    assert sup.tick(now=last + 2.0) == ([], [])
    events, _ = sup.tick(now=last + 2.05)
    assert any(isinstance(e, FailureDetected) for e in events)


def test_the_startup_timeout_follows_the_runs_boots():
    sup = Supervision(CFG, ["a"], now=0.0)  # startup floor 10 s, factor 2
    sup.heartbeat("a", 0, now=8.0)  # a slow boot, still within the floor
    assert sup.startup_timeout_s() == 16.0
    sup.failed("a", 0, FailureKind.CRASH, now=9.0)
    _, started = sup.tick(now=9.5)
    assert started == [StartLearner("a", 1)]
    assert sup.tick(now=25.4) == ([], [])  # 15.9 s starting: the floor alone would have fired
    events, _ = sup.tick(now=25.6)
    (detected,) = [e for e in events if isinstance(e, FailureDetected)]
    assert detected.learner == "a" and detected.timeout_s == 16.0
    assert detected.detail == "not up after 16.1s"


def test_a_compiling_learner_is_judged_by_the_startup_timeout():
    """Its first step's compile sends nothing for a while: not a hang at the heartbeat timeout."""
    sup = Supervision(CFG, ["a"], now=0.0)
    sup.heartbeat("a", 0, now=1.0, state=LearnerState.COMPILING)  # up: its first step compiles
    assert sup.watches["a"].state is LearnerState.COMPILING
    heartbeat = max(sup.timeouts("a").values())
    assert sup.tick(now=1.0 + heartbeat + 1.0)[0] == []
    events, _ = sup.tick(now=1.0 + sup.startup_timeout_s() + 0.5)
    (detected,) = [e for e in events if isinstance(e, FailureDetected)]
    assert detected.failure is FailureKind.HANG and detected.detail.startswith("compiling")
