"""Layer: runtime (Ray shell). `LearnerHost`: one host of a learner, running its inner loop.

The loop body is the algorithm's `LearnerCore` (train step, offers, apply received fragments,
synchronous blocking), driven here with real time and real transport in the order of
`simulate._run_diloco`'s step event: train, pad the step to the emulated speed, report, offer,
then apply what arrived at the step boundary (and in synchronous mode wait while `blocked_on`).
Methods return at once: `start()` launches the loop on a thread, `receive()` only queues a
published fragment for the next step boundary, `status()`/`stop()`/`ping()` read or set flags.
The synchronizer side (reports not awaited, offers held for the emulated uplink) lives in
`runtime/learner/channel.py`. In a learner with several hosts, host 0 talks to the synchronizer and
broadcasts its decisions to the others at every step boundary (`runtime/learner/spmd.py`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

import ray

from ray_diloco.config import LearnerGroupConfig, RunConfig
from ray_diloco.control.events import LearnerState, StopReason
from ray_diloco.control.protocol import HostPing, HostStatus, Registration
from ray_diloco.observe.log import setup_logging
from ray_diloco.runtime.learner.channel import Fenced, SyncChannel
from ray_diloco.runtime.learner.compile_cache import use_compilation_cache
from ray_diloco.runtime.metrics import Metrics

if TYPE_CHECKING:
    from ray_diloco.algorithm.downstream import Message
    from ray_diloco.algorithm.learner_core import LearnerCore

logger = logging.getLogger(__name__)

BLOCKED_WARN_S = 30.0


@ray.remote(max_concurrency=4, max_restarts=0)  # type: ignore[call-overload]
class LearnerHost:
    def __init__(
        self,
        cfg: RunConfig,
        lg: LearnerGroupConfig,
        learner_index: int,
        incarnation: int = 0,
        host_index: int = 0,
        num_hosts: int = 1,
        log_level: str = "WARNING",
    ) -> None:
        setup_logging(log_level)
        self.cfg, self.index, self.incarnation = cfg, learner_index, incarnation
        self.lg = lg
        self.name, self.host_index, self.num_hosts = self.lg.name, host_index, num_hosts
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._incoming: list[Message] = []  # received, not yet at a boundary
        self.stop_reason = StopReason.REQUESTED  # why the loop ends, once `_stop` is set
        self.farewell = False  # the loop ends handing in every unsent work (spmd.Boundary)
        self.stop_detail = ""  # the same in words, for people
        self._leaving = False
        self.state = LearnerState.STARTING
        self._set_state(LearnerState.STARTING, "created")
        self.core: LearnerCore | None = None
        self.layout: dict[str, Any] | None = None
        self.error: str | None = None
        self.counts = collections.Counter[str]()
        self.loss: float | None = None
        self.metrics = Metrics.create(cfg.metrics.export_ray_metrics and host_index == 0, cfg.name)
        self._thread: threading.Thread | None = None
        # Imported here: the supervisor imports this module to create the actor, and the
        # chaos hooks' wire format loads ml_dtypes (0.7 s of a boot every run waits for).
        from ray_diloco.algorithm.host_faults import HostFaults

        self.faults = HostFaults()  # chaos hooks: straggler, corrupted contributions
        self.channel: SyncChannel | None = None  # host 0's, once its loop runs

    def __repr__(self) -> str:  # how the Ray dashboard and log prefixes name the actor
        return (
            f"LearnerHost({self.name} host {self.host_index}/{self.num_hosts} "
            f"incarnation {self.incarnation}, {self.lg.region})"
        )

    # -- methods (all return at once) --------------------------------------------------------

    def start(self, coordinator: str | None = None) -> bool:
        """Start the loop; `coordinator` (host 0's address) joins a multi-host learner."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._main, args=(coordinator,), name="inner-loop", daemon=True
            )
            self._thread.start()
        return True

    def coordinator_address(self) -> str:
        from ray_diloco.runtime.learner import spmd

        return spmd.free_address()

    def receive(self, msg: Message) -> None:
        """A published fragment (a synchronizer-owned object), for the next step boundary."""
        with self._cond:
            self._incoming.append(msg)
            self.counts["received"] += 1
            self._cond.notify_all()

    def status(self) -> HostStatus:
        core = self.core
        return HostStatus(
            learner=self.name,
            host=self.host_index,
            incarnation=self.incarnation,
            state=self.state,
            step=core.step if core else 0,
            cursor=core.cursor if core else 0,
            loss=self.loss,
            counts=dict(self.counts),
            stop_reason=self.stop_reason,
            stop_detail=self.stop_detail,
            error=self.error,
            layout=self.layout,
        )

    def leave(self, reason: str = "requested") -> None:
        """Leave the run for good at the next step boundary: host 0 first sends a last
        report and every fragment with unsent work (a graceful leave loses nothing)."""
        self._leaving = True
        self.stop(StopReason.LEFT, f"left: {reason}")

    def stop(
        self, reason: StopReason = StopReason.REQUESTED, detail: str = "stopped by the driver"
    ) -> None:
        """Finish at the next step boundary (in a multi-host learner, host 0 decides)."""
        if not self._stop.is_set():
            self.stop_reason, self.stop_detail = reason, detail
        self._stop.set()
        with self._cond:
            self._cond.notify_all()

    def ping(self) -> HostPing:
        """A cheap liveness answer: who this is, where it runs, how far it got."""
        return HostPing(
            learner=self.name,
            host=self.host_index,
            incarnation=self.incarnation,
            state=self.state,
            step=self.core.step if self.core else 0,
            stop_reason=self.stop_reason,
            stop_detail=self.stop_detail,
            error=self.error,
            pid=os.getpid(),
            node_id=ray.get_runtime_context().get_node_id(),
        )

    def inject_fault(self, kind: str, duration_s: float = 0.0, factor: float = 1.0) -> str:
        """Chaos (runtime/supervisor/faults.py): become a straggler for a while, or corrupt the next
        offered contribution (corrupt_nan, corrupt_norm)."""
        return self.faults.arm(kind, duration_s, factor)

    def impair_link(self, region: str, duration_s: float, factor: float | None) -> bool:
        """Chaos: cut (factor None) or slow down this learner's emulated upstream link."""
        channel = self.channel
        if channel is None:
            return False
        now = time.monotonic()
        channel.wan.impair(region, now, now + duration_s, factor)
        return True

    # -- the inner loop (its own thread) -----------------------------------------------------

    def _main(self, coordinator: str | None) -> None:
        from ray_diloco.runtime.learner import spmd

        try:
            # Before JAX starts: an emulated slice's host gets one CPU device per chip.
            os.environ.update(spmd.emulation_env(self.lg))
            use_compilation_cache(self.cfg)  # a restarted incarnation loads, not compiles
            if self.num_hosts > 1:
                assert coordinator is not None, "a multi-host learner needs a coordinator"
                spmd.initialize(coordinator, self.num_hosts, self.host_index)
            self._run()
        except Fenced as err:
            self.stop_reason, self.stop_detail = StopReason.FENCED, str(err)
            logger.warning("learner %s: %s", self.name, err)
        except Exception as err:
            self.error = traceback.format_exc()
            logger.exception("learner %s host %d failed", self.name, self.host_index)
            self._set_state(LearnerState.DEAD, f"{type(err).__name__}: {err}")
            return
        done = LearnerState.LEFT if self._leaving else LearnerState.FINISHED
        self._set_state(done, self.stop_detail or self.stop_reason)

    def _run(self) -> None:
        from ray_diloco.algorithm import setup
        from ray_diloco.runtime.learner import spmd

        leader = self.host_index == 0
        channel = (
            SyncChannel(self.cfg, self.lg, self.incarnation, self.counts, self._held)
            if leader
            else None
        )
        self.channel = channel
        # The parameters' layout only (abstract shapes): their values come from the
        # synchronizer (host 0) or by broadcast (the others), and computing them here would
        # cost seconds of every restart.
        task = setup.task_of(self.cfg)
        tree = setup.layout_of(self.cfg, task)
        layout = setup.learner_layout(self.cfg, task, tree, self.lg, spmd.learner_devices(self.lg))
        link: Any = spmd.LocalLink()
        plan = None
        if self.num_hosts > 1:
            fragments = setup.fragment_plan(self.cfg, task)
            link = spmd.HostLink(fragments.fragments, tree.shapes)
            plan = None if leader else fragments
        try:
            self._train(task, tree, link, layout, channel, plan)
        finally:
            if channel is not None:
                channel.close()
            link.close()

    def _train(
        self, task: Any, tree: Any, link: Any, layout: Any, channel: SyncChannel | None, plan: Any
    ) -> None:
        from ray_diloco.algorithm import learner_core, sharding
        from ray_diloco.algorithm.learner_core import LearnerCore
        from ray_diloco.algorithm.leases import Lease
        from ray_diloco.algorithm.pacing import StepClock

        cfg, lg = self.cfg, self.lg
        if self.incarnation == 0:
            # The parameters' values come with the registration; the step's program needs only
            # their shapes, so it compiles while a synchronizer that starts with the run is
            # still building. A restarted incarnation registers first: that fences the one it
            # replaces at once.
            learner_core.compile_ahead(cfg, lg, task, layout)
        reply = Registration(None, {}, (0, 0, []), plan, finished=False)
        if channel is not None:
            reply = channel.register(self.stop)
        snapshot, (cursor, offset, leases) = link.share_start(reply.snapshot, reply.data)
        core = LearnerCore(
            cfg,
            lg,
            task,
            tree,
            reply.plan,
            snapshot,
            incarnation=self.incarnation,
            leases=[Lease(*lease) for lease in leases],
            offset=offset,
            cursor=cursor,
            num_parts=cfg.data_parts,
            layout=layout,
        )
        self.core = core
        self.layout = dataclasses.asdict(
            sharding.layout_report(core.layout, core.tx, core.params, core.opt_state)
        )
        clock = StepClock(cfg, lg, self.index)  # the reference run's seeded jitter
        self._set_state(LearnerState.COMPILING, "first step")
        while True:
            t0 = time.perf_counter()
            loss = core.dispatch_step(*core.next_batch())
            # The previous step's offers, whose host copies ran while this step was
            # dispatched: their delta and encoding overlap this step's compute.
            offers = self.faults.corrupt(core.collect_offers())
            self.loss = float(loss)
            core.begin_offers()
            compiled = self.state is LearnerState.COMPILING
            if compiled:
                self._set_state(LearnerState.TRAINING, "compiled")
            elif channel is not None:
                # Emulated speed: a step takes base/speed*(1+jitter*N(0,1)), where base is
                # its compute time or, pacing by step time, the virtual clock's step_time_s.
                base = time.perf_counter() - t0 if cfg.pace == "compute" else cfg.step_time_s
                target = base * clock.next() / cfg.step_time_s
                elapsed = time.perf_counter() - t0
                # Chaos: a straggler window stretches the step this one would have been, the
                # emulated one or, on a busy machine, the slower real one. Stretching only the
                # emulated time can leave a compute-bound step less than 2.5x slower, under
                # the degradation monitor's threshold: a CI run's straggler went unnoticed.
                target = max(target, elapsed) * self.faults.slowdown()
                self._stop.wait(max(0.0, target - elapsed))
            if channel is not None:
                step_time = time.perf_counter() - t0
                # The compiling step says nothing of the pace: reported, it would hold every
                # grace window open (sized from the slowest live learner's step time) for
                # seconds after a restart while the others' deltas grow into norm outliers.
                channel.report(core, None if compiled else step_time, self.loss, self.stop)
                if core.cursor >= cfg.token_budget:
                    # Alone past the budget: the synchronizer's stop comes with a report's
                    # answer, which a loaded machine delays by many of a fast learner's steps.
                    self.stop(StopReason.BUDGET, "token budget reached by this learner alone")
                channel.offer(offers)
                self.metrics.tokens(self.name, core.tokens_per_step)
                self.metrics.step_time(self.name, step_time)
                self.metrics.training_loss(self.name, self.loss)
            if not self._step_boundary(core, link, channel):
                if channel is not None and self.farewell:
                    channel.farewell(core, self.loss)
                return

    def _step_boundary(self, core: LearnerCore, link: Any, channel: SyncChannel | None) -> bool:
        """Apply what arrived; wait while `blocked_on` (synchronous mode) or while no data is
        leased for the next step. All hosts of a learner go through here in lock-step. Returns
        False when the learner must stop."""
        from ray_diloco.algorithm.leases import Lease
        from ray_diloco.runtime.learner.spmd import Boundary

        blocked_since: float | None = None
        while True:
            with self._cond:
                msgs, self._incoming = self._incoming, []
                stop = self._stop.is_set()
            for msg in msgs:  # resolved into the inbox (a difference against what it holds)
                core.receive(msg)
            # Every host applies host 0's inbox: hosts see arrivals at different moments.
            held = [(p, v, values) for p, (v, values) in sorted(core.inbox.items())]
            # Leaving, or at the budget of a decoupled run: the last work goes to the
            # synchronizer's final rounds (`ShardSet.final_rounds`).
            at_end = self.stop_reason is StopReason.BUDGET and self.cfg.diloco.final_rounds
            farewell = stop and (self._leaving or at_end)
            mine = Boundary(held, stop, farewell=farewell)
            if channel is not None:
                mine = Boundary(held, stop, channel.take_leases(), channel.take_pulled(), farewell)
            shared = link.share_step(mine)
            stop, self.farewell = shared.stop, shared.farewell
            core.inbox = {p: (v, values) for p, v, values in shared.received}
            core.reader.add([Lease(*lease) for lease in shared.leases])
            core.pull(shared.pulled)
            core.apply_received()
            if stop or (core.pending and core.blocked_on()):
                # Offers that cannot wait for the next step to hide their copies: the run
                # stops, or (tau = 0) a fragment is due back before the next step starts.
                offers = core.final_offers() if shared.farewell else core.collect_offers()
                flushed = self.faults.corrupt(offers)
                if channel is not None:
                    channel.offer(flushed)
            if stop:
                return False
            waiting: list[Any] = list(core.blocked_on())
            if core.reader.ahead() < core.tokens_per_step:
                waiting.append("data")  # the synchronizer has not topped up the leases
            if not waiting:
                if blocked_since is not None:
                    self._set_state(LearnerState.TRAINING, "fragments arrived")
                return True
            if blocked_since is None:
                blocked_since = time.monotonic()
                self._set_state(LearnerState.BLOCKED, f"waiting for {waiting}")
                logger.debug("learner %s waits for %s", self.name, waiting)
            if channel is not None:
                self._wait_for_fragments(core, channel, waiting, blocked_since)

    def _wait_for_fragments(
        self, core: LearnerCore, channel: SyncChannel, waiting: list[int], since: float
    ) -> None:
        """Host 0, synchronous mode: sleep until a fragment arrives or the run stops. Report
        meanwhile (as a heartbeat, without a step time) so the synchronizer sees this learner
        alive and the stop at the token budget reaches it."""
        with self._cond:
            if not self._incoming and not self._stop.is_set():
                self._cond.wait(timeout=0.5)
        channel.heartbeat(core, self.loss, self.stop)
        if time.monotonic() - since > BLOCKED_WARN_S and not self.counts["warned_blocked"]:
            self.counts["warned_blocked"] += 1
            logger.warning("learner %s waits for fragments %s", self.name, waiting)

    def _held(self, core: LearnerCore) -> dict[int, tuple[int, Any]]:
        """The newest publication of each fragment this learner holds, including those that
        arrived since the last step boundary (a restarted synchronizer recovers from them)."""
        with self._cond:
            incoming = list(self._incoming)
        return core.held(incoming)

    def _set_state(self, state: LearnerState, reason: str) -> None:
        self.state = state
        logger.debug("learner %s host %d: %s (%s)", self.name, self.host_index, state, reason)
