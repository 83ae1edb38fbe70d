"""Layer: sim (pure, no Ray, no JAX). The synchronizer in the goodput simulation: one fragment's
rounds at the run's real cadence, decided by the real `rounds.RoundBook` (docs/algorithm.md
sections 4, 5 and 7; docs/goodput.md).

Fragments are symmetric (P = H fragments, each due once every H steps, staggered by one step),
so one fragment stands for all: its merged share of the learners' work is the goodput's. The
learners' activity (when each runs and on how many chips) comes from `goodput_jobs`; here is
what of that work reaches the global model:

- Cadence: a fragment's round every `window_s` = H * step time, or longer when the learner's
  link cannot carry P fragments each way in that time (a bandwidth-limited synchronizer).
- Contributions: `pull` asks every running learner for the fragment on the synchronizer's own
  clock (one grid for all), and rounds follow that schedule: a learner pausing at a pull
  answers when it resumes, and that late answer joins its round if it is still open, else the
  round of the next pull (it opens none of its own); `offer` has each learner offer it every
  H of its own steps, on its own running clock, so pauses and step-time spread put learners
  out of phase, and an offer opens a round.
- A contribution carries the learner's counters since it last adopted the fragment: what it
  trained on top of that version. It arrives one upload later; the book fences it
  (incarnation, staleness) and pends it; rounds close at quorum and grace; a commit comes
  `merge_s` after the close and reaches each learner one download later.
- Adopting a version replaces the learner's fragment and restarts its counters
  (docs/algorithm.md section 4): the steps it took between its contribution and the adoption never
  reach the global model (`diloco.keep_unsent_work` carries them to the next offer instead;
  `mixing_alpha` keeps a share of the values, not of the counters, so it changes nothing here).
  `diloco.publish_to` says who adopts: every learner, or the round's contributors;
  `diloco.apply_at: overlap` applies a version no earlier than tau steps after the learner's
  own last offer.
- A restarting learner's counters die with it (work since its last contribution, and a
  contribution still on the wire); what the book holds is kept and merged.
- The fragment's shard fails (Poisson, `shard_mtbf_days`) and is out `detect_s +
  shard_restart_s`: the book holds the fragment (no round closes, offers are refused) and
  learners keep their counters, so their next contribution carries the outage's work.

Goodput = merged chip-seconds / (N chips * duration); uptime = the share of windows of
`uptime_window_s` holding a commit (0 with no commit).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ray_diloco.algorithm.downstream import full_dtype
from ray_diloco.algorithm.links import link_seconds
from ray_diloco.algorithm.round_types import ContributionMeta, RoundClose, RoundPolicy, Verdict
from ray_diloco.algorithm.rounds import RoundBook
from ray_diloco.algorithm.wire import wire_bytes
from ray_diloco.config import (
    DilocoConfig,
    GoodputSimConfig,
    LinkConfig,
    SynchronizerConfig,
    WireDtype,
)
from ray_diloco.sim.goodput_jobs import Activity
from ray_diloco.sim.goodput_trace import SECONDS_PER_DAY, num_windows

# Events the book's decisions, the shard and late answers add; kinds above _LATE register
# learner kind - _LATE - 1.
_COMMIT, _POLL, _SHARD, _LATE = 0, 1, 2, 3


@dataclass(frozen=True)
class Cadence:
    """A fragment's timing on the learners' links (seconds)."""

    window_s: float  # between two rounds of the fragment, per learner
    up_s: float  # one contribution, learner to synchronizer
    down_s: float  # one published version, synchronizer to learner
    fetch_s: float  # a restarted learner fetching every fragment
    link_bound: bool  # the link, not H steps, sets the window


def cadence(cfg: GoodputSimConfig, diloco: DilocoConfig) -> Cadence:
    p = diloco.num_fragments
    n = math.ceil(cfg.model_params / p)
    link = LinkConfig(bandwidth_gbps=cfg.link_gbps, latency_ms=cfg.link_latency_ms)
    block = diloco.int4_block_size
    up_bytes = wire_bytes(n, diloco.wire_dtype, block)
    # A publication goes down as a quantized difference, or as the full value.
    down: WireDtype = full_dtype(diloco) if diloco.publish_delta == "none" else diloco.publish_delta
    down_bytes = wire_bytes(n, down, block)
    full = wire_bytes(round(cfg.model_params), full_dtype(diloco), block)
    # The link carries the P fragments one after another, each way: a window can be no
    # shorter than P transfers (latency overlaps, bytes do not).
    serial = p * max(up_bytes, down_bytes) * 8 / (cfg.link_gbps * 1e9)
    steps = diloco.sync_every * cfg.step_time_s
    return Cadence(
        window_s=max(steps, serial),
        up_s=link_seconds(link, up_bytes),
        down_s=link_seconds(link, down_bytes),
        fetch_s=link_seconds(link, full),
        link_bound=serial > steps,
    )


def round_policy(
    cfg: GoodputSimConfig, num_learners: int, diloco: DilocoConfig, sync: SynchronizerConfig
) -> RoundPolicy:
    """The synchronizer's policy from the run's config, K from `cfg`. A learner reports with
    each contribution here, so the heartbeat timeout is widened by one window: a running
    learner never looks dead between two reports, a dead one drops out one window after."""
    base = RoundPolicy.from_config(diloco, sync, num_learners)
    window = cadence(cfg, diloco).window_s * (1 + 4 * cfg.straggler_cv)
    return replace(
        base,
        quorum_min=min(cfg.quorum_min, num_learners),
        heartbeat_timeout_s=window + sync.heartbeat_timeout_s,
    )


@dataclass(frozen=True)
class Contributions:
    """Every contribution of every learner, sorted by arrival at the synchronizer."""

    arrive_s: np.ndarray
    made_s: np.ndarray  # when the learner took it (a step boundary)
    learner: np.ndarray
    interval: np.ndarray  # the learner's running interval it was taken in
    # `pull`, an answer taken after its pull (the learner was pausing): when the next pull
    # comes, and whether the learner answers that one on time; inf (and False) for an answer
    # taken on time and for every offer.
    next_pull_s: np.ndarray
    answers_next: np.ndarray


def _grid_times(
    job: Activity, window_s: float, phase_s: float, restarts: bool
) -> tuple[np.ndarray, ...]:
    """The synchronizer's pulls k W + phase, answered at the learner's next step boundary: at
    once when it runs, when it resumes if it is pausing (late for its round), never by a
    learner that died (its next incarnation answers the next pull). Returns when each answer
    was taken, in which running interval, and for a late one when the next pull comes (inf
    for an answer on time) and whether the learner is running then."""
    t = np.arange(phase_s, job.duration_s, window_s)
    j = np.searchsorted(job.starts, t, side="right") - 1
    running = (j >= 0) & (t < job.ends[np.maximum(j, 0)])
    if restarts:
        n = int(running.sum())
        return t[running], j[running], np.full(n, np.inf), np.zeros(n, bool)
    nxt = j + 1  # the interval it resumes in
    ok = ~running & (nxt < len(job.starts))
    resume = np.where(ok, job.starts[np.minimum(nxt, len(job.starts) - 1)], np.inf)
    # A learner that resumes after the next pull answers that one only.
    late = ok & (resume < t + window_s)
    made = np.where(running, t, resume)
    which = np.where(running, j, nxt)
    following = np.where(running, np.inf, t + window_s)
    on_time_next = np.r_[running[1:], False] & ~running
    keep = running | late
    return made[keep], which[keep], following[keep], on_time_next[keep]


def _own_times(job: Activity, window_s: float, phase_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Every `window_s` of the learner's running time, mapped to wall time."""
    run_before = job.running_before()
    total = float(job.running_s.sum())
    tau = np.arange(phase_s, total, window_s)
    j = np.searchsorted(run_before, tau, side="right") - 1
    return job.starts[j] + (tau - run_before[j]), j


