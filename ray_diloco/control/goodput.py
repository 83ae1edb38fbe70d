"""Layer: control (pure Python; no Ray, no JAX). Goodput and uptime from an event tape.

Pure accounting over a list of events (docs/algorithm.md section 9), so the same numbers come out of
a live run, a replayed tape and the simulator. Definitions, precisely:

- A learner's time line starts at its first event of any kind that names it (`learner` field)
  and runs to `end_t`. Until its first `LearnerStateChanged` it counts as `starting`; after
  that each state holds until the learner's next change, or until a later `RunStarted` (a run
  resumed by a new driver on the same tape), which puts every learner back to `starting`.
- allocated = time line minus time in `gave_up`, `finished` and `left` (capacity no longer
  held: a learner that left on purpose costs nothing from then on, and is no failure).
- productive = time in `training` minus `WorkLost.seconds` (work a restart threw away), >= 0.
  Compiling, blocked, dead and restarting time is allocated but not productive.
- goodput = sum(productive) / sum(allocated) over learners (0.0 when nothing was allocated).
- uptime: [start, end_t] is cut into consecutive windows of `uptime_window_s` (the last one
  possibly shorter); a window is up when at least one `RoundClosed` falls in it (half-open
  [a, b), the final window closed at end_t). uptime = length of up windows / (end_t - start),
  so a final partial window counts pro-rata. start is the first round closed at or after the
  first `RunStarted.t` (else 0): before it there is no global model being trained to stall
  (booting and compiling are charged to goodput, not to uptime). No round at all: uptime 0
  for a run that is over, None (not measured yet) while it is live: a live run that is still
  booting has not stalled, and a 0 there read as an outage on the progress line.
  While a run is live (`live=True`) its last window is still open: without a round in it yet
  it is left out, not counted down, because a round reaches the tape only once a learner has
  received its publication, a second or more after it closed. So is the last window of a run
  whose tape says it finished (`RunFinished` after its last `RunStarted`): after the last
  round the learners only hand in their final work and stop, which is no stall (it read
  0.984 for a run without a fault); a stall that ended the run still shows in every window
  but its last.

Events after `end_t` are ignored. Events may come in any order; ties keep tape order.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from ray_diloco.control.events import (
    Event,
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

log = logging.getLogger(__name__)

UNALLOCATED = frozenset({LearnerState.GAVE_UP, LearnerState.FINISHED, LearnerState.LEFT})


@dataclass(frozen=True)
class LearnerBreakdown:
    """One learner's seconds per state (every LearnerState value is a key) and its totals."""

    seconds: dict[str, float]
    allocated_s: float
    productive_s: float
    work_lost_s: float


@dataclass(frozen=True)
class RecoveryTimes:
    """Per failure kind: detection delays, and time from detection to restart and to rejoin."""

    detection_s: list[float]
    restarted_in_s: list[float]
    rejoined_in_s: list[float]


@dataclass(frozen=True)
class GoodputReport:
    goodput: float
    uptime: float | None  # None: a live run with no round yet
    allocated_s: float
    productive_s: float
    num_failures: int
    learners: dict[str, LearnerBreakdown]
    recovery: dict[str, RecoveryTimes]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Timeline:
    """Accumulates one learner's seconds per state as state changes arrive in time order."""

    def __init__(self, t0: float) -> None:
        self.state = LearnerState.STARTING
        self.since = t0
        self.seconds = {s.value: 0.0 for s in LearnerState}
        self.work_lost_s = 0.0

    def change(self, t: float, state: LearnerState) -> None:
        self.seconds[self.state.value] += t - self.since
        # LearnerState(...) also accepts a plain string from a hand-built event.
        self.state, self.since = LearnerState(state), t

    def close(self, end_t: float) -> LearnerBreakdown:
        self.change(end_t, self.state)
        allocated = sum(v for k, v in self.seconds.items() if LearnerState(k) not in UNALLOCATED)
        productive = self.seconds[LearnerState.TRAINING.value] - self.work_lost_s
        if productive < 0:
            log.warning(
                "work lost (%.1fs) exceeds training time (%.1fs); productive time clamped to 0",
                self.work_lost_s,
                self.seconds[LearnerState.TRAINING.value],
            )
            productive = 0.0
        return LearnerBreakdown(dict(self.seconds), allocated, productive, self.work_lost_s)


