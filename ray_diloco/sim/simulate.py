"""Layer: sim (pure, no Ray). The reference run: M learners and the synchronizer in one
process on a virtual clock (docs/algorithm.md sections 4 to 8).

Every learner step takes `step_time_s / speed` virtual seconds (times `1 + jitter * N(0, 1)`),
transfers take what the region's emulated link would take, and merges take `sync_time_s`. The
learners and the synchronizer are the same `LearnerCore` and `SynchronizerCore` the Ray actors
wrap, so this run is the oracle for the Ray runs. Deterministic for a seed.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ray_diloco.algorithm import links, variants
from ray_diloco.algorithm.downstream import Message
from ray_diloco.algorithm.learner_core import LearnerCore
from ray_diloco.algorithm.pacing import StepClock
from ray_diloco.algorithm.setup import Setup, tokens_per_step
from ray_diloco.algorithm.sync_core import SynchronizerCore
from ray_diloco.config import LearnerGroupConfig, RunConfig
from ray_diloco.control.goodput import uptime
from ray_diloco.sim import sim_faults
from ray_diloco.sim.run_summary import (
    common_summary,
    full_snapshot,
    goodput,
    lost_fraction,
    rounds_closed,
    summarize_diloco,
)

Progress = Callable[[dict[str, Any]], None]
NUM_EVALS = 10  # held-out evaluations of the global parameters over a run
UPTIME_WINDOW_STEPS = 20  # the global model is "up" in a window of this many inner steps
# when it advanced at least once in it (docs/algorithm.md section 9)


def link_seconds(cfg: RunConfig, region: str, nbytes: int) -> float:
    """Time one transfer takes on the region's idle link (0 for regions without a link)."""
    return links.link_seconds(cfg.links.get(region), nbytes)


@dataclass
class _Sim:
    """The virtual-clock event loop shared by the DiLoCo modes."""

    setup: Setup
    progress: Progress | None
    queue: list[tuple[float, int, str, Any]] = field(default_factory=list)
    seq: itertools.count = field(default_factory=itertools.count)
    evals: list[dict[str, float]] = field(default_factory=list)
    num_evals: int = NUM_EVALS
    final_params: dict[str, Any] = field(default_factory=dict)  # the last evaluated
    # [start, end) of virtual time in which the synchronizer is down (restarting): it refuses
    # every offer, as a restarted shard does until its values are back, and the learners
    # train on and offer again after it
    outage: tuple[float, float] | None = None
    outage_refusals: int = 0

    def down(self, t: float) -> bool:
        return self.outage is not None and self.outage[0] <= t < self.outage[1]

    def push(self, t: float, kind: str, payload: Any) -> None:
        heapq.heappush(self.queue, (t, next(self.seq), kind, payload))

    def eval_point(self, t: float, tokens: int, params: dict[str, Any], **extra: Any) -> None:
        point = {"t": t, "tokens": tokens, "heldout_loss": self.setup.evaluate(params), **extra}
        self.evals.append(point)
        self.final_params = params
        if self.progress:
            self.progress(point)


