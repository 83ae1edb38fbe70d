"""Whether a learner that finished on its own is restarted is decided on its `StopReason`,
never on the words beside it (runtime/supervisor/health.py, control/policy.py)."""

from __future__ import annotations

from typing import Any

import pytest

from ray_diloco.config import SupervisorConfig
from ray_diloco.control.events import Event, FailureKind, LearnerState, StopReason
from ray_diloco.control.policy import restart_after_stop
from ray_diloco.control.supervision import Supervision
from ray_diloco.runtime.supervisor.health import HealthDuty


class _Health(HealthDuty):
    """The health duty with its host's collaborators real (Supervision) or recording."""

    def __init__(self, run_over: bool) -> None:
        self.control = Supervision(SupervisorConfig(), ["a"], now=0.0)
        self._run_over, self._leaving = run_over, {}
        self.events: list[Event] = []
        self.restarts: list[tuple[str, FailureKind, str]] = []

    def _record_all(self, events: list[Event]) -> None:
        self.events.extend(events)

    def _failed(self, name: str, incarnation: int, kind: FailureKind, now: float, detail: str):
        self.restarts.append((name, kind, detail))


def _finished(reason: StopReason, detail: str, run_over: bool = False) -> _Health:
    health = _Health(run_over)
    reply: dict[str, Any] = {"incarnation": 0, "state": "finished"}
    health._on_reply("a", 0, {**reply, "stop_reason": reason.value, "stop_detail": detail}, 1.0)
    return health


@pytest.mark.parametrize("detail", ["token budget reached", "", "anything at all"])
def test_the_words_beside_a_stop_never_decide_a_restart(detail: str) -> None:
    budget = _finished(StopReason.BUDGET, detail)
    assert budget.restarts == [] and budget.control.watches["a"].state is LearnerState.FINISHED
    fenced = _finished(StopReason.FENCED, detail)
    assert [(n, k) for n, k, _ in fenced.restarts] == [("a", FailureKind.CRASH)]
    assert fenced.events == []


def test_once_the_run_is_over_no_stop_restarts() -> None:
    for reason in StopReason:
        assert not restart_after_stop(reason, run_over=True)
        assert _finished(reason, "token budget reached", run_over=True).restarts == []
    assert [r for r in StopReason if restart_after_stop(r, run_over=False)] == [
        StopReason.REQUESTED,
        StopReason.LEFT,
        StopReason.FENCED,
    ]
