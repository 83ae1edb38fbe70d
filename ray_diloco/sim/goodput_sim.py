"""Layer: sim (pure, no Ray, no JAX). Discrete-event goodput simulator at scale
(docs/algorithm.md sections 9 and 10).

Systems react to the same failure trace (`goodput_trace.make_trace`); each is a job, or a set
of jobs, of `goodput_jobs` (one cost per failure that hits a running job; failures during a
stall are repaired in parallel):

- `data_parallel`: one SPMD job over every slice. It stops at a failure, waits for the slice,
  pays `restart_cost_s` and loses the work done since its last checkpoint (taken every
  `checkpoint_interval_s` of running time; 0 means every step, in memory, so the loss is
  folded into `restart_cost_s`).
- `elastic_dp`: slice-granular. A failure pauses the whole job `reconfig_pause_s` to re-mesh
  onto the healthy slices; it goes on with fewer chips until the slice rejoins at a re-mesh.
- `decoupled`: M learners of about N/M chips (contiguous groups of slices), each its own
  elastic job (`learner_mode`: wait for the hot spare, shrink, or die and restart). Learners
  offer their work once per `round_period_s` of running time (lognormal jitter, std/mean
  `straggler_cv`) to a real `rounds.RoundBook` with one fragment: register (a restart is a new
  incarnation), heartbeat, offer, poll, commit. A learner's chip-seconds count as productive
  only up to its last offer that a committed round merged; a restarting learner loses the rest
  of an incarnation's work when it dies. A contribution still pending when its learner dies is
  kept by the book and merged later, so it counts. Work still unmerged when the run ends (at
  most a round period per learner) is not counted.
- `elastic_dp_per_learner`: the comparison of section 10, elastic data-parallel on N/M chips,
  run as M independent elastic jobs, one on each learner's slices, goodput averaged.

Goodput = productive chip-seconds / (N chips * duration). Uptime = the fraction of windows of
`uptime_window_s` in which the global model advanced: kept training time for the data-parallel
systems (work later lost to a restart does not count); for `decoupled`, at least `quorum_min`
learners running (with one fragment due per step, P = H, a running learner offers a fragment
every step and K of them close a round).

Cost: trace and the data-parallel systems take milliseconds (vectorised, plus one loop over
failures in `stalls`); the decoupled system's offers are computed in bulk, and what remains is
the RoundBook itself, ~10 us of CPU per offer (heartbeat, offer, poll, close, commit), so the
run time is set by the number of offers, M * duration / round_period_s.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ray_diloco.algorithm.round_types import ContributionMeta, RoundClose, RoundPolicy
from ray_diloco.algorithm.rounds import RoundBook
from ray_diloco.config import DilocoConfig, GoodputSimConfig, SynchronizerConfig
from ray_diloco.sim.goodput_jobs import Activity, Slices, cluster, groups, shrinking, waiting
from ray_diloco.sim.goodput_trace import FailureTrace, make_trace, quorum_uptime, window_uptime

logger = logging.getLogger(__name__)

# The settings before calibration (issue 5): repairs and restarts ten times slower than the
# published anchors imply, and learners that die at every failure. Kept because the shape of
# the result under slow repair is a finding of its own.
PRESETS: dict[str, dict[str, Any]] = {
    "calibrated": {},
    "slow-repair": {
        "recovery_median_s": 60.0,
        "recovery_sigma": 1.0,
        "restart_cost_s": 600.0,
        "checkpoint_interval_s": 600.0,
        "reconfig_pause_s": 120.0,
        "learner_mode": "restart",
        "learner_restart_s": 120.0,
        "round_period_s": 120.0,
    },
}


@dataclass(frozen=True)
class SystemResult:
    """One system's outcome on one trace."""

    system: str  # data_parallel | elastic_dp | decoupled | elastic_dp_per_learner
    chips: int  # allocated chips, the whole cluster
    learners: int  # independent jobs the chips are split into (1 for the baselines)
    goodput: float
    uptime: float
    failures: int  # slice failures in the trace
    restarts: int  # job restarts, re-meshes, or learner incarnations after the first
    rounds: int = 0  # rounds committed by the RoundBook (decoupled only)


