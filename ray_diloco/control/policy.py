"""Layer: control (pure Python; no Ray, no JAX). The supervisor's restart policy.

Given a classified failure (classification of Ray errors lives in runtime/errors.py, this module
never sees an exception), `RestartPolicy.decide` returns a `Restart` or a `GiveUp`; the supervisor
executes it. Two separate budgets, because the two kinds of failure mean different things:
preemptions and lost nodes are the platform taking capacity back and say nothing about the learner,
so they get a large budget (`max_preemption_restarts`); crashes, hangs, partitions and numerical
failures may be the learner's own fault and repeat forever, so they get a small one
(`max_crash_restarts`). Restarts back off exponentially; `record_healthy` resets the backoff (not
the budgets) once a restarted learner trains again, so a learner that fails once a day restarts
quickly every time while a flapping one slows down and then runs out of budget.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ray_diloco.config import SupervisorConfig
from ray_diloco.control.events import FailureKind, GiveUp, Restart, StopReason

__all__ = ["FailureKind", "LearnerRestartBook", "RestartPolicy", "restart_after_stop"]

log = logging.getLogger(__name__)

PREEMPTION_KINDS = frozenset({FailureKind.PREEMPTION, FailureKind.NODE_LOST})
# A hung or partitioned host, or a lost node, leaves the multi-host learner's collective in an
# unknown state on the other hosts too: the whole group is rebuilt, not one host restarted.
REBUILD_GROUP_KINDS = frozenset({FailureKind.HANG, FailureKind.PARTITION, FailureKind.NODE_LOST})


def restart_after_stop(reason: StopReason, run_over: bool) -> bool:
    """A learner whose loop finished by itself trains again unless the run is over or it
    stopped at the token budget: a fenced incarnation, or one told to stop while the run goes
    on, has work left to do."""
    return not (run_over or reason is StopReason.BUDGET)


@dataclass
class LearnerRestartBook:
    """Per-learner counters; `attempt` drives the backoff, the two `*_restarts` the budgets."""

    attempt: int = 0
    crash_restarts: int = 0
    preemption_restarts: int = 0
    gave_up: bool = False


class RestartPolicy:
    """Decides, per failure, whether and when a learner is restarted."""

    def __init__(self, cfg: SupervisorConfig) -> None:
        self._cfg = cfg
        self._books: dict[str, LearnerRestartBook] = {}

    def book(self, learner: str) -> LearnerRestartBook:
        """The learner's counters (created on first use); callers should treat it as read-only."""
        return self._books.setdefault(learner, LearnerRestartBook())

    def backoff_s(self, attempt: int) -> float:
        """`restart_backoff_s * 2**(attempt-1)` capped at `restart_backoff_max_s`."""
        if attempt < 1:
            return 0.0
        # min() on the exponent first keeps 2**n finite for very long-running flapping learners.
        delay = self._cfg.restart_backoff_s * 2.0 ** min(attempt - 1, 1023)
        return min(delay, self._cfg.restart_backoff_max_s)

    def decide(self, learner: str, failure: FailureKind, now: float) -> Restart | GiveUp:
        """Restart with backoff while the failure's budget lasts, then give up for good."""
        failure = FailureKind(failure)
        b = self.book(learner)
        if b.gave_up:
            return GiveUp(learner, f"{failure.value} after the learner was given up")
        preemption = failure in PREEMPTION_KINDS
        used = b.preemption_restarts if preemption else b.crash_restarts
        limit = self._cfg.max_preemption_restarts if preemption else self._cfg.max_crash_restarts
        budget = "preemption" if preemption else "crash"
        if used >= limit:
            b.gave_up = True
            reason = f"{failure.value}: {budget} restart budget spent ({used}/{limit})"
            log.warning("giving up on learner %s at t=%.1f: %s", learner, now, reason)
            return GiveUp(learner, reason)
        if preemption:
            b.preemption_restarts += 1
        else:
            b.crash_restarts += 1
        b.attempt += 1
        delay = self.backoff_s(b.attempt)
        reason = (
            f"{failure.value}: {budget} restart {used + 1}/{limit}, attempt {b.attempt}, "
            f"backoff {delay:.2f}s"
        )
        log.info("restarting learner %s at t=%.1f: %s", learner, now, reason)
        return Restart(
            learner=learner,
            delay_s=delay,
            reason=reason,
            rebuild_group=failure in REBUILD_GROUP_KINDS,
            attempt=b.attempt,
        )

    def record_healthy(self, learner: str) -> None:
        """The learner trained healthily again: its next restart waits `restart_backoff_s`
        again. Budgets are not refunded, so a learner cannot fail forever."""
        b = self.book(learner)
        b.attempt = 0
