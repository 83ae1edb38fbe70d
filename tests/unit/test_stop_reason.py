"""Whether a learner that finished on its own is restarted is decided on its `StopReason`,
never on the words beside it (runtime/supervisor/health.py, control/policy.py)."""

from __future__ import annotations

import pytest

from ray_diloco.control.events import LearnerState, StopReason
from ray_diloco.control.policy import restart_after_stop
from ray_diloco.control.supervision import KillLearner
from tests.supervisor_fakes import Supervised


def _finished(reason: StopReason, detail: str, run_over: bool = False) -> Supervised:
    sup = Supervised(["a"])
    sup.phase.over = run_over
    sup.ping("a", LearnerState.FINISHED, 1.0, stop=reason, detail=detail)
    return sup


@pytest.mark.parametrize("detail", ["token budget reached", "", "anything at all"])
def test_the_words_beside_a_stop_never_decide_a_restart(detail: str) -> None:
    budget = _finished(StopReason.BUDGET, detail)
    assert budget.commands == [] and budget.control.watches["a"].state is LearnerState.FINISHED
    fenced = _finished(StopReason.FENCED, detail)
    assert [type(c) for c in fenced.commands] == [KillLearner]
    assert "failure_detected" in fenced.kinds()
    assert fenced.control.watches["a"].state is not LearnerState.FINISHED


def test_once_the_run_is_over_no_stop_restarts() -> None:
    for reason in StopReason:
        assert not restart_after_stop(reason, run_over=True)
        assert _finished(reason, "token budget reached", run_over=True).commands == []
    assert [r for r in StopReason if restart_after_stop(r, run_over=False)] == [
        StopReason.REQUESTED,
        StopReason.LEFT,
        StopReason.FENCED,
    ]