def data_parallel(cfg: GoodputSimConfig, trace: FailureTrace) -> SystemResult:
    dur = trace.duration_s
    job = waiting(cluster(trace), cfg.restart_cost_s)
    a, b = job.starts, job.ends
    lost = np.zeros_like(a)
    failed = b < dur  # the interval ended in a failure, not at the end of the run
    if cfg.checkpoint_interval_s > 0:
        lost[failed] = np.mod(b[failed] - a[failed], cfg.checkpoint_interval_s)
    kept_end = b - lost
    return SystemResult(
        system="data_parallel",
        chips=job.total_chips,
        learners=1,
        goodput=float((kept_end - a).sum() / dur),
        uptime=window_uptime(a, kept_end, dur, cfg.uptime_window_s),
        failures=trace.num_failures,
        restarts=job.num_stalls,
    )


def _uptime(cfg: GoodputSimConfig, job: Activity) -> float:
    return window_uptime(job.starts, job.ends, job.duration_s, cfg.uptime_window_s)


def elastic_dp(cfg: GoodputSimConfig, trace: FailureTrace) -> SystemResult:
    job = shrinking(cluster(trace), cfg.reconfig_pause_s)
    return SystemResult(
        "elastic_dp",
        job.total_chips,
        1,
        job.goodput(),
        _uptime(cfg, job),
        trace.num_failures,
        job.num_stalls,
    )


def learner_bounds(trace: FailureTrace, num_learners: int) -> list[int]:
    """Bounds b of the learners' contiguous slice ranges [b[k], b[k+1]), sizes differing by
    at most one."""
    if num_learners > trace.num_slices:
        raise ValueError(
            f"{num_learners} learners need at least as many slices; the cluster has "
            f"{trace.num_slices}. Raise goodput_sim.chips or lower goodput_sim.chips_per_slice"
        )
    return [int(b) for b in np.linspace(0, trace.num_slices, num_learners + 1).round()]


def elastic_per_learner(cfg: GoodputSimConfig, trace: FailureTrace) -> SystemResult:
    """M independent elastic jobs, one on each learner's slices: elastic data-parallel on
    N/M chips, averaged over M draws of the same trace (the comparison of section 10)."""
    slices = groups(trace, learner_bounds(trace, cfg.num_learners))
    jobs = [shrinking(g, cfg.reconfig_pause_s) for g in slices]
    return SystemResult(
        "elastic_dp_per_learner",
        int(trace.slice_chips.sum()),
        cfg.num_learners,
        sum(j.work for j in jobs) / (trace.slice_chips.sum() * trace.duration_s),
        float(np.mean([_uptime(cfg, j) for j in jobs])),
        trace.num_failures,
        sum(j.num_stalls for j in jobs),
    )


def learner_activity(cfg: GoodputSimConfig, job: Slices) -> Activity:
    """One learner on its slices, reacting to failures as `cfg.learner_mode` says."""
    if cfg.learner_mode == "shrink":
        return shrinking(job, cfg.reconfig_pause_s)
    cost = cfg.reconfig_pause_s if cfg.learner_mode == "spare" else cfg.learner_restart_s
    return waiting(job, cost)


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


@dataclass(frozen=True)
class Schedule:
    """Every registration and offer of every learner, sorted by time (computed in bulk: a
    learner's offers depend only on its own activity, never on the book's decisions)."""

    time_s: np.ndarray
    is_offer: np.ndarray  # False: a registration
    learner: np.ndarray
    incarnation: np.ndarray
    work: np.ndarray  # chip-seconds of the incarnation up to the offer
    steps: np.ndarray  # inner steps of the incarnation up to the offer
    inc_start_s: np.ndarray  # when the incarnation started


def _periods(rng: np.random.Generator, cv: float, n: int) -> np.ndarray:
    """`n` round times in units of the round period: lognormal, mean 1, std/mean `cv`."""
    if cv == 0:
        return np.ones(n)
    s = math.sqrt(math.log1p(cv * cv))
    return rng.lognormal(-s * s / 2, s, n)