def run_reference(
    cfg: RunConfig,
    progress: Progress | None = None,
    setup: Setup | None = None,
    num_evals: int = NUM_EVALS,
    outage: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """Run `cfg` in process and return its summary (see `summarize_diloco`); the global
    parameters are evaluated `num_evals` times over the token budget (and at the end).
    `outage`: [start, end) virtual seconds in which the synchronizer refuses every offer
    (a restart; decoupled modes only)."""
    return reference_run(cfg, progress, setup, num_evals, outage)[0]


def reference_run(
    cfg: RunConfig,
    progress: Progress | None = None,
    setup: Setup | None = None,
    num_evals: int = NUM_EVALS,
    outage: tuple[float, float] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """`run_reference`'s summary and the final global parameters (a flat dict)."""
    if outage is not None and cfg.diloco.mode != "decoupled":
        # a synchronous learner would wait out the outage: nothing to measure but the wait
        raise ValueError(f"an outage needs diloco.mode=decoupled, not {cfg.diloco.mode!r}")
    sim = _Sim(setup or Setup.build(cfg), progress, num_evals=num_evals, outage=outage)
    summary = _run_data_parallel(sim) if cfg.diloco.mode == "data_parallel" else _run_diloco(sim)
    return summary, sim.final_params


@dataclass
class _Learner:
    """One learner of the reference run: its core and its virtual-clock bookkeeping."""

    cfg: LearnerGroupConfig
    core: LearnerCore
    clock: StepClock
    start_s: float = 0.0  # when it joined: its allocation starts there
    blocked: bool = False
    busy_s: float = 0.0  # seconds of completed inner steps: the productive time
    done_s: float = 0.0  # when it last completed a step
    alive: bool = True
    left: bool = False
    epoch: int = 0  # bumped on failure: the dead process's pending step is void
    lost_s: float = 0.0


def _run_diloco(sim: _Sim) -> dict[str, Any]:
    setup = sim.setup
    cfg = setup.cfg
    sync = SynchronizerCore(cfg, setup.plan, setup.init)
    schedule = variants.schedule(cfg.diloco, sync.owned)
    polls: set[float] = set()
    wan = links.LinkEmulator(cfg.links)
    round_times: list[float] = []
    struck: list[float] = []  # when a failure hit a live learner (plots mark them)
    learners: list[_Learner] = []
    index: dict[str, int] = {}
    booting: set[str] = set()  # scheduled joiners not registered yet

    def admit(lg: LearnerGroupConfig, incarnation: int, t: float) -> LearnerCore:
        a = sync.register(lg.name, incarnation, t, tokens_per_step=tokens_per_step(setup.task, lg))
        return LearnerCore(
            cfg,
            lg,
            setup.task,
            setup.layout,
            setup.plan,
            sync.snapshot(),
            incarnation=incarnation,
            leases=a.leases,
            offset=a.offset,
            cursor=a.cursor,
            num_parts=cfg.data_parts,
        )

    def join(lg: LearnerGroupConfig, t: float, booted_s: float = 0.0) -> None:
        """`lg` registers at `t` after booting for `booted_s` (allocated from then on)."""
        i = len(learners)
        index[lg.name] = i
        clock = StepClock(cfg, lg, i)
        learners.append(_Learner(lg, admit(lg, 0, t), clock, start_s=t - booted_s))
        dt = clock.next()
        sim.push(t + dt, "step", (i, dt, 0))

    for lg in cfg.learners:
        join(lg, 0.0)
    horizon = sim_faults.horizon(cfg, setup.task.data.tokens_per_example)
    for t, i in sim_faults.failure_times(cfg, horizon):
        sim.push(t, "fail", i)
    for change in cfg.elastic.schedule:
        sim.push(change.at_s, "membership", change)
    next_eval, eval_every = 0, max(1, cfg.token_budget // sim.num_evals)
    now = 0.0

    def send(j: int, msgs: list[Message], t: float) -> None:
        """Messages down learner j's link, in order (the byte count is the caller's)."""
        lg = learners[j].cfg
        for msg in msgs:  # the link is a serial pipe: they arrive in order
            sim.push(wan.arrival(lg.region, "down", msg.nbytes, t), "publish", (j, msg))

    def close_rounds(t: float) -> None:
        for pub in sync.poll(t, sync_time_s=cfg.sync_time_s):
            round_times.append(t)
            live = [n for n, j in index.items() if not learners[j].left]
            for names, msgs in sync.messages(pub, sync.recipients(pub, live)):
                for name in names:
                    send(index[name], msgs, t + pub.sync_time_s)
        deadline = sync.book.next_deadline()
        if deadline is not None and deadline > t and deadline not in polls:
            polls.add(deadline)
            sim.push(deadline, "poll", None)

    def step_boundary(i: int, t: float) -> None:
        ln = learners[i]
        ln.core.apply_received()
        if ln.core.blocked_on():
            ln.blocked = True
            return
        ln.blocked = False
        dt = ln.clock.next()
        sim.push(t + dt, "step", (i, dt, ln.epoch))

    def pull(i: int, t: float) -> None:
        """Learner i reported its step at `t`: pull each fragment that falls due on its count
        from every live learner (`schedule: pull`); the request goes down each one's link
        (i itself offers at this step boundary)."""
        due = schedule.reported(learners[i].core.step)
        if not due:
            return
        for name in sorted(sync.book.live(t)):
            j = index[name]
            if j == i:
                learners[i].core.pull(due)
            else:
                sim.push(wan.arrival(learners[j].cfg.region, "down", 0, t), "pull", (j, due))

    def offer(ln: _Learner, offers: list[Any], t: float) -> None:
        for meta, delta in offers:
            nbytes = sum(e.nbytes for e in delta.values())
            sim.push(wan.arrival(ln.cfg.region, "up", nbytes, t), "arrive", (meta, delta))

    while sim.queue and sync.ledger.tokens_trained < cfg.token_budget:
        now, _, kind, payload = heapq.heappop(sim.queue)
        if kind == "step":
            i, dt, ep = payload
            ln = learners[i]
            if ep != ln.epoch or ln.left:
                continue  # the process that was taking this step died, or left
            ln.busy_s += dt
            ln.done_s = now
            core = ln.core
            core.train_step(*core.next_batch())
            leases = sync.report(ln.cfg.name, core.incarnation, now, dt, core.cursor)
            core.reader.add(leases or [])
            pull(i, now)
            offer(ln, core.offers(), now)
            step_boundary(i, now)
        elif kind == "arrive" and sim.down(now):
            sim.outage_refusals += 1
        elif kind == "arrive":
            meta, delta = payload
            newest = sync.catch_up(meta, sync.offer(meta, delta, now))
            if newest is not None and not learners[index[meta.learner]].left:
                sync.sent(meta.learner, newest.nbytes)
                send(index[meta.learner], [newest], now)
            close_rounds(now)
        elif kind == "pull":
            j, due = payload
            if learners[j].alive and not learners[j].left:
                learners[j].core.pull(due)
        elif kind == "poll":
            polls.discard(now)
            close_rounds(now)
        elif kind == "publish":
            j, msg = payload
            ln = learners[j]
            if not ln.alive or ln.left:
                continue  # a learner that is down gets the latest version when it comes back
            ln.core.receive(msg)
            if ln.blocked:
                step_boundary(j, now)
        elif kind == "fail" and payload < len(learners) and learners[payload].alive:
            ln = learners[payload]
            if ln.left:
                continue
            struck.append(now)
            ln.alive, ln.blocked = False, False
            ln.epoch += 1
            ln.lost_s += sim_faults.lost_steps(ln.core) * ln.clock.base
            sim.push(now + cfg.chaos.restart_s, "restart", payload)
        elif kind == "restart":
            ln = learners[payload]
            if ln.left:
                continue
            ln.core = admit(ln.cfg, ln.core.incarnation + 1, now)
            ln.alive = True
            step_boundary(payload, now)
        elif kind == "booted":
            if payload.name in booting:  # (a leave during its boot cancelled it)
                booting.discard(payload.name)
                join(payload, now, booted_s=cfg.chaos.restart_s)
        elif kind == "membership":
            if payload.join is not None:  # it boots and compiles, then registers
                booting.add(payload.join.name)
                sim.push(now + cfg.chaos.restart_s, "booted", payload.join)
            elif payload.leave in booting:
                booting.discard(payload.leave)  # it leaves before it ever trained
            else:
                # A graceful leave: the learner offers every fragment it has unsent work on,
                # leaves the quorum and gives its unread data back to the pool.
                ln = learners[index[payload.leave]]
                if ln.alive:
                    offer(ln, ln.core.final_offers(), now)
                ln.left, ln.done_s = True, now if ln.alive else ln.done_s
                sync.leave(ln.cfg.name, now)
                close_rounds(now)
        tokens = sync.ledger.tokens_trained
        if tokens >= next_eval:
            sim.eval_point(now, tokens, sync.global_params(), rounds=rounds_closed(sync))
            next_eval += eval_every
    sim.eval_point(
        now, sync.ledger.tokens_trained, sync.global_params(), rounds=rounds_closed(sync)
    )
    summary = summarize_diloco(setup, sync, [ln.core for ln in learners], sim.evals, now)
    lost = lost_fraction(sync)
    # A learner that is down at the end was allocated until the end; one that left, until then.
    until = [(ln.done_s if ln.alive or ln.left else now) - ln.start_s for ln in learners]
    productive = [ln.busy_s - ln.lost_s for ln in learners]
    merged = [summary["learners"][ln.cfg.name]["merged_share"] for ln in learners]
    return summary | {
        "work_lost_fraction": lost,
        "goodput": goodput(productive, until) * (1 - lost),
        # Only the step time whose work reached the global model counts as productive.
        "goodput_merged": goodput([b * s for b, s in zip(productive, merged, strict=True)], until),
        "uptime": uptime(round_times, 0.0, now, UPTIME_WINDOW_STEPS * cfg.step_time_s),
        "failures": len(struck),
        "failure_times": struck,
        "outage_refusals": sim.outage_refusals,
    }


def _run_data_parallel(sim: _Sim) -> dict[str, Any]:
    """One learner spanning all hosts: every step waits for the slowest host, then all-reduces
    the gradients (a ring all-reduce: 2 (M - 1) / M x parameter bytes per host per step)."""
    setup = sim.setup
    cfg = setup.cfg
    whole = LearnerGroupConfig(
        name="data_parallel", batch_size=sum(lg.batch_size for lg in cfg.learners)
    )
    core = LearnerCore(cfg, whole, setup.task, setup.layout, setup.plan, full_snapshot(setup))
    # The hosts by name: the configured learners', and those of `elastic.schedule` joins, which
    # the job takes in by re-meshing (a pause) and then shares its fixed global batch with.
    hosts = {lg.name: (lg, StepClock(cfg, lg, i)) for i, lg in enumerate(cfg.learners)}
    changes = sorted(cfg.elastic.schedule, key=lambda c: c.at_s)
    allreduce_bytes = round(links.ring_allreduce_bytes(setup.param_bytes(), len(hosts)))
    comm = max(link_seconds(cfg, lg.region, allreduce_bytes) for lg in cfg.learners)
    now, next_eval, eval_every = 0.0, 0, max(1, cfg.token_budget // sim.num_evals)
    busy = 0.0  # host-seconds of steps
    allocated = 0.0  # host-seconds the job held
    horizon = sim_faults.horizon(cfg, setup.task.data.tokens_per_example)
    failures = [t for t, _ in sim_faults.failure_times(cfg, horizon)]
    ckpt = sim_faults.DataParallelCheckpoint.take(core)
    busy_at_ckpt, lost = 0.0, 0.0
    struck: list[float] = []  # when a failure stopped the job
    step_times: list[float] = []
    while core.cursor < cfg.token_budget:
        if failures and failures[0] <= now:
            # One host down stops the whole job: restart, roll back to the last checkpoint and
            # redo the steps since; failures while it is down hit nothing new.
            struck.append(failures[0])
            lost += busy - busy_at_ckpt
            busy_at_ckpt = busy
            ckpt.restore(core)
            allocated += len(hosts) * cfg.chaos.restart_s
            now += cfg.chaos.restart_s
            failures = [t for t in failures if t > now]
        if changes and changes[0].at_s <= now:
            while changes and changes[0].at_s <= now:  # every change due: one re-mesh
                change = changes.pop(0)
                if change.join is not None:
                    hosts[change.join.name] = (change.join, StepClock(cfg, change.join, len(hosts)))
                elif change.leave is not None:
                    hosts.pop(change.leave, None)
            # A re-mesh pauses the whole job (new collectives, a recompiled step).
            allocated += len(hosts) * cfg.elastic.remesh_steps * cfg.step_time_s
            now += cfg.elastic.remesh_steps * cfg.step_time_s
        core.train_step(*core.next_batch())
        # The global batch is split over the hosts by their batch sizes: more hosts, less each.
        share = whole.batch_size / sum(lg.batch_size for lg, _ in hosts.values())
        times = [clock.next() * share for _, clock in hosts.values()]
        busy += sum(times)
        step = max(times) + comm
        allocated += len(hosts) * step
        now += step
        step_times.append(now)
        if core.step % cfg.chaos.dp_checkpoint_every_steps == 0:
            ckpt, busy_at_ckpt = sim_faults.DataParallelCheckpoint.take(core), busy
        if core.cursor >= next_eval:
            sim.eval_point(now, core.cursor, core.params)
            next_eval += eval_every
    sim.eval_point(now, core.cursor, core.params)
    link_bytes = core.step * allreduce_bytes * cfg.num_learners
    share = goodput([busy - lost], [allocated])
    return {
        "goodput": share,
        # Every step's update is the model's: only work since a lost checkpoint is not.
        "goodput_merged": share,
        "uptime": uptime(step_times, 0.0, now, UPTIME_WINDOW_STEPS * cfg.step_time_s),
        "failures": len(struck),
        "failure_times": struck,
        **common_summary(setup, sim.evals, now),
        "tokens": core.cursor,
        "inner_steps": core.step,
        "bytes_total": link_bytes,
        "bytes_per_token": link_bytes / core.cursor,
        "dp_bytes_per_token": link_bytes / core.cursor,
    }
