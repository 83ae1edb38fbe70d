"""Layer: sim (pure, no Ray, no JAX). Failure traces, stalls and uptime windows for the
goodput simulator (docs/algorithm.md section 10).

A cluster of N chips is cut into slices of `chips_per_slice` (the unit that fails and is
replaced; the last slice holds the remainder). Each slice alternates between up and down: its
up times are exponential with rate `slice_chips / (mtbi_chip_days * 86400)` (chips fail as
independent Poisson processes, and the minimum of independent exponentials is exponential with
the summed rate), its down times are drawn from the recovery distribution. A down slice cannot
fail again. The whole trace comes from one seeded numpy Generator, once per cluster, drawn in
blocks of cycles for all slices at once (a few tens of ms for 2.4M chips), and every system
reads the same trace, so the systems differ only in how they react to it.

The "recovery" of a slice is the time until the job has a working slice in its place again:
with hot spares (the default) a swap, not a repair; the repair of the failed unit then happens
off the job's critical path.

Recovery distributions, each set by its median so that switching the family keeps the typical
delay and changes only the tail:
- `lognormal` (default): median `recovery_median_s`, shape `recovery_sigma`. Repair of failed
  hardware is heavy-tailed: most units come back quickly, a few wait for parts or a technician
  for hours. In the failure logs of Los Alamos HPC systems (Schroeder and Gibson, "A
  large-scale study of failures in high-performance computing systems", DSN 2006) repair
  times are well modeled by a lognormal distribution; a scripted swap from a spare pool has a
  narrower spread (a smaller sigma).
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
    fail_s: np.ndarray  # failure times, sorted (so every subset of slices is sorted too)
    return_s: np.ndarray  # when that slice is up again (may lie past duration_s)
    slice_id: np.ndarray  # which slice failed

    @property
    def num_slices(self) -> int:
        return len(self.slice_chips)

    @property
    def num_failures(self) -> int:
        return len(self.fail_s)

    def split(self, bounds: list[int]) -> list[np.ndarray]:
        """Indices of the failures of each group of slices [bounds[k], bounds[k+1]), in time
        order: one sort for all groups instead of a pass over the trace per group."""
        group = np.searchsorted(np.asarray(bounds), self.slice_id, side="right") - 1
        order = np.argsort(group, kind="stable")  # stable: time order within each group
        cuts = np.searchsorted(group[order], np.arange(1, len(bounds) - 1))
        return np.split(order, cuts)


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
    fail, back = fail[keep], cycle_end[keep]
    order = np.argsort(fail, kind="stable")
    trace = FailureTrace(duration, sizes, fail[order], back[order], slice_id[order])
    logger.debug("trace: %d slices, %d failures", trace.num_slices, trace.num_failures)
    return trace


# -- stalls and windows ---------------------------------------------------------------------


def stalls(
    fail_s: np.ndarray, return_s: np.ndarray, cost_s: float, duration_s: float
) -> tuple[np.ndarray, np.ndarray]:
    """Intervals [start, end) in which a job that needs these slices is stopped.

    A failure while the job runs stops it until the failed slice is back, plus `cost_s` (a
    restart or a re-mesh: detection included). A failure while it is already stopped is
    repaired in parallel, and what it costs is the recovery of its own slice: the stall
    lasts at least until that slice is back and has paid `cost_s`. The recovery under way
    cannot take the slice in before then: a restart needs every slice, the new one with its
    processes started, its program compiled and its state reloaded (however much of that
    runs in parallel with the other slices'), and a re-mesh onto the healthy slices that
    began before this one failed includes it and must be redone once the failure is
    detected. So a stall ends `cost_s` after its last slice is back: goodput falls like
    exp(-lambda d) with d the cost of one failure (for swaps quick against d), not like
    1 / (1 + lambda d), which would hold if a failure during a stall cost nothing. `fail_s`
    must be sorted; pass `return_s = fail_s` for a job that does not wait for the slice (a
    re-mesh onto the healthy ones). Ends are clipped to `duration_s`.
    """
    starts: list[float] = []
    ends: list[float] = []
    end = -math.inf
    # Sequential by nature (whether a failure starts a stall depends on the previous ones);
    # a plain loop over Python floats costs ~0.2 us per failure.
    for f, r in zip(fail_s.tolist(), return_s.tolist(), strict=True):
        if f >= end:
            end = r + cost_s
            starts.append(f)
            ends.append(end)
        elif r + cost_s > end:
            end = r + cost_s
            ends[-1] = end
    return np.asarray(starts, dtype=float), np.minimum(np.asarray(ends, dtype=float), duration_s)


def complement(
    starts: np.ndarray, ends: np.ndarray, duration_s: float
) -> tuple[np.ndarray, np.ndarray]:
    """The running intervals of [0, duration) around sorted disjoint stalls [start, end)."""
    a = np.r_[0.0, ends]
    b = np.r_[starts, duration_s]
    keep = b > a
    return a[keep], b[keep]


def windows_touched(
    starts: np.ndarray, ends: np.ndarray, window_s: float
) -> tuple[np.ndarray, np.ndarray]:
    """The windows [k W, (k+1) W) that sorted disjoint intervals [start, end) overlap, as
    disjoint ranges of window indices [first, stop)."""
    keep = ends > starts
    first = np.floor(starts[keep] / window_s).astype(np.int64)
    stop = np.ceil(ends[keep] / window_s).astype(np.int64)  # one past the last window touched
    if len(first) == 0:
        return first, stop
    # Neighbouring intervals may touch the same window: merge ranges that overlap or abut.
    new = np.r_[True, first[1:] > stop[:-1]]
    head = np.flatnonzero(new)
    return first[head], np.maximum.reduceat(stop, head)


def num_windows(duration_s: float, window_s: float) -> int:
    return max(1, math.ceil(duration_s / window_s))


def window_uptime(
    starts: np.ndarray, ends: np.ndarray, duration_s: float, window_s: float
) -> float:
    """Fraction of windows [k W, (k+1) W) that overlap at least one interval [start, end)."""
    first, stop = windows_touched(starts, ends, window_s)
    return float((stop - first).sum()) / num_windows(duration_s, window_s)