def _offers(
    job: Activity, restarts: bool, period_s: float, cv: float, rng: np.random.Generator
) -> tuple[np.ndarray, ...]:
    """One learner's offers: every (jittered) round period of running time, counted from the
    start of its incarnation. A restarting learner's incarnation is one running interval;
    otherwise the learner keeps its state through pauses and has one incarnation."""
    run_before = job.running_before()
    run_total = float(job.running_s.sum())
    if restarts:
        seg_start, seg_len = run_before, job.running_s
    else:
        seg_start, seg_len = np.array([0.0]), np.array([run_total])
    # Draw enough round times per incarnation (20% margin + 3), then cut at its end; a
    # segmented cumulative sum gives every incarnation's offsets at once.
    need = (seg_len / period_s * 1.2).astype(np.int64) + 3
    while True:
        gaps = _periods(rng, cv, int(need.sum())) * period_s
        seg = np.repeat(np.arange(len(seg_len)), need)
        first = np.r_[0, np.cumsum(need)[:-1]]
        total = np.cumsum(gaps)
        offset = total - np.repeat(total[first] - gaps[first], need)
        if np.all(offset[np.cumsum(need) - 1] >= seg_len):
            break
        need *= 2
    keep = offset < seg_len[seg]
    seg, offset = seg[keep], offset[keep]
    tau = seg_start[seg] + offset  # on the learner's running clock
    j = np.searchsorted(run_before, tau, side="right") - 1  # running interval of each offer
    wall = job.starts[j] + (tau - run_before[j])
    work_at = job.work_before()[j] + job.chips[j] * (tau - run_before[j])
    if restarts:
        inc, inc_work, inc_wall = seg, job.work_before()[seg], job.starts[seg]
        reg_t, reg_inc = job.starts, np.arange(len(job.starts))
    else:
        inc, inc_work = np.zeros(len(seg), dtype=np.int64), np.zeros(len(seg))
        inc_wall = np.full(len(seg), job.starts[0] if len(job.starts) else 0.0)
        reg_t, reg_inc = job.starts[:1], np.zeros(min(1, len(job.starts)), dtype=np.int64)
    return wall, inc, work_at - inc_work, offset, inc_wall, reg_t, reg_inc


def schedule(cfg: GoodputSimConfig, jobs: list[Activity], step_time_s: float) -> Schedule:
    parts: list[tuple[np.ndarray, ...]] = []
    restarts = cfg.learner_mode == "restart"
    for i, job in enumerate(jobs):
        # Jitter from its own stream per learner, so the failure trace stays identical
        # across systems and one learner's draws do not shift another's.
        rng = np.random.default_rng([cfg.seed, 1, i])
        wall, inc, work, run_s, inc_wall, reg_t, reg_inc = _offers(
            job, restarts, cfg.round_period_s, cfg.straggler_cv, rng
        )
        n, r = len(wall), len(reg_t)
        parts.append(
            (
                np.r_[reg_t, wall],
                np.r_[np.zeros(r, bool), np.ones(n, bool)],
                np.full(r + n, i),
                np.r_[reg_inc, inc],
                np.r_[np.zeros(r), work],
                np.r_[np.zeros(r), run_s / step_time_s].astype(np.int64),
                np.r_[reg_t, inc_wall],
            )
        )
    cols = [np.concatenate(c) for c in zip(*parts, strict=True)]
    # Time order; at equal times a registration comes before an offer.
    order = np.lexsort((cols[1], cols[0]))
    return Schedule(*(c[order] for c in cols))