def compute_goodput(
    events: Iterable[Event], end_t: float, uptime_window_s: float, live: bool = False
) -> GoodputReport:
    """Goodput, uptime, per-learner breakdown and recovery times (see the module docstring)."""
    if uptime_window_s <= 0:
        raise ValueError(f"uptime_window_s={uptime_window_s} must be > 0")
    evs = sorted((e for e in events if e.t <= end_t), key=lambda e: e.t)
    lines: dict[str, _Timeline] = {}
    recovery: dict[str, RecoveryTimes] = {}
    pending: dict[str, str] = {}  # learner -> kind of the failure it is recovering from
    rounds: list[float] = []
    run_start: float | None = None
    finished = False
    num_failures = 0
    for e in evs:
        learner = getattr(e, "learner", None)
        if isinstance(learner, str) and learner not in lines:
            lines[learner] = _Timeline(e.t)
        if isinstance(e, LearnerStateChanged):
            lines[e.learner].change(e.t, e.state)
        elif isinstance(e, WorkLost):
            lines[e.learner].work_lost_s += e.seconds
        elif isinstance(e, FailureDetected):
            num_failures += 1
            kind = FailureKind(e.failure).value
            pending[e.learner] = kind
            _times(recovery, kind).detection_s.append(e.detection_s)
        elif isinstance(e, LearnerRestarted) and e.learner in pending:
            _times(recovery, pending[e.learner]).restarted_in_s.append(e.recovered_in_s)
        elif isinstance(e, LearnerRejoined) and e.learner in pending:
            _times(recovery, pending.pop(e.learner)).rejoined_in_s.append(e.recovered_in_s)
        elif isinstance(e, RoundClosed):
            rounds.append(e.t)
        elif isinstance(e, RunStarted):
            # A resumed run (a new driver session on the same tape) starts every learner anew.
            for tl in lines.values():
                tl.change(e.t, LearnerState.STARTING)
            run_start = e.t if run_start is None else run_start
            finished = False
        elif isinstance(e, RunFinished):
            finished = True
    breakdown = {name: tl.close(end_t) for name, tl in sorted(lines.items())}
    start = 0.0 if run_start is None else run_start
    first_round = min((t for t in rounds if t >= start), default=None)
    allocated = sum(b.allocated_s for b in breakdown.values())
    productive = sum(b.productive_s for b in breakdown.values())
    return GoodputReport(
        goodput=productive / allocated if allocated > 0 else 0.0,
        uptime=(
            (None if live else 0.0)
            if first_round is None
            else uptime(rounds, first_round, end_t, uptime_window_s, open_end=live or finished)
        ),
        allocated_s=allocated,
        productive_s=productive,
        num_failures=num_failures,
        learners=breakdown,
        recovery=recovery,
    )


def _times(recovery: dict[str, RecoveryTimes], kind: str) -> RecoveryTimes:
    return recovery.setdefault(kind, RecoveryTimes([], [], []))


def uptime(
    round_times: Iterable[float], start: float, end: float, window_s: float, open_end: bool = False
) -> float:
    """Fraction of [start, end] in fixed windows of `window_s` that saw a round close; with
    `open_end`, a last window without a round is left out (it may still see one, or the run
    ended in it)."""
    span = end - start
    if span <= 0:
        return 0.0
    num_windows = math.ceil(span / window_s)
    up: set[int] = set()
    for t in round_times:
        if start <= t <= end:
            # A round exactly at `end` belongs to the last (closed) window.
            up.add(min(int((t - start) // window_s), num_windows - 1))
    if open_end and num_windows > 1 and num_windows - 1 not in up:
        span = (num_windows - 1) * window_s
        end = start + span
    up_s = sum(min(window_s, end - (start + k * window_s)) for k in up)
    return up_s / span
