"""Layer: algorithm (pure, no Ray). The reference run: M learners and the synchronizer in one
process on a virtual clock (algorithm.md sections 4 to 8).

Every learner step takes `step_time_s / speed` virtual seconds (times `1 + jitter * N(0, 1)`),
transfers take what the region's emulated link would take, and merges take `sync_time_s`. The
learners and the synchronizer are the same `LearnerCore` and `SynchronizerCore` the Ray actors
wrap, so this run is the oracle for the Ray runs. Deterministic for a seed.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ray_diloco.algorithm import inner, links
from ray_diloco.algorithm.downstream import Message
from ray_diloco.algorithm.fragments import FragmentPlan, plan_fragments
from ray_diloco.algorithm.learner_core import LearnerCore
from ray_diloco.algorithm.sync_core import SynchronizerCore
from ray_diloco.algorithm.wire import decode_tree
from ray_diloco.config import LearnerGroupConfig, RunConfig
from ray_diloco.control.goodput import uptime
from ray_diloco.sim import sim_faults
from ray_diloco.tasks import byte_corpus as data
from ray_diloco.tasks import transformer as model

Progress = Callable[[dict[str, Any]], None]
NUM_EVALS = 10  # held-out evaluations of the global parameters over a run
UPTIME_WINDOW_STEPS = 20  # the global model is "up" in a window of this many inner steps
# when it advanced at least once in it (algorithm.md section 9)


@dataclass
class Setup:
    """What every run of a config shares: data, initial parameters, fragments, evaluation."""

    cfg: RunConfig
    corpus: data.Corpus
    init: dict[str, Any]
    plan: FragmentPlan
    eval_fn: Callable[..., Any]
    heldout: list[tuple[np.ndarray, np.ndarray]]

    @classmethod
    def build(cls, cfg: RunConfig) -> Setup:
        corpus = data.load_corpus(cfg.data, cfg.seed)
        init = model.init_params(cfg.model, cfg.seed)
        plan = fragment_plan(cfg)
        heldout = data.heldout_batches(corpus, cfg.data, cfg.model.seq_len)
        return cls(cfg, corpus, init, plan, inner.make_eval_fn(cfg.model), heldout)

    def evaluate(self, params: dict[str, Any]) -> float:
        return inner.evaluate(self.eval_fn, params, self.heldout)

    def param_bytes(self) -> int:
        return 4 * model.num_params(self.init)


def fragment_plan(cfg: RunConfig) -> FragmentPlan:
    """The run's fragments (algorithm.md section 3), from the model's leaf shapes alone."""
    shapes = model.param_shapes(cfg.model)
    embedding = [k for k in shapes if model.is_embedding(k)]
    sizes = {k: math.prod(shape) for k, shape in shapes.items()}
    return plan_fragments(sizes, cfg.diloco.num_fragments, embedding)


def link_seconds(cfg: RunConfig, region: str, nbytes: int) -> float:
    """Time one transfer takes on the region's idle link (0 for regions without a link)."""
    return links.link_seconds(cfg.links.get(region), nbytes)


class StepClock:
    """Seeded per-learner step durations: `step_time_s / speed`, with relative jitter."""

    def __init__(self, cfg: RunConfig, lg: LearnerGroupConfig, index: int) -> None:
        self.base = cfg.step_time_s / lg.speed
        self.jitter = lg.jitter
        self.rng = np.random.default_rng([cfg.seed, index])

    def next(self) -> float:
        noise = self.rng.standard_normal() * self.jitter if self.jitter else 0.0
        return self.base * max(0.1, 1.0 + noise)


@dataclass
class _Sim:
    """The virtual-clock event loop shared by the DiLoCo modes."""

    setup: Setup
    progress: Progress | None
    queue: list[tuple[float, int, str, Any]] = field(default_factory=list)
    seq: itertools.count = field(default_factory=itertools.count)
    evals: list[dict[str, float]] = field(default_factory=list)

    def push(self, t: float, kind: str, payload: Any) -> None:
        heapq.heappush(self.queue, (t, next(self.seq), kind, payload))

    def eval_point(self, t: float, tokens: int, params: dict[str, Any], **extra: Any) -> None:
        point = {"t": t, "tokens": tokens, "heldout_loss": self.setup.evaluate(params), **extra}
        self.evals.append(point)
        if self.progress:
            self.progress(point)