_COMMIT, _POLL = 0, 1  # events the book's decisions add while the schedule is replayed


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
        slices = groups(trace, learner_bounds(trace, m))
        self.jobs = [learner_activity(cfg, g) for g in slices]
        self.commits_s: list[float] = []
        self.verdicts: Counter[str] = Counter()
        self.round_sizes: Counter[int] = Counter()  # contributions merged per round
        self.merged: dict[tuple[int, int], float] = {}  # (learner, incarnation) -> work
        self.names = [f"learner-{i}" for i in range(m)]
        self._last_commit = 0.0
        self._heap: list[tuple[float, int, int, Any]] = []  # time, seq, kind, close
        self._seq = itertools.count()  # ties at equal times go in push order
        self._polls: set[float] = set()  # deadlines already scheduled

    def run(self) -> SystemResult:
        """Replay the learners' schedule; the book closes rounds, commits come back as events."""
        sched = schedule(self.cfg, self.jobs, self.step_time_s)
        book, names, step_s = self.book, self.names, self.step_time_s
        heap, verdicts, merged = self._heap, self.verdicts, self.merged
        dur = self.trace.duration_s
        for t, is_offer, i, inc, work, steps, inc_start in zip(
            sched.time_s.tolist(),
            sched.is_offer.tolist(),
            sched.learner.tolist(),
            sched.incarnation.tolist(),
            sched.work.tolist(),
            sched.steps.tolist(),
            sched.inc_start_s.tolist(),
            strict=True,
        ):
            while heap and heap[0][0] <= t:
                self._pop()
            name = names[i]
            if not is_offer:
                book.register(name, inc, t)
                book.heartbeat(name, inc, t, step_s)
                merged.setdefault((i, inc), 0.0)
                continue
            # The progress report that comes with an offer doubles as the heartbeat (see
            # round_policy). The learner's counters restart whenever it adopts a version: at
            # its start or at the last commit (every live learner gets each published one).
            book.heartbeat(name, inc, t, step_s)
            # Its counters never hold more steps than it took (the guards refuse that), at
            # least one; wall time since the commit includes pauses, when no step was taken.
            steps = max(1, steps)
            new = min(steps, max(1, int((t - max(inc_start, self._last_commit)) / step_s)))
            version = book.fragments[0].version
            meta = ContributionMeta(name, inc, 0, version, steps, new, new)
            # The payload says whose work, up to how much: it comes back in the RoundClose.
            verdicts[book.offer(meta, t, payload=(i, inc, work))] += 1
            self._poll(t)
        while heap and heap[0][0] < dur:
            self._pop()
        return self._result()

    def _push(self, t: float, kind: int, close: Any) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, close))

    def _pop(self) -> None:
        t, _, kind, close = heapq.heappop(self._heap)
        if kind == _POLL:
            self._polls.discard(t)
        else:
            self._on_commit(t, close)
        self._poll(t)

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
            self._push(now + self.cfg.sync_time_s, _COMMIT, close)
        if closes:
            deadline = book.next_deadline()
        if deadline is not None and deadline > now and deadline not in self._polls:
            self._polls.add(deadline)
            self._push(deadline, _POLL, None)

    def _on_commit(self, t: float, close: RoundClose) -> None:
        """The merge is done and published: the merged work now belongs to the global model."""
        self.book.commit(close, self.cfg.sync_time_s, t)
        self.commits_s.append(t)
        self.round_sizes[len(close.contributions)] += 1
        self._last_commit = t
        merged = self.merged
        for c in close.contributions:
            i, inc, work = c.payload
            merged[(i, inc)] = max(merged[(i, inc)], work)

    def _result(self) -> SystemResult:
        cfg, dur = self.cfg, self.trace.duration_s
        chips = int(self.trace.slice_chips.sum())
        if cfg.learner_mode == "restart":
            restarts = sum(max(0, len(j.starts) - 1) for j in self.jobs)
        else:
            restarts = sum(j.num_stalls for j in self.jobs)
        logger.debug("decoupled M=%d verdicts %s", cfg.num_learners, dict(self.verdicts))
        return SystemResult(
            system="decoupled",
            chips=chips,
            learners=cfg.num_learners,
            goodput=sum(self.merged.values()) / (chips * dur),
            uptime=quorum_uptime(
                [(j.starts, j.ends) for j in self.jobs],
                self.book.policy.quorum_min,
                dur,
                cfg.uptime_window_s,
            ),
            failures=self.trace.num_failures,
            restarts=restarts,
            rounds=len(self.commits_s),
        )


def decoupled(
    cfg: GoodputSimConfig,
    trace: FailureTrace,
    diloco: DilocoConfig | None = None,
    sync: SynchronizerConfig | None = None,
) -> SystemResult:
    return DecoupledSim(cfg, trace, diloco, sync).run()


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
        decoupled(cfg, trace, diloco, sync),
        elastic_per_learner(cfg, trace),
    ]
