"""Layer: control (pure Python; no Ray, no JAX). What the synchronizer actor
remembers for people rather than for the algorithm: per-learner progress from reports, the
held-out evaluation history, and a bounded buffer of tape events that the driver drains.

Events carry wall-clock `t` (seconds since the epoch) because they cross processes and
machines; the driver rebases them onto its run clock before they go on the event tape.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any

from ray_diloco.control.events import Event
from ray_diloco.control.protocol import LearnerProgress

MAX_EVENTS = 10_000  # a driver that polls every few seconds never falls this far behind


@dataclass
class _Progress:
    step: int = 0
    cursor: int = 0
    loss: float | None = None
    step_time_s: float | None = None
    reports: int = 0
    last_report: float = 0.0  # wall clock


@dataclass
class Journal:
    learners: dict[str, _Progress] = field(default_factory=dict)
    evals: list[dict[str, float]] = field(default_factory=list)
    _events: collections.deque[tuple[int, dict[str, Any]]] = field(
        default_factory=lambda: collections.deque(maxlen=MAX_EVENTS)
    )
    _seq: int = 0

    def progress(
        self, learner: str, step: int, cursor: int, loss: float | None, step_time_s: float | None
    ) -> None:
        p = self.learners.setdefault(learner, _Progress())
        p.step, p.cursor = max(p.step, step), max(p.cursor, cursor)
        if loss is not None:
            p.loss = loss
        if step_time_s is not None:
            p.step_time_s = step_time_s
        p.reports += 1
        p.last_report = time.time()

    def record(self, event: Event) -> None:
        self._seq += 1
        self._events.append((self._seq, event.to_dict()))

    def events_since(self, seq: int) -> tuple[list[dict[str, Any]], int]:
        """Events after sequence number `seq`, and the newest sequence number."""
        return [e for s, e in self._events if s > seq], self._seq

    def eval_point(self, tokens: int, rounds: int, loss: float) -> dict[str, float]:
        point = {"time": time.time(), "tokens": tokens, "rounds": rounds, "heldout_loss": loss}
        self.evals.append(point)
        return point

    @property
    def last_loss(self) -> float | None:
        return self.evals[-1]["heldout_loss"] if self.evals else None

    def learner_table(self) -> dict[str, LearnerProgress]:
        now = time.time()
        return {
            name: LearnerProgress(
                p.step, p.cursor, p.loss, p.step_time_s, p.reports, now - p.last_report
            )
            for name, p in sorted(self.learners.items())
        }