def contributions(
    cfg: GoodputSimConfig, jobs: list[Activity], cad: Cadence, up_s: float
) -> Contributions:
    parts = []
    for i, job in enumerate(jobs):
        if len(job.starts) == 0:
            continue
        if cfg.sync_schedule == "pull":
            restarts = cfg.learner_mode == "restart"
            made, j, following, on_time = _grid_times(job, cad.window_s, cad.window_s, restarts)
        else:
            # Each learner's step time is its own (fixed spread), so its window is too.
            rng = np.random.default_rng([cfg.seed, 1, i])
            s = math.sqrt(math.log1p(cfg.straggler_cv**2))
            factor = float(rng.lognormal(-s * s / 2, s)) if cfg.straggler_cv else 1.0
            made, j = _own_times(job, cad.window_s * factor, cad.window_s * factor)
            following, on_time = np.full(len(made), np.inf), np.zeros(len(made), bool)
        parts.append((made + up_s, made, np.full(len(made), i), j, following, on_time))
    if not parts:
        empty = np.zeros(0)
        ints = empty.astype(np.int64)
        return Contributions(empty, empty, ints, ints, empty, empty.astype(bool))
    cols = [np.concatenate(c) for c in zip(*parts, strict=True)]
    cols = [c[cols[0] < jobs[0].duration_s] for c in cols]  # what arrives within the run
    order = np.argsort(cols[0], kind="stable")
    return Contributions(*(c[order] for c in cols))


