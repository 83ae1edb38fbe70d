"""Layer: algorithm (pure, no Ray, no JAX). Discrete-event goodput simulator at scale
(algorithm.md sections 9 and 10).

Three systems react to the same failure trace (`goodput_trace.make_trace`), on a virtual clock:

- `data_parallel`: one SPMD job over every slice. It stops while any slice is down, pays
  `restart_cost_s` to restart from its checkpoint once all are back, and loses the work done
  since its last checkpoint (taken every `checkpoint_interval_s` of running time; 0 means every
  step, i.e. the loss is folded into `restart_cost_s`). Checkpoint writes are free.
- `elastic_dp`: slice-granular. Every failure and every return pauses the whole job for
  `reconfig_pause_s` (a pause that starts during another restarts it); otherwise it trains on
  the healthy slices. The step in flight at a failure is folded into the pause.
- `decoupled`: M learners of about N/M chips (contiguous groups of slices). A learner is down
  while any of its slices is down and for `learner_restart_s` after (the `data_parallel` rule on
  its own slices); the others keep training. Learners contribute once per `round_period_s`
  (lognormal jitter, std/mean `straggler_cv`) to a real `rounds.RoundBook` with one fragment:
  register (a restart is a new incarnation), heartbeat, offer, poll, commit. A learner's time
  counts as productive only up to its last contribution that a committed round merged; the
  rest of an incarnation's work is lost when it dies.

Goodput = productive chip-seconds / (N chips * duration). Uptime = the fraction of windows of
`uptime_window_s` (default 2 x round_period_s, so one late contribution does not read as
downtime) in which the model advanced: a committed round for `decoupled`, kept training time
for the data-parallel systems (work later lost to a restart does not count).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ray_diloco.algorithm.goodput_trace import (
    FailureTrace,
    available,
    event_uptime,
    make_trace,
    window_uptime,
)
from ray_diloco.algorithm.rounds import ContributionMeta, RoundBook, RoundClose, RoundPolicy
from ray_diloco.config import DilocoConfig, GoodputSimConfig, SynchronizerConfig

logger = logging.getLogger(__name__)

_UP, _OFFER, _POLL, _COMMIT = range(4)  # event kinds; ties at equal times go in push order


@dataclass(frozen=True)
class SystemResult:
    """One system's outcome on one trace."""

    system: str  # data_parallel | elastic_dp | decoupled | elastic_dp_per_learner
    chips: int  # allocated chips, the whole cluster
    learners: int  # independent jobs the chips are split into (1 for the baselines)
    goodput: float
    uptime: float
    failures: int  # slice failures in the trace
    restarts: int  # job restarts, reconfigurations, or learner incarnations after the first
    rounds: int = 0  # rounds committed by the RoundBook (decoupled only)


def data_parallel(cfg: GoodputSimConfig, trace: FailureTrace) -> SystemResult:
    dur = trace.duration_s
    a, b = available(trace.fail_s, trace.return_s, cfg.restart_cost_s, dur)
    lost = np.zeros_like(a)
    failed = b < dur  # the segment ended in a failure, not at the end of the run
    if cfg.checkpoint_interval_s > 0:
        lost[failed] = np.mod(b[failed] - a[failed], cfg.checkpoint_interval_s)
    kept_end = b - lost
    return SystemResult(
        system="data_parallel",
        chips=int(trace.slice_chips.sum()),
        learners=1,
        goodput=float((kept_end - a).sum() / dur),
        uptime=window_uptime(a, kept_end, dur, cfg.uptime_window),
        failures=trace.num_failures,
        restarts=int(failed.sum()),
    )


def _elastic(
    cfg: GoodputSimConfig, trace: FailureTrace, lo: int, hi: int
) -> tuple[float, float, int]:
    """(goodput, uptime, reconfigurations) of one elastic job on slices [lo, hi)."""
    dur, pause = trace.duration_s, cfg.reconfig_pause_s
    mask = (trace.slice_id >= lo) & (trace.slice_id < hi)
    fail, ret = trace.fail_s[mask], trace.return_s[mask]
    chips = trace.slice_chips[trace.slice_id[mask]]
    total = int(trace.slice_chips[lo:hi].sum())
    back = ret < dur
    times = np.r_[fail, ret[back]]
    order = np.argsort(times, kind="stable")
    t = times[order]
    healthy = total + np.cumsum(np.r_[-chips, chips[back]][order])
    # Between events k and k+1 the job is paused for the first `pause` seconds: a pause begun
    # at an earlier event ends no later than the one begun at event k.
    starts = np.r_[0.0, t + pause]
    ends = np.r_[t, dur]
    h = np.r_[total, healthy]
    run = np.maximum(0.0, ends - starts)
    goodput = float((h * run).sum() / (total * dur))
    keep = (run > 0) & (h > 0)
    return goodput, window_uptime(starts[keep], ends[keep], dur, cfg.uptime_window), len(t)


