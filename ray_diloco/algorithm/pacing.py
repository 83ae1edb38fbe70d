"""Layer: algorithm (pure, no Ray). How long an emulated learner's inner step takes.

The reference run (`sim/simulate.py`) advances its virtual clock by these durations and the Ray
learner pads each real step to them (`runtime/learner/host.py`), so a learner configured at
speed 0.82 with 10% jitter is just as slow, in the same seeded pattern, in both.
"""

from __future__ import annotations

import numpy as np

from ray_diloco.config import LearnerGroupConfig, RunConfig


class StepClock:
    """Seeded per-learner step durations: `step_time_s / speed`, with relative jitter."""

    def __init__(self, cfg: RunConfig, lg: LearnerGroupConfig, index: int) -> None:
        self.base = cfg.step_time_s / lg.speed
        self.jitter = lg.jitter
        self.rng = np.random.default_rng([cfg.seed, index])

    def next(self) -> float:
        noise = self.rng.standard_normal() * self.jitter if self.jitter else 0.0
        return self.base * max(0.1, 1.0 + noise)
