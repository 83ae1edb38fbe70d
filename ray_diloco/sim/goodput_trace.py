"""Layer: algorithm (pure, no Ray, no JAX). Failure traces and interval algebra for the goodput
simulator (algorithm.md section 10).

A cluster of N chips is cut into slices of `chips_per_slice` (the unit that fails and is
replaced; the last slice holds the remainder). Each slice alternates between up and down: its
up times are exponential with rate `slice_chips / (mtbi_chip_days * 86400)` (chips fail as
independent Poisson processes, and the minimum of independent exponentials is exponential with
the summed rate), its down times are drawn from the recovery distribution. A down slice cannot
fail again. The whole trace comes from one seeded numpy Generator, once per cluster, and every
system reads the same trace, so the systems differ only in how they react to it.

Recovery distributions, each set by its median so that switching the family keeps the typical
delay and changes only the tail:
- `lognormal` (default): median `recovery_median_s`, shape `recovery_sigma`. Repair and
  replacement of failed hardware is heavy-tailed: most units come back quickly, a few wait for
  parts or a technician for hours. In the failure logs of Los Alamos HPC systems (Schroeder and
  Gibson, "A large-scale study of failures in high-performance computing systems", DSN 2006)
  repair times are well modeled by a lognormal distribution.
- `exponential`: mean `recovery_median_s / ln 2`. Memoryless; used for closed-form checks.
- `pareto`: tail index `recovery_sigma` (> 1 for a finite mean), scale chosen so the median is
  `recovery_median_s`. The heaviest tail: a power law.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from ray_diloco.config import GoodputSimConfig

logger = logging.getLogger(__name__)

SECONDS_PER_DAY = 86_400.0


def sample_recovery(
    cfg: GoodputSimConfig, rng: np.random.Generator, shape: tuple[int, ...]
) -> np.ndarray:
    """Recovery delays in seconds from the configured heavy-tailed family (see module doc)."""
    median = cfg.recovery_median_s
    if cfg.recovery == "lognormal":
        return rng.lognormal(math.log(median), cfg.recovery_sigma, shape)
    if cfg.recovery == "exponential":
        return rng.exponential(median / math.log(2.0), shape)
    alpha = cfg.recovery_sigma
    # numpy's pareto is the Lomax form; (1 + X) * x_m is the classic Pareto with median
    # x_m * 2^(1/alpha).
    return median / 2.0 ** (1.0 / alpha) * (1.0 + rng.pareto(alpha, shape))


def mean_recovery_s(cfg: GoodputSimConfig) -> float:
    """The mean of the recovery distribution (inf for a pareto tail index <= 1)."""
    m, s = cfg.recovery_median_s, cfg.recovery_sigma
    if cfg.recovery == "lognormal":
        return m * math.exp(s * s / 2.0)
    if cfg.recovery == "exponential":
        return m / math.log(2.0)
    return math.inf if s <= 1 else m / 2.0 ** (1.0 / s) * s / (s - 1.0)


@dataclass(frozen=True)
class FailureTrace:
    """Every slice failure in [0, duration): when, which slice, and when the slice is back."""

    duration_s: float
    slice_chips: np.ndarray  # chips in each slice (int64)
    fail_s: np.ndarray  # failure times, sorted per slice
    return_s: np.ndarray  # when that slice is up again (may lie past duration_s)
    slice_id: np.ndarray  # which slice failed

    @property
    def num_slices(self) -> int:
        return len(self.slice_chips)

    @property
    def num_failures(self) -> int:
        return len(self.fail_s)

    def of_slices(self, lo: int, hi: int) -> np.ndarray:
        """Mask of the failures of slices [lo, hi) (a learner's contiguous group)."""
        return (self.slice_id >= lo) & (self.slice_id < hi)


def slice_sizes(chips: int, chips_per_slice: int) -> np.ndarray:
    num = -(-chips // chips_per_slice)
    sizes = np.full(num, chips_per_slice, dtype=np.int64)
    sizes[-1] = chips - (num - 1) * chips_per_slice
    return sizes


def make_trace(cfg: GoodputSimConfig, chips: int | None = None) -> FailureTrace:
    """Draw the alternating up/down trace of every slice from one Generator seeded by cfg.seed."""
    rng = np.random.default_rng(cfg.seed)
    duration = cfg.duration_days * SECONDS_PER_DAY
    sizes = slice_sizes(cfg.chips if chips is None else chips, cfg.chips_per_slice)
    rate = sizes / (cfg.mtbi_chip_days * SECONDS_PER_DAY)  # per slice, per second
    # Enough cycles per block for the fastest-failing slice, so one block usually suffices.
    cycle = 1.0 / rate.max() + min(mean_recovery_s(cfg), duration)
    width = int(1.5 * duration / cycle) + 8
    ups, downs = [], []
    start = np.zeros(len(sizes))
    # Blocks of cycles for all slices at once; draw more only while some slice's trace ends
    # before `duration` (a slice whose drawn cycles already pass the end is simply cut).
    while True:
        up = rng.exponential(1.0, (len(sizes), width)) / rate[:, None]
        down = sample_recovery(cfg, rng, (len(sizes), width))
        ups.append(up)
        downs.append(down)
        start = start + (up + down).sum(axis=1)
        if start.min() >= duration:
            break
    up = np.concatenate(ups, axis=1)
    down = np.concatenate(downs, axis=1)
    cycle_end = np.cumsum(up + down, axis=1)
    fail = cycle_end - down
    keep = fail < duration
    slice_id = np.broadcast_to(np.arange(len(sizes))[:, None], fail.shape)[keep]
    trace = FailureTrace(duration, sizes, fail[keep], cycle_end[keep], slice_id)
    logger.debug("trace: %d slices, %d failures", trace.num_slices, trace.num_failures)
    return trace


# -- interval algebra -----------------------------------------------------------------------


def union(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge intervals [start, end) into sorted disjoint ones."""
    if len(starts) == 0:
        return starts, ends
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    reach = np.maximum.accumulate(e)
    # A new merged interval begins where a start lies beyond everything reached before it.
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > reach[:-1]
    first = np.flatnonzero(new)
    last = np.r_[first[1:] - 1, len(s) - 1]
    return s[first], reach[last]


def available(
    fail_s: np.ndarray, return_s: np.ndarray, restart_s: float, duration_s: float
) -> tuple[np.ndarray, np.ndarray]:
    """Intervals in which a job that needs every one of these slices is running.

    The job is stopped from a failure until the failed slice is back plus `restart_s`; a
    failure during a restart stops it again and the restart begins anew once all slices are
    back. So the stopped set is exactly the union of [fail, return + restart_s), and the job
    runs on its complement. The job starts at time 0 without a restart.
    """
    down_s, down_e = union(fail_s, np.minimum(return_s + restart_s, duration_s))
    starts = np.r_[0.0, down_e]
    ends = np.r_[down_s, duration_s]
    keep = ends > starts
    return starts[keep], ends[keep]


def window_uptime(
    starts: np.ndarray, ends: np.ndarray, duration_s: float, window_s: float
) -> float:
    """Fraction of windows [k W, (k+1) W) that overlap at least one interval [start, end)."""
    num = max(1, math.ceil(duration_s / window_s))
    keep = ends > starts
    first = np.floor(starts[keep] / window_s).astype(np.int64)
    stop = np.ceil(ends[keep] / window_s).astype(np.int64)  # one past the last window touched
    cover = np.zeros(num + 1, dtype=np.int64)
    np.add.at(cover, np.minimum(first, num), 1)
    np.add.at(cover, np.minimum(stop, num), -1)
    return float(np.count_nonzero(np.cumsum(cover)[:num] > 0)) / num


def event_uptime(times: np.ndarray, duration_s: float, window_s: float) -> float:
    """Fraction of windows that contain at least one event (a commit of the global model)."""
    num = max(1, math.ceil(duration_s / window_s))
    idx = np.floor(np.asarray(times) / window_s).astype(np.int64)
    return float(len(np.unique(idx[(idx >= 0) & (idx < num)]))) / num
