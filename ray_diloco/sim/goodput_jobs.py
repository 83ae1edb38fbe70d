"""Layer: sim (pure, no Ray, no JAX). How one job reacts to the failures of its slices:
when it runs and on how many chips (docs/algorithm.md section 10).

A job is a set of slices (`Slices`): the whole cluster (data-parallel, elastic data-parallel)
or one learner's group. Three reactions, each from `goodput_trace.stalls` (a failure stops a
running job for the cost of its recovery; one during a stall holds it until that slice too is
back and recovered), each losing the work since its last step boundary or checkpoint:

- `waiting`: the job stops until the failed slice is back, then pays `cost_s` (a
  data-parallel restart, or a learner's re-mesh around its hot spare) and goes on with all
  its slices.
- `shrinking`: the job pauses `cost_s` to re-mesh onto its healthy slices and goes on with
  fewer chips. A returned slice joins at the next re-mesh (the one under way, or the next
  failure's) rather than paying a pause of its own: at scale one comes within seconds, and
  waiting for it costs a slice's chips, not the whole job's. The limit: in a job of very
  few slices whose repairs outlast a re-mesh, a returned slice idles until the job's next
  failure (counted as lost chips), so there more, smaller jobs can do worse.
- a restarting learner is `waiting` whose every stall ends its incarnation (the caller
  counts the work it loses).

An `Activity` is the result: the intervals in which the job runs and the chips it runs on in
each, hence the chip-seconds it computes up to any time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ray_diloco.sim.goodput_trace import FailureTrace, complement, stalls


@dataclass(frozen=True)
class Activity:
    """A job's running intervals [starts, ends) and the chips it runs on in each."""

    duration_s: float
    total_chips: int
    starts: np.ndarray
    ends: np.ndarray
    chips: np.ndarray  # float, per interval
    num_stalls: int  # restarts or re-meshes

    @property
    def running_s(self) -> np.ndarray:
        return self.ends - self.starts

    @property
    def work(self) -> float:
        """Chip-seconds computed over the whole run."""
        return float((self.chips * self.running_s).sum())

    def running_before(self) -> np.ndarray:
        """Running seconds before each interval starts (the job's own clock)."""
        return np.r_[0.0, np.cumsum(self.running_s)[:-1]]

    def work_before(self) -> np.ndarray:
        """Chip-seconds computed before each interval starts."""
        return np.r_[0.0, np.cumsum(self.chips * self.running_s)[:-1]]

    def goodput(self) -> float:
        return self.work / (self.total_chips * self.duration_s)


@dataclass(frozen=True)
class Slices:
    """The failures of one job's slices, in time order, and the chips the job has."""

    duration_s: float
    total_chips: int
    fail_s: np.ndarray
    return_s: np.ndarray
    chips: np.ndarray  # chips of the slice each failure hits


def cluster(trace: FailureTrace) -> Slices:
    """Every slice of the trace: one job over the whole cluster."""
    chips = trace.slice_chips[trace.slice_id]
    total = int(trace.slice_chips.sum())
    return Slices(trace.duration_s, total, trace.fail_s, trace.return_s, chips)


def groups(trace: FailureTrace, bounds: list[int]) -> list[Slices]:
    """One job per contiguous group of slices [bounds[k], bounds[k+1]) (a learner's)."""
    out = []
    for k, idx in enumerate(trace.split(bounds)):
        total = int(trace.slice_chips[bounds[k] : bounds[k + 1]].sum())
        chips = trace.slice_chips[trace.slice_id[idx]]
        out.append(Slices(trace.duration_s, total, trace.fail_s[idx], trace.return_s[idx], chips))
    return out


def _recompute(a: np.ndarray, b: np.ndarray, dur: float, every_s: float) -> np.ndarray:
    """The ends of running intervals [a, b) less the work a failure loses: what was computed
    since the last step boundary (or checkpoint) every `every_s` of the interval. The run's
    last interval ends with the run, not with a failure, and keeps all of it."""
    if every_s <= 0:
        return b
    failed = b < dur
    return np.where(failed, b - np.mod(b - a, every_s), b)


def waiting(job: Slices, cost_s: float, every_s: float = 0.0) -> Activity:
    """A job that waits for every failed slice, then pays `cost_s`; a failure loses the
    work since its last step boundary or checkpoint (every `every_s` of running time)."""
    dur, total = job.duration_s, job.total_chips
    s, e = stalls(job.fail_s, job.return_s, cost_s, dur)
    a, b = complement(s, e, dur)
    b = _recompute(a, b, dur, every_s)
    return Activity(dur, total, a, b, np.full(len(a), float(total)), len(s))


def shrinking(job: Slices, pause_s: float, step_s: float = 0.0) -> Activity:
    """A job that re-meshes onto its healthy slices at every failure, losing its step in
    flight (`step_s` long): an all-reduce that a failed slice was part of does not finish."""
    dur, total, fail = job.duration_s, job.total_chips, job.fail_s
    s, e = stalls(fail, fail, pause_s, dur)
    a, b = complement(s, e, dur)
    # A slice is out from its failure until the end of the first re-mesh that ends after it is
    # back. Failures happen only in or at the start of a stall and slices rejoin only at stall
    # ends, so the chip count is constant over each running interval: evaluate it at starts.
    k = np.searchsorted(e, job.return_s, side="left")
    rejoin = np.where(k < len(e), e[np.minimum(k, len(e) - 1)], np.inf)
    out_chips = job.chips.astype(float)
    failed = np.r_[0.0, np.cumsum(out_chips)][np.searchsorted(fail, a, side="right")]
    order = np.argsort(rejoin, kind="stable")
    back_sorted = rejoin[order]
    rejoined = np.r_[0.0, np.cumsum(out_chips[order])][np.searchsorted(back_sorted, a, "right")]
    b = _recompute(a, b, dur, step_s)
    return Activity(dur, total, a, b, total - (failed - rejoined), len(s))