class _Clock:
    """A learner's running seconds and chip-seconds up to any wall time."""

    def __init__(self, job: Activity) -> None:
        self.starts = job.starts.tolist()
        self.ends = job.ends.tolist()
        self.chips = job.chips.tolist()
        self.run0 = job.running_before().tolist()
        self.work0 = job.work_before().tolist()

    def at(self, t: float) -> tuple[float, float]:
        j = bisect.bisect_right(self.starts, t) - 1
        if j < 0:
            return 0.0, 0.0
        dt = min(t, self.ends[j]) - self.starts[j]
        return self.run0[j] + dt, self.work0[j] + self.chips[j] * dt


@dataclass(frozen=True)
class SyncOutcome:
    merged_chip_s: float  # work that reached the global model
    rounds: int
    commits_s: tuple[float, ...]
    window_s: float
    # What the book and the replay saw, for the rows: verdicts per kind, rounds per number of
    # contributions merged, contributions whose learner died before they arrived, the
    # shard's outages, and whether the link set the window.
    diagnostics: dict[str, Any]


class FragmentSim:
    """M learners' contributions to one fragment, through one real RoundBook, on the virtual
    clock."""

    def __init__(
        self,
        cfg: GoodputSimConfig,
        jobs: list[Activity],
        diloco: DilocoConfig,
        sync: SynchronizerConfig,
    ) -> None:
        self.cfg, self.jobs, self.diloco = cfg, jobs, diloco
        self.cad = cadence(cfg, diloco)
        m = len(jobs)
        self.book = RoundBook(round_policy(cfg, m, diloco, sync), 1, sync_time_s=cfg.merge_s)
        self.names = [f"learner-{i}" for i in range(m)]
        self.clocks = [_Clock(j) for j in jobs]
        self.restarts = cfg.learner_mode == "restart"
        # Versions each learner adopts: every published one (`publish_to: all`, one list for
        # all, looked up when the learner next contributes), and its own (registrations,
        # refusals, `publish_to: contributors`): when each reached it, which version.
        self.published_t: list[float] = []
        self.published_v: list[int] = []
        self.own_t: list[list[float]] = [[0.0] for _ in range(m)]
        self.own_v: list[list[int]] = [[0] for _ in range(m)]
        self.last_offer: list[tuple[float, float] | None] = [None] * m  # (running, work)
        self.last_made: list[float | None] = [None] * m  # wall time of the last one taken
        self.commits_s: list[float] = []
        self.verdicts: Counter[str] = Counter()
        self.round_sizes: Counter[int] = Counter()
        self.merged = 0.0
        self.lost_in_flight = 0
        self.outages = 0
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self._polls: set[float] = set()
        # learner -> a late answer held for the round of the next pull, delivered just before
        # the learner's answer to that pull
        self.held_late: dict[int, tuple[ContributionMeta, int, float]] = {}

    # -- events ---------------------------------------------------------------------------

    def _push(self, t: float, kind: int, data: Any) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, data))

    def _pop(self) -> None:
        t, _, kind, data = heapq.heappop(self._heap)
        if kind > _LATE:
            self._register(t, kind - _LATE - 1, data)
            return
        if kind == _LATE:
            self._deliver(t, *data)
            return
        if kind == _POLL:
            self._polls.discard(t)
        elif kind == _COMMIT:
            self._on_commit(t, data)
        elif data:  # the shard is back
            self.book.held.discard(0)
        else:
            self.book.held.add(0)
        self._poll(t)

    def _poll(self, now: float) -> None:
        book = self.book
        deadline = book.next_deadline()
        if deadline is None:
            return
        closes = book.poll(now)
        for close in closes:
            self._push(now + self.cfg.merge_s, _COMMIT, close)
        if closes:
            deadline = book.next_deadline()
        if deadline is not None and deadline > now and deadline not in self._polls:
            self._polls.add(deadline)
            self._push(deadline, _POLL, None)

    def _adopt(self, i: int, t: float, version: int) -> None:
        if version > self.own_v[i][-1]:
            self.own_t[i].append(max(t, self.own_t[i][-1]))
            self.own_v[i].append(version)

    def _adopted(self, i: int, bound: float) -> tuple[float, int]:
        """The newest version learner i applied before wall time `bound`, and when."""
        k = bisect.bisect_left(self.own_t[i], bound) - 1
        t, v = self.own_t[i][k], self.own_v[i][k]
        g = bisect.bisect_left(self.published_t, bound) - 1
        if g >= 0 and self.published_v[g] > v:
            t, v = self.published_t[g], self.published_v[g]
        return t, v

    def _on_commit(self, t: float, close: RoundClose) -> None:
        self.book.commit(close, self.cfg.merge_s, t)
        self.commits_s.append(t)
        self.round_sizes[len(close.contributions)] += 1
        arrive = t + self.cad.down_s
        for c in close.contributions:
            self.merged += c.num_tokens  # chip-seconds: see `_offer`
        if self.diloco.publish_to == "all":
            self.published_t.append(arrive)
            self.published_v.append(close.version)
        else:
            for c in close.contributions:
                self._adopt(int(c.payload), arrive, close.version)

    def _shard_outages(self) -> None:
        """The fragment's shard: Poisson failures, each an outage of detect + restart."""
        cfg = self.cfg
        dur = self.jobs[0].duration_s
        rng = np.random.default_rng([cfg.seed, 2])
        mtbf = cfg.shard_mtbf_days * SECONDS_PER_DAY
        out = cfg.detect_s + cfg.shard_restart_s
        t = float(rng.exponential(mtbf))
        while t < dur:
            self._push(t, _SHARD, False)
            self._push(t + out, _SHARD, True)
            self.outages += 1
            t += out + float(rng.exponential(mtbf))

    # -- the replay -----------------------------------------------------------------------

    def run(self) -> SyncOutcome:
        cfg, book = self.cfg, self.book
        step = cfg.step_time_s
        contrib = contributions(cfg, self.jobs, self.cad, self.cad.up_s)
        # Registrations: every incarnation's start (restart mode), else each learner once.
        regs = []
        for i, job in enumerate(self.jobs):
            starts = job.starts.tolist() if self.restarts else job.starts.tolist()[:1]
            regs += [(t, i, k) for k, t in enumerate(starts)]
        regs.sort()
        for t, i, k in regs:
            self._push(t, _LATE + 1 + i, k)
        self._shard_outages()
        ends = [c.ends for c in self.clocks]
        heap = self._heap
        for t_a, t_c, i, j, t_next, on_time in zip(
            contrib.arrive_s.tolist(),
            contrib.made_s.tolist(),
            contrib.learner.tolist(),
            contrib.interval.tolist(),
            contrib.next_pull_s.tolist(),
            contrib.answers_next.tolist(),
            strict=True,
        ):
            while heap and heap[0][0] <= t_a:
                self._pop()
            if self.restarts and t_a > ends[i][j]:
                self.lost_in_flight += 1  # the learner died with it on the wire
                continue
            held = self.held_late.pop(i, None)
            if held is not None:
                # With the learner's next answer, and before it is taken: it was sent first.
                self._deliver(t_a, *held, poll=False)
            meta = self._meta(i, j, t_c)
            if meta is None:
                if held is not None:
                    self._poll(t_a)
                continue
            frag = book.fragments[0]
            if t_next < math.inf and (frag.merging or not (frag.pending or frag.kept)):
                # A late answer whose round has closed: the synchronizer holds it for the
                # next round of its own schedule (late_policy next_round), which the next
                # pull opens; it opens no round of its own. It joins that round with the
                # learner's answer to the pull, or alone if the learner pauses again.
                book.heartbeat(meta.learner, meta.incarnation, t_a, step)
                if on_time:
                    self.held_late[i] = (meta, i, t_c)
                else:
                    self._push(t_next + self.cad.up_s, _LATE, (meta, i, t_c))
                continue
            self._deliver(t_a, meta, i, t_c)
        dur = self.jobs[0].duration_s
        while heap and heap[0][0] < dur:
            self._pop()
        return SyncOutcome(
            merged_chip_s=self.merged,
            rounds=len(self.commits_s),
            commits_s=tuple(self.commits_s),
            window_s=self.cad.window_s,
            diagnostics={
                "verdicts": {str(k): v for k, v in sorted(self.verdicts.items())},
                "round_sizes": {str(k): v for k, v in sorted(self.round_sizes.items())},
                "lost_in_flight": self.lost_in_flight,
                "shard_outages": self.outages,
                "link_bound": self.cad.link_bound,
            },
        )

    def _meta(self, i: int, j: int, t_c: float) -> ContributionMeta | None:
        """Learner i's contribution taken at `t_c` in its running interval j: its counters
        since it last adopted the fragment (None when they hold no whole step)."""
        step = self.cfg.step_time_s
        starts = self.clocks[i].starts
        # What the learner had applied before it took the contribution. A version that
        # arrived while it paused is applied at its next step boundary, after the
        # contribution it owes there (the order of docs/algorithm.md section 4).
        bound = t_c if t_c > starts[j] or j == 0 else self.clocks[i].ends[j - 1]
        since, base = self._adopted(i, bound)
        made = self.last_made[i]
        if self.diloco.apply_at == "overlap" and made is not None and since > made:
            # Applied no earlier than tau steps after the learner's own last offer.
            since = min(max(since, made + self.diloco.overlap_steps * step), t_c)
        run_c, work_c = self.clocks[i].at(t_c)
        run_s, work_s = self.clocks[i].at(max(since, starts[j]) if self.restarts else since)
        last = self.last_offer[i]
        if self.diloco.keep_unsent_work and last is not None and run_s > last[0]:
            run_s, work_s = last  # the unsent steps were carried onto the new version
        steps = int((run_c - run_s) / step)
        if steps < 1:
            return None
        inc = j if self.restarts else 0
        return ContributionMeta(
            self.names[i], inc, 0, base, int(run_c / step), steps, max(1, round(work_c - work_s))
        )

    def _deliver(
        self, t_a: float, meta: ContributionMeta, i: int, t_c: float, poll: bool = True
    ) -> None:
        """The book fences and pends learner i's contribution arriving at `t_a` (and closes
        the rounds now due, unless another contribution arrives with it: `poll` False)."""
        book = self.book
        book.heartbeat(meta.learner, meta.incarnation, t_a, self.cfg.step_time_s)
        verdict = book.offer(meta, t_a, payload=i)
        self.verdicts[verdict] += 1
        if verdict is Verdict.ACCEPTED:
            self.last_offer[i] = self.clocks[i].at(t_c)
            self.last_made[i] = t_c
        elif verdict is Verdict.STALE_VERSION:
            # A refused learner takes the newest version at once (section 7).
            self._adopt(i, t_a + self.cad.down_s, book.fragments[0].version)
        if poll:
            self._poll(t_a)

    def _register(self, t: float, i: int, incarnation: int) -> None:
        versions = self.book.register(self.names[i], incarnation, t)
        self.book.heartbeat(self.names[i], incarnation, t, self.cfg.step_time_s)
        self._adopt(i, t, versions[0])  # a new incarnation starts from the newest version
        self.last_offer[i] = None
        self.last_made[i] = None
        self._poll(t)


def commit_uptime(commits_s: tuple[float, ...], duration_s: float, window_s: float) -> float:
    """The share of windows [k W, (k+1) W) holding at least one commit (0 with none)."""
    if not commits_s:
        return 0.0
    hit = np.unique(np.floor(np.asarray(commits_s) / window_s).astype(np.int64))
    n = num_windows(duration_s, window_s)
    return float(np.count_nonzero(hit < n)) / n
