"""Restart policy: exponential backoff with a cap, separate crash and preemption budgets."""

from __future__ import annotations

import pytest

from ray_diloco.config import SupervisorConfig
from ray_diloco.control.events import GiveUp, Restart
from ray_diloco.control.policy import FailureKind, RestartPolicy


def policy(**kw) -> RestartPolicy:
    base = dict(
        restart_backoff_s=0.5,
        restart_backoff_max_s=3.0,
        max_crash_restarts=3,
        max_preemption_restarts=5,
    )
    base.update(kw)
    return RestartPolicy(SupervisorConfig(**base))


def test_backoff_doubles_then_caps():
    p = policy(max_crash_restarts=10)
    delays = []
    for i in range(6):
        d = p.decide("a", FailureKind.CRASH, now=float(i))
        assert isinstance(d, Restart)
        assert d.attempt == i + 1
        delays.append(d.delay_s)
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]


def test_crash_budget_runs_out_then_give_up_is_final():
    p = policy()
    for _ in range(3):
        assert isinstance(p.decide("a", FailureKind.CRASH, 0.0), Restart)
    d = p.decide("a", FailureKind.HANG, 0.0)
    assert isinstance(d, GiveUp)
    assert "crash" in d.reason
    # Once given up, even a preemption (whose budget is untouched) does not restart it.
    assert isinstance(p.decide("a", FailureKind.PREEMPTION, 0.0), GiveUp)


def test_budgets_are_separate():
    p = policy(max_crash_restarts=1, max_preemption_restarts=3)
    for _ in range(3):
        assert isinstance(p.decide("a", FailureKind.PREEMPTION, 0.0), Restart)
    # Three preemptions did not touch the crash budget...
    assert isinstance(p.decide("a", FailureKind.NUMERICAL, 0.0), Restart)
    # ...and the crash budget of 1 is now spent.
    assert isinstance(p.decide("a", FailureKind.CRASH, 0.0), GiveUp)
    q = policy(max_crash_restarts=1, max_preemption_restarts=1)
    assert isinstance(q.decide("b", FailureKind.NODE_LOST, 0.0), Restart)
    assert isinstance(q.decide("b", FailureKind.PREEMPTION, 0.0), GiveUp)


def test_learners_have_their_own_books():
    p = policy(max_crash_restarts=1)
    assert isinstance(p.decide("a", FailureKind.CRASH, 0.0), Restart)
    assert isinstance(p.decide("a", FailureKind.CRASH, 0.0), GiveUp)
    b = p.decide("b", FailureKind.CRASH, 0.0)
    assert isinstance(b, Restart)
    assert b.delay_s == 0.5


def test_zero_budget_gives_up_at_once():
    p = policy(max_crash_restarts=0)
    assert isinstance(p.decide("a", FailureKind.CRASH, 0.0), GiveUp)


def test_record_healthy_resets_backoff_but_not_budget():
    p = policy(max_crash_restarts=3)
    assert p.decide("a", FailureKind.CRASH, 0.0).delay_s == 0.5  # type: ignore[union-attr]
    assert p.decide("a", FailureKind.CRASH, 1.0).delay_s == 1.0  # type: ignore[union-attr]
    p.record_healthy("a")
    d = p.decide("a", FailureKind.CRASH, 40.0)
    assert isinstance(d, Restart)
    assert d.delay_s == 0.5
    assert d.attempt == 1
    assert isinstance(p.decide("a", FailureKind.CRASH, 50.0), GiveUp)


@pytest.mark.parametrize(
    ("failure", "rebuild"),
    [
        (FailureKind.CRASH, False),
        (FailureKind.PREEMPTION, False),
        (FailureKind.NUMERICAL, False),
        (FailureKind.HANG, True),
        (FailureKind.PARTITION, True),
        (FailureKind.NODE_LOST, True),
    ],
)
def test_rebuild_group(failure, rebuild):
    d = policy().decide("a", failure, 0.0)
    assert isinstance(d, Restart)
    assert d.rebuild_group is rebuild


def test_accepts_plain_string_kind():
    d = policy().decide("a", "hang", 0.0)  # type: ignore[arg-type]
    assert isinstance(d, Restart)
    assert d.rebuild_group