def elastic_dp(cfg: GoodputSimConfig, trace: FailureTrace) -> SystemResult:
    g, u, n = _elastic(cfg, trace, 0, trace.num_slices)
    return SystemResult("elastic_dp", int(trace.slice_chips.sum()), 1, g, u, trace.num_failures, n)


def learner_groups(trace: FailureTrace, num_learners: int) -> list[tuple[int, int]]:
    """Contiguous slice ranges [lo, hi), one per learner, sizes differing by at most one."""
    bounds = np.linspace(0, trace.num_slices, num_learners + 1).round().astype(int)
    return list(itertools.pairwise(bounds.tolist()))


def elastic_per_learner(cfg: GoodputSimConfig, trace: FailureTrace) -> SystemResult:
    """M independent elastic jobs, one on each learner's slices: elastic data-parallel on
    N/M chips, averaged over M draws of the same trace (the comparison of section 10)."""
    groups = learner_groups(trace, cfg.num_learners)
    runs = [_elastic(cfg, trace, lo, hi) for lo, hi in groups]
    weights = np.array([trace.slice_chips[lo:hi].sum() for lo, hi in groups], dtype=float)
    goodput = float(np.dot([r[0] for r in runs], weights) / weights.sum())
    uptime = float(np.mean([r[1] for r in runs]))
    return SystemResult(
        "elastic_dp_per_learner",
        int(trace.slice_chips.sum()),
        cfg.num_learners,
        goodput,
        uptime,
        trace.num_failures,
        sum(r[2] for r in runs),
    )


def round_policy(
    cfg: GoodputSimConfig,
    num_learners: int,
    diloco: DilocoConfig | None = None,
    sync: SynchronizerConfig | None = None,
) -> RoundPolicy:
    """The synchronizer's policy (grace, fencing, guards from the run's config), K from `cfg`.

    The simulator coalesces a learner's progress reports into one per contribution, so the
    heartbeat timeout is widened by one (jittered) round period: a live learner never looks
    dead between two reports, and a dead one drops out of `live()` one period after its last.
    """
    diloco = diloco or DilocoConfig()
    sync = sync or SynchronizerConfig()
    base = RoundPolicy.from_config(diloco, sync, num_learners)
    timeout = cfg.round_period_s * (1 + 4 * cfg.straggler_cv) + sync.heartbeat_timeout_s
    return replace(base, quorum_min=min(cfg.quorum_min, num_learners), heartbeat_timeout_s=timeout)


