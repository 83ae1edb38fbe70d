"""Layer: control (pure Python; no Ray, no JAX). Failure-detection timeouts that adapt to load.

A fixed heartbeat timeout is tuned for one machine: on an idle one a hung host is found in two
seconds, but on a busy one (every core taken by other jobs, a neighbour compiling) an honest
host's answers arrive seconds apart and it is "found hung", killed and restarted, which loads
the machine more. Like a phi-accrual detector, a `Cadence` learns how a signal arrives (the
gaps between a host's heartbeat answers, or how long learners took to boot) and times out
relative to that: `factor` times a high quantile of the recent gaps, never below the configured
floor (what an idle machine needs: detection stays as fast as before) nor above the ceiling (on
however slow a machine, a hang is still found). The quantile rather than the mean or the
maximum: one long stall among a hundred answers says little, a few do.
"""

from __future__ import annotations

import math
from collections import deque

QUANTILE = 0.99  # of the recent gaps; with WINDOW gaps, about the second largest
WINDOW = 128  # gaps remembered: ~30 s of answers at the default poll interval
MIN_GAPS = 8  # fewer than this says nothing yet: the floor applies


class Cadence:
    """Arrivals of one signal and the timeout they imply (times are the caller's clock)."""

    def __init__(
        self, floor_s: float, factor: float, ceiling_s: float, min_gaps: int = MIN_GAPS
    ) -> None:
        if not 0 < floor_s <= ceiling_s or factor < 1:
            raise ValueError(f"need 0 < floor {floor_s} <= ceiling {ceiling_s}, factor >= 1")
        self.floor_s, self.factor, self.ceiling_s = floor_s, factor, ceiling_s
        self.min_gaps = min_gaps
        self.gaps: deque[float] = deque(maxlen=WINDOW)
        self.last: float | None = None
        self._timeout_s = floor_s

    def arrived(self, now: float) -> None:
        """The signal arrived now (the gap since the last arrival is learned)."""
        if self.last is not None:
            self.add_gap(now - self.last)
        self.last = now

    def add_gap(self, gap_s: float) -> None:
        """Learn one gap directly (e.g. how long a boot took)."""
        if math.isfinite(gap_s) and gap_s >= 0:
            self.gaps.append(gap_s)
            self._timeout_s = self._compute()

    def forget_last(self) -> None:
        """The source restarted: its next arrival starts a new series (no gap across it)."""
        self.last = None

    def timeout_s(self) -> float:
        return self._timeout_s

    def _compute(self) -> float:
        if len(self.gaps) < self.min_gaps:
            return self.floor_s
        ordered = sorted(self.gaps)
        typical = ordered[min(len(ordered) - 1, int(QUANTILE * len(ordered)))]
        return min(self.ceiling_s, max(self.floor_s, self.factor * typical))
