"""Layer: runtime (Ray shell). The supervisor actor: starts, watches and restarts the learners,
injects chaos and records the event tape.

It decides nothing itself: `control.supervision.Supervision` turns observations into commands
and events, and this actor carries them out on a control-loop thread (every
`supervisor.poll_interval_s`). Each tick it (1) reads the synchronizer's status without waiting
(`ShardWatch`: journal events, rounds, merges per learner, restarts), (2) collects the answers of
its own heartbeats to every host (`LearnerSlot.poll`; Ray's node-death detection is never
waited for: a host silent past its load-adapted timeout is hung, a failed call is classified by
`classify_ray_error`), (3) ticks the controller and executes its `KillLearner` / `StartLearner`
commands (a launch runs on its own thread), and (4) lets the chaos engine inject what is due.
A learner about to be declared hung, or reported crashed, whose node Ray already declared dead
failed as `node_lost` instead (its preemption budget, its group rebuilt elsewhere), whichever of
Ray and the heartbeats noticed first. A learner counts as rejoined when the synchronizer merged
a contribution of its new incarnation. A non-finite contribution fails its learner
(`numerical`: its state may be corrupt, so it restarts from the published fragments); a
norm-guard rejection only marks it degraded (the rejection protected the model and the learner
adopts the next published version anyway; early in training honest contributions can trip the
guard). Stragglers and starved learners are recorded
by `control.degradation`, never restarted. Methods return at once; the driver polls `status()`,
calls `finish(reason)` at the end and waits for `status()["done"]`, then `shutdown()`.

The actor is a thin shell over two collaborators it builds and wires: `Membership` (elastic joins,
leaves, scavenging, drains, retiring: `runtime/supervisor/membership.py`) and `Health` (what a
learner's answers and the synchronizer's status say: failures, a rejoin, the work a restart throws
away: `runtime/supervisor/health.py`); both share one `RunPhase`.

The supervisor owns the run's event tape (`run_dir/events.jsonl`, one writer): its own events,
the synchronizer's journal and the chaos engine's injections go there, with run-clock times
(seconds since the driver's `t0`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from pathlib import Path
from typing import Any

import ray

from ray_diloco.config import LearnerGroupConfig, RunConfig
from ray_diloco.control.chaos import chaos_schedule
from ray_diloco.control.degradation import DegradationMonitor
from ray_diloco.control.events import (
    ContributionRejected,
    Event,
    FailureKind,
    LearnerState,
    RunFinished,
    RunStarted,
)
from ray_diloco.control.goodput import compute_goodput
from ray_diloco.control.protocol import HostStatus, SupervisorStatus, SynchronizerView
from ray_diloco.control.recovery import DEGRADE_REASONS, RESTART_REASONS, tape_summary
from ray_diloco.control.supervision import (
    Command,
    KillLearner,
    StartLearner,
    Supervision,
    heartbeat_cadence,
)
from ray_diloco.control.tape import EventTape
from ray_diloco.observe.log import setup_logging
from ray_diloco.runtime.learner.slot import make_slot, stop_all
from ray_diloco.runtime.metrics import Metrics
from ray_diloco.runtime.resources import actor_runtime_env, head_pin_options
from ray_diloco.runtime.supervisor.faults import ChaosEngine, HostRef
from ray_diloco.runtime.supervisor.health import wire
from ray_diloco.runtime.supervisor.membership import UP, ShardLeaves
from ray_diloco.runtime.supervisor.phase import RunPhase
from ray_diloco.runtime.synchronizer.watch import ShardWatch, uptime_window_s

logger = logging.getLogger(__name__)

HORIZON_S = 6 * 3600.0  # Poisson chaos faults are drawn this far ahead (runs are shorter)
STOP_TIMEOUT_S = 60.0
SYNC_START_S = 600.0  # a synchronizer's first answer: it builds data and parameters first


def supervisor_name(cfg: RunConfig) -> str:
    return f"{cfg.synchronizer.name}-supervisor"


@ray.remote(num_cpus=0, max_concurrency=4, max_restarts=0)  # type: ignore[call-overload]
class Supervisor:
    def __init__(
        self,
        cfg: RunConfig,
        t0: float,
        shards: list[Any],
        log_level: str = "WARNING",
        pin_region: bool = True,
        config_digest: str = "",
    ) -> None:
        setup_logging(log_level)
        self.cfg, self.t0 = cfg, t0
        s = cfg.supervisor
        names = [lg.name for lg in cfg.learners]
        self.regions = {lg.name: lg.region for lg in cfg.learners}
        self.tape = EventTape(Path(cfg.run_dir) / "events.jsonl")
        self.tape.append(RunStarted(self._now(), config_digest))
        hosts = {lg.name: lg.num_hosts for lg in cfg.learners}
        self.control = Supervision(s, names, self._now(), hosts)
        self.log_level, self.pin_region = log_level, pin_region
        self.slots = {
            lg.name: make_slot(cfg, lg, i, log_level, pin_region)
            for i, lg in enumerate(cfg.learners)
        }
        self.phase = RunPhase()
        self.degradation = DegradationMonitor(names, window_s=max(1.0, 4 * s.poll_interval_s))
        # The synchronizer's answers are timed out as a learner host's are.
        self.sync = ShardWatch(
            shards, t0, functools.partial(heartbeat_cadence, s), self._now, SYNC_START_S
        )
        self.shards = shards
        actions = chaos_schedule(cfg.chaos, names, sorted(set(self.regions.values())), HORIZON_S)
        self.chaos = ChaosEngine(actions, self, self._record, self._now, cfg) if actions else None
        self._lock = threading.Lock()
        self._snapshot = SupervisorStatus()
        self._done = threading.Event()
        self._stop = threading.Event()
        self._final: dict[str, HostStatus] = {}
        self._thread: threading.Thread | None = None
        self._end_t: float | None = None  # when the run finished (RunFinished)
        self.membership, self.health = wire(
            cfg,
            self.control,
            self.slots,
            self.regions,
            self.sync,
            self.degradation,
            self.phase,
            lambda lg, index: make_slot(cfg, lg, index, log_level, pin_region),
            ShardLeaves(shards),
            self._record,
            self._execute,
        )
        self.metrics = Metrics.create(cfg.metrics.export_ray_metrics, cfg.name)
        self._exported_at = -float("inf")

    def __repr__(self) -> str:  # how the Ray dashboard and log prefixes name the actor
        return f"Supervisor(run={self.cfg.name})"

    # -- methods (all return at once) ---------------------------------------------------------

    def start(self) -> bool:
        """Launch every learner (incarnation 0) and the control loop."""
        if self._thread is None:
            for slot in self.slots.values():
                slot.launch(0)
            self._thread = threading.Thread(target=self._loop, name="supervisor", daemon=True)
            self._thread.start()
        return True

    def status(self) -> SupervisorStatus:
        """Learners (state, incarnation, restarts), faults, the synchronizer, goodput so far."""
        with self._lock:
            snap = self._snapshot
        end = self._end_t if self._end_t is not None else self._now()
        live = self._end_t is None
        window = uptime_window_s(self.cfg.diloco.sync_every, self.sync.status)
        tape = tape_summary(self.tape.events, end, window, self.regions, live)
        return dataclasses.replace(snap, t=end, done=self._done.is_set(), final=self._final, **tape)

    def add_learner(self, spec: dict[str, Any], reason: str = "requested") -> str:
        """Queue a new learner (a `learners:` entry as a dict) to join the running job; it
        starts from the newest global fragments and reads data from the pool. Returns its
        name; a bad spec or a taken name raises ValueError naming the problem."""
        lg = LearnerGroupConfig.model_validate(spec)
        self.membership.request_join(lg, reason)
        return lg.name

    def remove_learner(self, name: str, reason: str = "requested") -> None:
        """Queue a graceful leave of learner `name` (its unsent work is offered first)."""
        self.membership.request_leave(name, reason)

    def finish(self, reason: str, over: bool = False) -> None:
        """End the run: no more chaos or restarts; the learners are stopped, their final
        status collected and RunFinished recorded (`status()["done"]` turns True). `over`:
        the token budget is spent (the learners hand in their unsent work as they stop)."""
        self.phase.over = self.phase.over or over
        if self.phase.finish is None:
            self.phase.finish = reason
            if self._thread is None:
                self._wind_down()

    def record_last_events(self, timeout_s: float = 60.0) -> None:
        """The synchronizer's events since the loop's last tick onto the tape: the final
        rounds and the last evaluation, which come after the learners stopped (the driver
        calls it once they are done; while the loop still runs, the loop records them)."""
        if self._done.is_set():
            self._record_all(self.sync.drain(timeout_s))

    def shutdown(self) -> None:
        """Kill every learner, free their placement groups, close the tape."""
        self._stop.set()
        if self.membership.scavenger is not None:
            self.membership.scavenger.close()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.chaos is not None:
            self.chaos.close()
        for slot in self.slots.values():
            slot.release()
        if not self._done.is_set():  # the driver gave up on the run (an error, an interrupt)
            tokens = self.sync.status.tokens if self.sync.status is not None else 0
            self.tape.append(RunFinished(self._now(), tokens, "shut down before the end"))
        self.tape.close()

    # -- chaos targets (faults.Targets) -------------------------------------------------------

    def hosts(self, learner: str) -> list[HostRef] | None:
        # Down too once Ray declared a host's node dead, before its silence is detected: a
        # fault aimed at it then waits for the rebuilt group instead of failing on a dead node.
        if self.control.watches[learner].state not in UP or self.health.node_lost(learner):
            return None
        return self.slots[learner].hosts()

    def learners_in(self, region: str) -> list[str]:
        return sorted(n for n, r in self.regions.items() if r == region)

    def synchronizer(self, shard: int = 0) -> Any:
        return self.shards[shard]

    def synchronizer_shards(self) -> list[Any]:
        return list(self.shards)

    def synchronizer_killed(self, shard: int, rounds: int | None) -> None:
        self.sync.killed(shard, rounds)

    # -- the control loop ---------------------------------------------------------------------

    def _now(self) -> float:
        return time.time() - self.t0

    def _record(self, event: Event) -> None:
        self.tape.append(event)
        self.metrics.observe_event(event)

    def _record_all(self, events: list[Event]) -> None:
        for e in events:
            self._record(e)

    def _loop(self) -> None:
        interval = self.cfg.supervisor.poll_interval_s
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self._tick()
            except Exception:  # the loop must survive anything one tick throws
                logger.exception("supervisor tick failed")
            if self.phase.finish is not None:
                self._wind_down()
                return
            self._stop.wait(max(0.0, interval - (time.monotonic() - started)))

    def _tick(self) -> None:
        events, st = self.sync.poll()
        self._record_all(events)
        now = self._now()
        self.membership.change(now)
        for e in events:
            if not isinstance(e, ContributionRejected):
                continue
            if e.reason in RESTART_REASONS:  # its state may be corrupt: start it afresh
                self.health.failed(e.learner, e.incarnation, FailureKind.NUMERICAL, now, e.reason)
            elif e.reason in DEGRADE_REASONS and e.incarnation == self.control.incarnation(
                e.learner
            ):
                self._record_all(self.degradation.rejected(e.learner, e.reason, now))
        if st is not None:
            self.health.on_sync_status(st, now)
        for name, slot in list(self.slots.items()):
            failure = slot.take_failure()
            if failure is not None:
                self.health.failed(name, failure[0], failure[1], now, failure[2])
            for host, reply, kind, why in slot.poll():
                if kind is not None:
                    self.health.failed(name, self.control.incarnation(name), kind, now, why)
                elif reply is not None:
                    self.health.on_reply(name, host, reply, now)
        for name in self.control.overdue(now):  # silent: hung, or did its node die?
            if self.health.node_lost(name):
                inc = self.control.incarnation(name)
                self.health.failed(name, inc, FailureKind.NODE_LOST, now, "silent; its node died")
        events, commands = self.control.tick(now)
        self._record_all(events)
        self._execute(commands, now)
        self.membership.retire_given_up()
        if self.chaos is not None and not self.phase.over:
            # Every learner's first start is over: it trains, or it failed and was restarted
            # (a first start that never ends is a failure of the startup timeout).
            watches = self.control.watches
            started = all(
                watches[n].state is LearnerState.TRAINING or watches[n].incarnation > 0
                for n in self.control.in_run()
            )
            self.chaos.tick(now, started)
        self._update_snapshot()
        if now - self._exported_at >= self.cfg.metrics.log_every_s:
            self._export_metrics(now)

    def _export_metrics(self, now: float, live: bool = True) -> None:
        """Goodput and uptime so far (`live`) or of the whole run, and which learners are up,
        as Prometheus gauges."""
        self._exported_at = now
        window = uptime_window_s(self.cfg.diloco.sync_every, self.sync.status)
        report = compute_goodput(self.tape.events, now, window, live=live)
        self.metrics.goodput(report.goodput, report.uptime)
        for name, watch in self.control.watches.items():
            self.metrics.learner_up(name, watch.state in UP)

    def _execute(self, commands: list[Command], now: float) -> None:
        for c in commands:
            if isinstance(c, KillLearner):
                self.slots[c.learner].kill(c.rebuild_group)
                self._record_all(self.degradation.reset(c.learner, now))
            elif isinstance(c, StartLearner) and self.phase.finish is None:
                self.slots[c.learner].launch(c.incarnation)

    def _update_snapshot(self) -> None:
        learners = {}
        for name, row in self.control.snapshot().items():
            info = self.slots[name].info.get(0)
            learners[name] = dataclasses.replace(
                row,
                step=info.step if info is not None else None,
                degraded=self.degradation.degraded(name),
                region=self.regions[name],
            )
        sync = self.sync.status
        snap = dataclasses.replace(
            self._snapshot,
            learners=learners,
            all_gave_up=not self.control.in_run() and not self.membership.joining,
            synchronizer=SynchronizerView(
                up=self.sync.up,
                restores=self.sync.restores,
                rounds=sync.rounds if sync is not None else 0,
                tokens=sync.tokens if sync is not None else 0,
            ),
            chaos_injected=self.chaos.injected if self.chaos else 0,
            chaos_skipped=self.chaos.skipped if self.chaos else 0,
        )
        with self._lock:
            self._snapshot = snap

    def _wind_down(self) -> None:
        reason = self.phase.finish or "finished"
        logger.info("supervisor winding down: %s", reason)
        if self.chaos is not None:
            self.chaos.close()
        if self.membership.scavenger is not None:
            self.membership.scavenger.close()
        finals = stop_all(self.slots.values(), STOP_TIMEOUT_S, at_budget=self.phase.over)
        now = self._now()
        for name in self.slots:
            self._record_all(self.control.finished(name, now, reason))
        self._update_snapshot()
        tokens = self.sync.status.tokens if self.sync.status is not None else 0
        self.tape.append(RunFinished(now, tokens, reason))
        # The gauges end on the figures the summary prints, not on the last periodic export
        # (up to metrics.log_every_s old; none at all in a run shorter than that).
        self._export_metrics(now, live=False)
        self._final = finals
        self._end_t = now
        self._done.set()


def create_supervisor(
    cfg: RunConfig,
    t0: float,
    shards: list[Any],
    log_level: str,
    pin_region: bool,
    config_digest: str,
) -> Any:
    """The run's supervisor: named in the run's namespace, on the head node, owned by the
    driver (it dies with the driver; the detached synchronizer does not)."""
    options = {
        "name": supervisor_name(cfg),
        "namespace": cfg.synchronizer.namespace,
        "runtime_env": actor_runtime_env(),
        **head_pin_options(),
    }
    actor = Supervisor.options(**options)  # type: ignore[attr-defined]
    return actor.remote(cfg, t0, shards, log_level, pin_region, config_digest)