def run_reference(
    cfg: RunConfig, progress: Progress | None = None, setup: Setup | None = None
) -> dict[str, Any]:
    """Run `cfg` in process and return its summary (see `summarize`)."""
    setup = setup or Setup.build(cfg)
    if cfg.diloco.mode == "data_parallel":
        return _run_data_parallel(setup, progress)
    return _run_diloco(setup, progress)


def _run_diloco(setup: Setup, progress: Progress | None) -> dict[str, Any]:
    cfg = setup.cfg
    sim = _Sim(setup, progress)
    sync = SynchronizerCore(cfg, setup.plan, setup.init)
    snapshot = sync.snapshot()
    learners = [
        LearnerCore(
            cfg,
            lg,
            setup.plan,
            snapshot,
            setup.corpus.train,
            shard_index=i,
            num_shards=cfg.num_learners,
        )
        for i, lg in enumerate(cfg.learners)
    ]
    clocks = [StepClock(cfg, lg, i) for i, lg in enumerate(cfg.learners)]
    blocked = [False] * len(learners)
    busy = [0.0] * len(learners)  # seconds of completed inner steps: the productive time
    done_s = [0.0] * len(learners)  # when each learner last completed a step
    polls: set[float] = set()
    wan = links.LinkEmulator(cfg.links)
    alive = [True] * len(learners)
    epoch = [0] * len(learners)  # bumped on failure: the dead process's pending step is void
    lost_s = [0.0] * len(learners)
    round_times: list[float] = []
    struck: list[float] = []  # when a failure hit a live learner (plots mark them)
    for i, lg in enumerate(cfg.learners):
        sync.register(lg.name, 0, 0.0)
        dt = clocks[i].next()
        sim.push(dt, "step", (i, dt, 0))
    for t, i in sim_faults.failure_times(cfg, sim_faults.horizon(cfg)):
        sim.push(t, "fail", i)
    next_eval, eval_every = 0, max(1, cfg.token_budget // NUM_EVALS)
    now = 0.0

    index = {lg.name: i for i, lg in enumerate(cfg.learners)}

    def send(j: int, msg: Message, t: float) -> None:
        lg = cfg.learners[j]
        sync.sent(lg.name, msg.nbytes)
        arrive = wan.arrival(lg.region, "down", msg.nbytes, t)
        sim.push(arrive, "publish", (j, msg))

    def close_rounds(t: float) -> None:
        for pub in sync.poll(t, sync_time_s=cfg.sync_time_s):
            round_times.append(t)
            for name, msg in sync.messages(pub, sync.recipients(pub, index)).items():
                send(index[name], msg, t + pub.sync_time_s)
        deadline = sync.book.next_deadline()
        if deadline is not None and deadline > t and deadline not in polls:
            polls.add(deadline)
            sim.push(deadline, "poll", None)

    def step_boundary(i: int, t: float) -> None:
        core = learners[i]
        core.apply_received()
        if core.blocked_on():
            blocked[i] = True
            return
        blocked[i] = False
        dt = clocks[i].next()
        sim.push(t + dt, "step", (i, dt, epoch[i]))

    while sim.queue and sync.ledger.tokens_trained < cfg.token_budget:
        now, _, kind, payload = heapq.heappop(sim.queue)
        if kind == "step":
            i, dt, ep = payload
            if ep != epoch[i]:
                continue  # the process that was taking this step died
            busy[i] += dt
            done_s[i] = now
            core, lg = learners[i], cfg.learners[i]
            core.train_step(*core.next_batch())
            sync.report(lg.name, core.incarnation, now, dt, core.cursor)
            for meta, delta in core.offers():
                nbytes = sum(e.nbytes for e in delta.values())
                sim.push(wan.arrival(lg.region, "up", nbytes, now), "arrive", (meta, delta))
            step_boundary(i, now)
        elif kind == "arrive":
            meta, delta = payload
            newest = sync.catch_up(meta, sync.offer(meta, delta, now))
            if newest is not None:
                send(index[meta.learner], newest, now)
            close_rounds(now)
        elif kind == "poll":
            polls.discard(now)
            close_rounds(now)
        elif kind == "publish":
            j, msg = payload
            if not alive[j]:
                continue  # a learner that is down gets the latest version when it comes back
            learners[j].receive(msg.fragment, msg.version, decode_tree(msg.encoded), msg.base)
            if blocked[j]:
                step_boundary(j, now)
        elif kind == "fail" and alive[payload]:
            i = payload
            struck.append(now)
            alive[i], blocked[i] = False, False
            epoch[i] += 1
            lost_s[i] += sim_faults.lost_steps(learners[i]) * clocks[i].base
            sim.push(now + cfg.chaos.restart_s, "restart", i)
        elif kind == "restart":
            i, lg = payload, cfg.learners[payload]
            incarnation = learners[i].incarnation + 1
            learners[i] = LearnerCore(
                cfg,
                lg,
                setup.plan,
                sync.snapshot(),
                setup.corpus.train,
                incarnation=incarnation,
                cursor=sync.ledger.resume_cursor(lg.name),
                shard_index=i,
                num_shards=cfg.num_learners,
            )
            sync.register(lg.name, incarnation, now)
            alive[i] = True
            step_boundary(i, now)
        tokens = sync.ledger.tokens_trained
        if tokens >= next_eval:
            sim.eval_point(now, tokens, sync.global_params(), rounds=_rounds(sync))
            next_eval += eval_every
    sim.eval_point(now, sync.ledger.tokens_trained, sync.global_params(), rounds=_rounds(sync))
    summary = summarize_diloco(setup, sync, learners, sim.evals, now)
    lost = _lost_fraction(sync)
    # A learner that is down at the end was allocated until the end.
    until = [d if up else now for d, up in zip(done_s, alive, strict=True)]
    productive = [b - x for b, x in zip(busy, lost_s, strict=True)]
    return summary | {
        "work_lost_fraction": lost,
        "goodput": _goodput(productive, until) * (1 - lost),
        "uptime": uptime(round_times, 0.0, now, UPTIME_WINDOW_STEPS * cfg.step_time_s),
        "failures": len(struck),
        "failure_times": struck,
    }


def _rounds(sync: SynchronizerCore) -> int:
    return sum(sync.book.versions().values())


def _run_data_parallel(setup: Setup, progress: Progress | None) -> dict[str, Any]:
    """One learner spanning all hosts: every step waits for the slowest host, then all-reduces
    the gradients (2 x parameter bytes per host per step, ring all-reduce)."""
    cfg = setup.cfg
    sim = _Sim(setup, progress)
    whole = LearnerGroupConfig(
        name="data_parallel", batch_size=sum(lg.batch_size for lg in cfg.learners)
    )
    core = LearnerCore(
        cfg,
        whole,
        setup.plan,
        _full_snapshot(setup),
        setup.corpus.train,
    )
    clocks = [StepClock(cfg, lg, i) for i, lg in enumerate(cfg.learners)]
    allreduce_bytes = 2 * setup.param_bytes()
    comm = max(link_seconds(cfg, lg.region, allreduce_bytes) for lg in cfg.learners)
    now, next_eval, eval_every = 0.0, 0, max(1, cfg.token_budget // NUM_EVALS)
    busy = [0.0] * len(clocks)
    failures = [t for t, _ in sim_faults.failure_times(cfg, sim_faults.horizon(cfg))]
    ckpt = sim_faults.DataParallelCheckpoint.take(core)
    busy_at_ckpt, lost = 0.0, 0.0
    struck: list[float] = []  # when a failure stopped the job
    step_times: list[float] = []
    while core.cursor < cfg.token_budget:
        if failures and failures[0] <= now:
            # One host down stops the whole job: restart, roll back to the last checkpoint and
            # redo the steps since; failures while it is down hit nothing new.
            struck.append(failures[0])
            lost += sum(busy) - busy_at_ckpt
            busy_at_ckpt = sum(busy)
            ckpt.restore(core)
            now += cfg.chaos.restart_s
            failures = [t for t in failures if t > now]
        core.train_step(*core.next_batch())
        times = [c.next() for c in clocks]
        busy = [b + t for b, t in zip(busy, times, strict=True)]
        now += max(times) + comm
        step_times.append(now)
        if core.step % cfg.chaos.dp_checkpoint_every_steps == 0:
            ckpt, busy_at_ckpt = sim_faults.DataParallelCheckpoint.take(core), sum(busy)
        if core.cursor >= next_eval:
            sim.eval_point(now, core.cursor, core.params)
            next_eval += eval_every
    sim.eval_point(now, core.cursor, core.params)
    link_bytes = core.step * allreduce_bytes * cfg.num_learners
    return {
        "goodput": _goodput([sum(busy) - lost], [now * len(busy)]),
        "uptime": uptime(step_times, 0.0, now, UPTIME_WINDOW_STEPS * cfg.step_time_s),
        "failures": len(struck),
        "failure_times": struck,
        **_common_summary(setup, sim.evals, now),
        "tokens": core.cursor,
        "inner_steps": core.step,
        "bytes_total": link_bytes,
        "bytes_per_token": link_bytes / core.cursor,
        "dp_bytes_per_token": link_bytes / core.cursor,
    }


def _lost_fraction(sync: SynchronizerCore) -> float:
    """Share of trained tokens whose contribution was fenced or dropped by a guard: work that
    never reaches the global model (algorithm.md section 9, "work lost"). The tau overlap steps
    that an overwrite (mixing_alpha = 0) replaces are the merge rule, not lost time."""
    trained = sync.ledger.tokens_trained
    return sync.rejected_tokens / trained if trained else 0.0


def _goodput(busy: list[float], until: list[float]) -> float:
    """Fault-free goodput (algorithm.md section 9): step seconds over allocated seconds, each
    learner's allocation ending with its last completed step (the step it is in when the budget
    is reached is cut off by stopping, not lost). What remains lost is time blocked on a
    barrier, waiting for the slowest host or for the all-reduce."""
    return sum(busy) / sum(until) if sum(until) else 1.0


def _full_snapshot(setup: Setup) -> dict[int, tuple[int, dict[str, Any]]]:
    return {
        p: (0, {k: np.asarray(setup.init[k]) for k in paths})
        for p, paths in enumerate(setup.plan.fragments)
    }


def _common_summary(setup: Setup, evals: list[dict[str, float]], now: float) -> dict[str, Any]:
    cfg = setup.cfg
    return {
        "mode": cfg.diloco.mode,
        "heldout_loss": evals[-1]["heldout_loss"],
        "virtual_time_s": now,
        "num_params": model.num_params(setup.init),
        "evals": evals,
    }


def summarize_diloco(
    setup: Setup,
    sync: SynchronizerCore,
    learners: list[LearnerCore],
    evals: list[dict[str, float]],
    now: float,
) -> dict[str, Any]:
    cfg = setup.cfg
    tokens = sync.ledger.tokens_trained
    moved = sum(sync.bytes_up.values()) + sum(sync.bytes_down.values())
    tokens_per_dp_step = sum(lg.batch_size for lg in cfg.learners) * cfg.model.seq_len
    dp_bytes = tokens / tokens_per_dp_step * 2 * setup.param_bytes() * cfg.num_learners
    merged = [a.contributions for a in sync.ledger.accounts.values()]
    rounds = _rounds(sync)
    return {
        **_common_summary(setup, evals, now),
        "tokens": tokens,
        "rounds": rounds,
        "mean_contributors": sum(merged) / rounds if rounds else 0.0,
        "bytes_up": sum(sync.bytes_up.values()),
        "bytes_down": sum(sync.bytes_down.values()),
        "bytes_total": moved,
        "bytes_per_token": moved / max(1, tokens),
        "dp_bytes_per_token": dp_bytes / max(1, tokens),
        "rejected": dict(sync.rejected),
        # tokens that reached the global model, averaged over fragments
        "tokens_merged": sum(sync.ledger.tokens_merged(p) for p in range(setup.plan.num_fragments))
        / setup.plan.num_fragments,
        "ledger_violations": sync.ledger.violations(),
        "learners": {
            core.name: {
                "inner_steps": core.step,
                "tokens": core.cursor,
                "contributions_merged": sync.ledger.account(core.name).contributions,
            }
            for core in learners
        },
    }
