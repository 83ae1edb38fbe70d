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
  rest of an incarnation's work is lost when it dies. A contribution still pending when its
  learner dies is kept by the book and merged later, so it counts. A commit publishes at once
  to every live learner (they adopt it, so their counters restart); work still unmerged when
  the run ends (at most a round period per learner) is not counted.
- `elastic_dp_per_learner`: the comparison of section 10, elastic data-parallel on N/M chips,
  run as M independent elastic jobs, one on each learner's slices, goodput averaged.

Hardware fails on its own schedule, so the trace does not pause while a job is stopped.
Cost: the decoupled system is dominated by the RoundBook, about 20-25 us of CPU per
contribution; the default 30-day sweep takes about 20 s. A coarser `round_period_s` is faster
but changes the answer, since a dying learner loses up to a round period of work.

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ray_diloco.algorithm.rounds import ContributionMeta, RoundBook, RoundClose, RoundPolicy
from ray_diloco.config import DilocoConfig, GoodputSimConfig, SynchronizerConfig
from ray_diloco.sim.goodput_trace import (
    FailureTrace,
    available,
    event_uptime,
    make_trace,
    window_uptime,
)

logger = logging.getLogger(__name__)

_UP, _OFFER, _POLL, _COMMIT = range(4)  # event kinds


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
    mask = trace.of_slices(lo, hi)
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
    if num_learners > trace.num_slices:
        raise ValueError(
            f"{num_learners} learners need at least as many slices; the cluster has "
            f"{trace.num_slices}. Raise goodput_sim.chips or lower goodput_sim.chips_per_slice"
        )
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
            mask = trace.of_slices(lo, hi)
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
        self.names = [f"learner-{i}" for i in range(m)]
        self._start = [0.0] * m  # current incarnation's start and end, per learner
        self._end = [0.0] * m
        self._last_commit = 0.0
        self._heap: list[tuple[float, int, int, Any, int]] = []  # time, seq, kind, x, inc
        self._seq = itertools.count()  # ties at equal times go in push order
        self._polls: set[float] = set()  # deadlines already scheduled
        self._jit: Iterator[float] = iter(())

    def run(self) -> SystemResult:
        """Replay the trace: learners come up, contribute and die; the book closes rounds."""
        # Jitter comes from its own stream so the failure trace stays identical across systems.
        self._jit = self._jitter(np.random.default_rng([self.cfg.seed, 1]))
        for i, (a, _) in enumerate(self.up):
            if len(a):
                self._push(float(a[0]), _UP, i, 0)
        dur, heap, pop = self.trace.duration_s, self._heap, heapq.heappop
        handlers: dict[int, Callable[[float, Any, int], None]] = {
            _UP: self._on_up,
            _OFFER: self._on_offer,
            _COMMIT: self._on_commit,
        }
        while heap:
            t, _, kind, x, inc = pop(heap)
            if t >= dur:
                break
            if kind == _POLL:
                self._polls.discard(t)
                self._poll(t)
            else:
                handlers[kind](t, x, inc)
        return self._result()

    def _push(self, t: float, kind: int, x: Any, inc: int) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, x, inc))

    def _poll(self, now: float) -> None:
        """What the synchronizer does after every event: close due rounds, note the deadline."""
        book = self.book
        # No deadline means no fragment has a quorum outside a merge: poll would close nothing,
        # so skip its live() scan. A poll that closes nothing changes nothing.
        deadline = book.next_deadline()
        if deadline is None:
            return
        closes = book.poll(now)
        for close in closes:
            self._push(now + self.cfg.sync_time_s, _COMMIT, close, 0)
        if closes:
            deadline = book.next_deadline()
        if deadline is not None and deadline > now and deadline not in self._polls:
            self._polls.add(deadline)
            self._push(deadline, _POLL, None, 0)

    def _on_up(self, t: float, i: int, inc: int) -> None:
        """Incarnation `inc` of learner i starts: it registers and adopts the current version."""
        starts, ends = self.up[i]
        self._start[i], self._end[i] = t, float(ends[inc])
        self.book.register(self.names[i], inc, t)
        self.book.heartbeat(self.names[i], inc, t, self.step_time_s)
        self.merged_until[(i, inc)] = t
        first = t + self.cfg.round_period_s * next(self._jit)
        if first < self._end[i]:
            self._push(first, _OFFER, i, inc)
        if inc + 1 < len(starts):
            self._push(float(starts[inc + 1]), _UP, i, inc + 1)

    def _on_offer(self, t: float, i: int, inc: int) -> None:
        """One contribution; its progress report doubles as the heartbeat (see round_policy)."""
        book, step_s, start = self.book, self.step_time_s, self._start[i]
        # The learner's counters restart whenever it adopts a version: at its start or at the
        # last commit (every live learner gets each published version).
        steps = max(1, int((t - max(start, self._last_commit)) / step_s))
        book.heartbeat(self.names[i], inc, t, step_s)
        version = book.fragments[0].version
        meta = ContributionMeta(
            self.names[i], inc, 0, version, int((t - start) / step_s), steps, steps
        )
        # The payload says whose work up to when: it comes back in the RoundClose.
        self.verdicts[book.offer(meta, t, payload=(i, inc, t))] += 1
        nxt = t + self.cfg.round_period_s * next(self._jit)
        if nxt < self._end[i]:
            self._push(nxt, _OFFER, i, inc)
        self._poll(t)

    def _on_commit(self, t: float, close: RoundClose, _: int) -> None:
        """The merge is done and published: the merged work now belongs to the global model."""
        self.book.commit(close, self.cfg.sync_time_s, t)
        self.commits_s.append(t)
        self.round_sizes[len(close.contributions)] += 1
        self._last_commit = t
        merged = self.merged_until
        for c in close.contributions:
            i, inc, until = c.payload
            merged[(i, inc)] = max(merged[(i, inc)], until)
        self._poll(t)

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