class DecoupledSim:
    """M learners driving one real RoundBook on the virtual clock (section 5 and 7 rules)."""

    def __init__(
        self,
        cfg: GoodputSimConfig,
        trace: FailureTrace,
        diloco: DilocoConfig | None = None,
        sync: SynchronizerConfig | None = None,
    ) -> None:
        diloco = diloco or DilocoConfig()
        self.cfg, self.trace = cfg, trace
        m = cfg.num_learners
        self.book = RoundBook(round_policy(cfg, m, diloco, sync), 1, sync_time_s=cfg.sync_time_s)
        # A round period is H inner steps: the step time the grace window is computed from.
        self.step_time_s = cfg.round_period_s / diloco.sync_every
        groups = learner_groups(trace, m)
        self.chips = [int(trace.slice_chips[lo:hi].sum()) for lo, hi in groups]
        self.up: list[tuple[np.ndarray, np.ndarray]] = []
        for lo, hi in groups:
            mask = (trace.slice_id >= lo) & (trace.slice_id < hi)
            self.up.append(
                available(
                    trace.fail_s[mask],
                    trace.return_s[mask],
                    cfg.learner_restart_s,
                    trace.duration_s,
                )
            )
        self.commits_s: list[float] = []
        self.verdicts: Counter[str] = Counter()
        self.round_sizes: Counter[int] = Counter()  # contributions merged per round
        self.merged_until: dict[tuple[int, int], float] = {}  # (learner, incarnation) -> time

    def run(self) -> SystemResult:
        cfg, book, dur = self.cfg, self.book, self.trace.duration_s
        period, sync_s, step_s = cfg.round_period_s, cfg.sync_time_s, self.step_time_s
        names = [f"learner-{i}" for i in range(cfg.num_learners)]
        start = [0.0] * cfg.num_learners  # current incarnation's start and end
        end = [0.0] * cfg.num_learners
        # Jitter comes from its own stream so the failure trace stays identical across systems.
        jitter = self._jitter(np.random.default_rng([cfg.seed, 1]))
        heap: list[tuple[float, int, int, Any, int]] = []  # time, seq, kind, x, incarnation
        seq = itertools.count()
        polls: set[float] = set()
        merged = self.merged_until
        last_commit = 0.0  # learners up at a commit adopt the new version: counters restart

        def poll(now: float) -> None:
            # No deadline means no fragment has a quorum outside a merge: poll would close
            # nothing, so skip its live() scan.
            if book.next_deadline() is None:
                return
            for close in book.poll(now):
                heapq.heappush(heap, (now + sync_s, next(seq), _COMMIT, close, 0))
            deadline = book.next_deadline()
            if deadline is not None and deadline > now and deadline not in polls:
                polls.add(deadline)
                heapq.heappush(heap, (deadline, next(seq), _POLL, None, 0))

        for i, (a, _) in enumerate(self.up):
            if len(a):
                heapq.heappush(heap, (float(a[0]), next(seq), _UP, i, 0))
        while heap:
            t, _, kind, x, inc = heapq.heappop(heap)
            if t >= dur:
                break
            if kind == _OFFER:
                i = x
                steps = max(1, int((t - max(start[i], last_commit)) / step_s))
                book.heartbeat(names[i], inc, t, step_s)
                meta = ContributionMeta(
                    names[i],
                    inc,
                    0,
                    book.fragments[0].version,
                    int((t - start[i]) / step_s),
                    steps,
                    steps,
                )
                self.verdicts[book.offer(meta, t, payload=(i, inc, t))] += 1
                nxt = t + period * next(jitter)
                if nxt < end[i]:
                    heapq.heappush(heap, (nxt, next(seq), _OFFER, i, inc))
                poll(t)
            elif kind == _POLL:
                polls.discard(t)
                poll(t)
            elif kind == _COMMIT:
                assert isinstance(x, RoundClose)
                book.commit(x, sync_s, t)
                self.commits_s.append(t)
                self.round_sizes[len(x.contributions)] += 1
                last_commit = t
                for c in x.contributions:
                    key = c.payload[:2]
                    merged[key] = max(merged[key], c.payload[2])
                poll(t)
            else:  # _UP: incarnation `inc` of learner x starts
                i = x
                a_arr, b_arr = self.up[i]
                start[i], end[i] = float(a_arr[inc]), float(b_arr[inc])
                book.register(names[i], inc, t)
                book.heartbeat(names[i], inc, t, step_s)
                merged[(i, inc)] = t
                first = t + period * next(jitter)
                if first < end[i]:
                    heapq.heappush(heap, (first, next(seq), _OFFER, i, inc))
                if inc + 1 < len(a_arr):
                    heapq.heappush(heap, (float(a_arr[inc + 1]), next(seq), _UP, i, inc + 1))
        return self._result()

    def _jitter(self, rng: np.random.Generator) -> Iterator[float]:
        cv = self.cfg.straggler_cv
        while True:
            if cv == 0:
                yield 1.0
                continue
            # Lognormal with mean 1 and std/mean = cv: round times stay positive.
            s = math.sqrt(math.log1p(cv * cv))
            yield from rng.lognormal(-s * s / 2, s, 65_536).tolist()

    def _result(self) -> SystemResult:
        cfg, dur = self.cfg, self.trace.duration_s
        productive = 0.0
        for (i, inc), until in self.merged_until.items():
            productive += self.chips[i] * (until - float(self.up[i][0][inc]))
        chips = int(self.trace.slice_chips.sum())
        logger.debug("decoupled M=%d verdicts %s", cfg.num_learners, dict(self.verdicts))
        return SystemResult(
            system="decoupled",
            chips=chips,
            learners=cfg.num_learners,
            goodput=productive / (chips * dur),
            uptime=event_uptime(np.asarray(self.commits_s), dur, cfg.uptime_window),
            failures=self.trace.num_failures,
            restarts=len(self.merged_until) - sum(1 for a, _ in self.up if len(a)),
            rounds=len(self.commits_s),
        )


def simulate(
    cfg: GoodputSimConfig,
    diloco: DilocoConfig | None = None,
    sync: SynchronizerConfig | None = None,
    trace: FailureTrace | None = None,
) -> list[SystemResult]:
    """Every system on one trace of `cfg.chips` chips (drawn from `cfg.seed` unless given)."""
    trace = trace if trace is not None else make_trace(cfg)
    return [
        data_parallel(cfg, trace),
        elastic_dp(cfg, trace),
        DecoupledSim(cfg, trace, diloco, sync).run(),
        elastic_per_learner(cfg, trace),
    ]
