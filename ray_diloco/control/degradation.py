"""Layer: control (pure Python; no Ray, no JAX). Learners that live but do not help.

A straggler or a learner behind a cut link answers every heartbeat, so the supervisor's
failure detection never fires, and with a quorum of one nothing waits for it. It is still worth
seeing on the event tape: `DegradationMonitor` turns two observations into `LearnerDegraded` /
`LearnerRecovered` events and never into commands (a slow learner is not restarted).

- `slow_steps`: the learner's step rate, measured over windows of `window_s`, fell below
  `1 / slow_ratio` of its own baseline (the best of its first windows, then an exponential
  moving average of its healthy windows)
  for `confirm_windows` windows in a row; it recovers at the first window back above
  `1 / recover_ratio` of the baseline. Comparing a learner with itself, not with the others,
  keeps a v6e learner that is simply slower than a v5p one from being called a straggler.
- `no_contributions`: the learner trains (its steps advance) but none of its contributions was
  merged for `starve_s`; it recovers when one is merged again.
- `norm_outlier` (or any other rejection reason the caller passes to `rejected`): the
  synchronizer's norm guard refused a contribution. The model is protected by the rejection and
  the learner heals itself by adopting the next published version of that fragment, so it is
  not restarted; it recovers when a contribution of it is merged again.

The caller resets a learner when a new incarnation starts (its compile phase is no baseline).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ray_diloco.control.events import Event, LearnerDegraded, LearnerRecovered

log = logging.getLogger(__name__)

SLOW, STARVED = "slow_steps", "no_contributions"


@dataclass
class _Track:
    window_start: float | None = None
    window_step: int = 0
    baseline: float | None = None
    healthy_windows: int = 0
    low_windows: int = 0
    last_merged: int = -1
    last_merged_s: float | None = None
    last_step: int = 0
    ready_s: float | None = None  # when the baseline was complete: the learner trains steadily
    degraded: dict[str, float] = field(default_factory=dict)  # cause -> since


class DegradationMonitor:
    def __init__(
        self,
        learners: list[str],
        window_s: float = 1.0,
        slow_ratio: float = 2.5,
        recover_ratio: float = 1.5,
        confirm_windows: int = 2,
        baseline_windows: int = 2,
        starve_s: float = 3.0,
        ema: float = 0.3,
    ) -> None:
        self.window_s, self.slow_ratio, self.recover_ratio = window_s, slow_ratio, recover_ratio
        self.confirm_windows, self.baseline_windows = confirm_windows, baseline_windows
        self.starve_s, self.ema = starve_s, ema
        self.tracks = {name: _Track() for name in learners}

    def add(self, learner: str) -> None:
        """A learner joined the run: watch it too."""
        self.tracks.setdefault(learner, _Track())

    def reset(self, learner: str, now: float) -> list[Event]:
        """A new incarnation starts: forget the baseline; open degradations end here."""
        events: list[Event] = [
            LearnerRecovered(now, learner, cause, now - since)
            for cause, since in sorted(self.tracks[learner].degraded.items())
        ]
        self.tracks[learner] = _Track()
        return events

    def degraded(self, learner: str) -> list[str]:
        return sorted(self.tracks[learner].degraded)

    def steps(self, learner: str, step: int, now: float) -> list[Event]:
        """Host 0 of a training learner reported inner step `step` at `now`."""
        tr = self.tracks[learner]
        tr.last_step = max(tr.last_step, step)
        if tr.window_start is None:
            tr.window_start, tr.window_step = now, step
            return []
        span = now - tr.window_start
        if span < self.window_s:
            return []
        rate = (step - tr.window_step) / span
        tr.window_start, tr.window_step = now, step
        return self._judge_rate(learner, tr, rate, now)

    def _judge_rate(self, learner: str, tr: _Track, rate: float, now: float) -> list[Event]:
        if tr.baseline is None or tr.healthy_windows < self.baseline_windows:
            # The best of the first windows, not their average: early windows are only ever
            # slower (the tail of compilation, a peer compiling on the same cores), and a
            # baseline dragged down by them hides a real straggler later.
            tr.baseline = rate if tr.baseline is None else max(tr.baseline, rate)
            tr.healthy_windows += 1
            if tr.healthy_windows >= self.baseline_windows:
                tr.ready_s = now
            return []
        if SLOW in tr.degraded:
            if rate * self.recover_ratio >= tr.baseline:
                since = tr.degraded.pop(SLOW)
                tr.low_windows = 0
                return [LearnerRecovered(now, learner, SLOW, now - since)]
            return []
        if rate * self.slow_ratio < tr.baseline:
            tr.low_windows += 1
            if tr.low_windows >= self.confirm_windows:
                tr.degraded[SLOW] = now
                detail = f"{rate:.1f} steps/s, baseline {tr.baseline:.1f}"
                log.info("learner %s is a straggler: %s", learner, detail)
                return [LearnerDegraded(now, learner, SLOW, detail)]
            return []
        tr.low_windows = 0
        tr.baseline = _mix(tr.baseline, rate, self.ema)
        return []

    def merged(self, learner: str, contributions: int, now: float) -> list[Event]:
        """The synchronizer has merged `contributions` of this learner so far (a counter)."""
        tr = self.tracks[learner]
        if contributions < tr.last_merged:
            # The synchronizer came back from a checkpoint with fewer merges on its ledger:
            # count from there, without calling it progress.
            tr.last_merged = contributions
        if tr.last_merged_s is None or contributions > tr.last_merged:
            first = tr.last_merged_s is None
            tr.last_merged, tr.last_merged_s = contributions, now
            if not first:  # its work counts again: every cause but slowness is over
                over = sorted(c for c in tr.degraded if c != SLOW)
                return [LearnerRecovered(now, learner, c, now - tr.degraded.pop(c)) for c in over]
        return []

    def rejected(self, learner: str, reason: str, now: float) -> list[Event]:
        """The synchronizer refused a contribution of the learner for `reason`."""
        tr = self.tracks[learner]
        if reason in tr.degraded:
            return []
        tr.degraded[reason] = now
        log.info("learner %s: contribution rejected (%s)", learner, reason)
        return [LearnerDegraded(now, learner, reason, "contribution rejected")]

    def check_starved(self, learner: str, now: float) -> list[Event]:
        """Call while the learner trains: degraded once nothing of it was merged for
        `starve_s` although its steps kept advancing."""
        tr = self.tracks[learner]
        if STARVED in tr.degraded or tr.last_merged_s is None or tr.ready_s is None:
            return []
        # Counted from when it trains steadily: compiling is not starving.
        silent = now - max(tr.last_merged_s, tr.ready_s)
        if silent <= self.starve_s:
            return []
        tr.degraded[STARVED] = now
        detail = f"nothing merged for {silent:.1f}s at step {tr.last_step}"
        log.info("learner %s contributes nothing: %s", learner, detail)
        return [LearnerDegraded(now, learner, STARVED, detail)]


def _mix(old: float, new: float, a: float) -> float:
    return a * new + (1 - a) * old
