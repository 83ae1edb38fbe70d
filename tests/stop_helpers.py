"""A `stop_when` for `run_training` in tests whose checks need an event (a fault settled, a
shard restored): their runs train to a token ceiling and stop themselves once it came."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ray_diloco.control.protocol import SupervisorStatus

if TYPE_CHECKING:  # (the driver imports Ray; the annotation alone needs no import at run time)
    from ray_diloco.runtime.driver import StopWhen


def stop_after(event: Callable[[SupervisorStatus], bool], budget: int, reason: str) -> StopWhen:
    """Stop with `reason` once `event(supervisor_status)` held and the run has trained a
    quarter of `budget` past that moment, and at least `budget` in all: what comes after the
    event (a restored shard's rounds, the training that follows a late recovery) is part of
    what the test checks."""
    after: list[int] = []

    def stop(sup: SupervisorStatus) -> str | None:
        tokens = sup.synchronizer.tokens
        if not after and event(sup):
            after.append(tokens + budget // 4)
        return reason if after and tokens >= max(budget, after[0]) else None

    return stop
