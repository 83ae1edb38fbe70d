"""Layer: actors (Ray shell). `LearnerHost`: one host of a learner, running its inner loop.

The loop body is the algorithm's `LearnerCore` (train step, offers, apply received fragments,
synchronous blocking), driven here with real time and real transport in the order of
`simulate._run_diloco`'s step event: train, pad the step to the emulated speed, report, offer,
then apply what arrived at the step boundary (and in synchronous mode wait while `blocked_on`).
Methods return at once: `start()` launches the loop on a thread, `receive()` only queues a
published fragment, `status()`/`stop()`/`ping()` read or set flags. Reports are not awaited
(their replies are read with `ray.wait(timeout=0)`); offers leave through a sender thread that
holds each one for the emulated upstream link time. In a learner with several hosts, host 0
talks to the synchronizer and the others follow it (`spmd.py`).
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

import ray

from ray_diloco.actors.delay import DelayedCalls
from ray_diloco.actors.errors import classify_ray_error
from ray_diloco.config import RunConfig
from ray_diloco.control.events import LearnerState
from ray_diloco.log import setup_logging
from ray_diloco.metrics import Metrics

if TYPE_CHECKING:
    from ray_diloco.algorithm.learner_core import LearnerCore
    from ray_diloco.algorithm.wire import Encoded

logger = logging.getLogger(__name__)

MAX_REPORTS_IN_FLIGHT = 16  # beyond this the loop waits for the synchronizer (logged)
BLOCKED_WARN_S = 30.0


class Fenced(Exception):
    """The synchronizer refused this incarnation (a newer one registered)."""


@ray.remote(max_concurrency=4, max_restarts=0)
class LearnerHost:
    def __init__(
        self,
        cfg: RunConfig,
        learner_index: int,
        incarnation: int = 0,
        host_index: int = 0,
        num_hosts: int = 1,
        log_level: str = "WARNING",
    ) -> None:
        setup_logging(log_level)
        self.cfg, self.index, self.incarnation = cfg, learner_index, incarnation
        self.lg = cfg.learners[learner_index]
        self.name, self.host_index, self.num_hosts = self.lg.name, host_index, num_hosts
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self.stop_reason = ""
        self.transitions: list[dict[str, Any]] = []
        self.state = LearnerState.STARTING
        self._set_state(LearnerState.STARTING, "created")
        self.core: LearnerCore | None = None
        self._early: list[tuple[int, int, Any]] = []  # fragments received before the core
        self.error: str | None = None
        self.counts = collections.Counter[str]()
        self.loss: float | None = None
        self.metrics = Metrics.create(cfg.metrics.export_ray_metrics)
        self._reports: collections.deque[Any] = collections.deque()
        self._offers: collections.deque[Any] = collections.deque()
        self._thread: threading.Thread | None = None
        self.spmd: Any = None  # set by init_spmd for learners with several hosts

    # -- methods (all return at once) --------------------------------------------------------

    def start(self) -> bool:
        if self._thread is None:
            self._thread = threading.Thread(target=self._main, name="inner-loop", daemon=True)
            self._thread.start()
        return True

    def receive(self, fragment: int, version: int, encoded: dict[str, Encoded]) -> None:
        """A published fragment (a synchronizer-owned object); applied at a step boundary."""
        from ray_diloco.algorithm.wire import decode_tree

        values = decode_tree(encoded)
        with self._cond:
            if self.core is None:
                self._early.append((fragment, version, values))
            else:
                self.core.receive(fragment, version, values)
            self.counts["received"] += 1
            self._cond.notify_all()

    def status(self, since_transition: int = 0) -> dict[str, Any]:
        core = self.core
        return {
            "learner": self.name,
            "host": self.host_index,
            "incarnation": self.incarnation,
            "state": self.state.value,
            "step": core.step if core else 0,
            "cursor": core.cursor if core else 0,
            "loss": self.loss,
            "counts": dict(self.counts),
            "error": self.error,
            "stop_reason": self.stop_reason,
            "transitions": self.transitions[since_transition:],
        }

    def stop(self, reason: str = "stopped by the driver") -> None:
        if not self._stop.is_set():
            self.stop_reason = reason
        self._stop.set()
        with self._cond:
            self._cond.notify_all()

    def ping(self) -> str:
        return "ok"

    # -- the inner loop (its own thread) -----------------------------------------------------

    def _main(self) -> None:
        sender = DelayedCalls(f"{self.name}-uplink")
        try:
            self._run(sender)
        except Fenced as err:
            self.stop_reason = str(err)
            logger.warning("learner %s: %s", self.name, err)
        except Exception as err:
            self.error = traceback.format_exc()
            logger.exception("learner %s host %d failed", self.name, self.host_index)
            self._set_state(LearnerState.DEAD, f"{type(err).__name__}: {err}")
            return
        finally:
            sender.close()
        self._set_state(LearnerState.FINISHED, self.stop_reason or "stopped")

    def _run(self, sender: DelayedCalls) -> None:
        from ray_diloco.algorithm import simulate
        from ray_diloco.algorithm.learner_core import LearnerCore
        from ray_diloco.algorithm.wire import tree_bytes

        cfg, lg = self.cfg, self.lg
        sync = ray.get_actor(cfg.synchronizer.name, namespace=cfg.synchronizer.namespace)
        reply = self._register(sync)
        setup = simulate.Setup.build(cfg)
        core = LearnerCore(
            cfg,
            lg,
            setup.plan,
            reply["snapshot"],
            setup.corpus.train,
            incarnation=self.incarnation,
            cursor=reply["cursor"],
            shard_index=self.index,
            num_shards=cfg.num_learners,
        )
        with self._cond:
            self.core = core
            for early in self._early:
                core.receive(*early)
            self._early.clear()
        clock = simulate.StepClock(cfg, lg, self.index)  # the reference run's seeded jitter
        self._set_state(LearnerState.COMPILING, "first step")
        while not self._stop.is_set():
            t0 = time.perf_counter()
            self.loss = core.train_step(*core.next_batch())
            offers = core.offers()
            if self.state is LearnerState.COMPILING:
                self._set_state(LearnerState.TRAINING, "compiled")
            else:
                # Emulated speed: a step that computed in t takes t/speed*(1+jitter*N(0,1)).
                target = (time.perf_counter() - t0) * clock.next() / cfg.step_time_s
                self._stop.wait(max(0.0, target - (time.perf_counter() - t0)))
            step_time = time.perf_counter() - t0
            self._report(sync, step_time)
            self.metrics.tokens(self.name, core.tokens_per_step)
            self.metrics.step_time(self.name, step_time)
            for meta, delta in offers:
                delay = simulate.link_seconds(cfg, lg.region, tree_bytes(delta))
                sender.call_later(delay, functools.partial(self._offer, sync, meta, delta))
            self._drain_offers()
            self._step_boundary(sync, core)

    def _register(self, sync: Any) -> dict[str, Any]:
        me = ray.get_runtime_context().current_actor
        logger.info("learner %s: registering with the synchronizer", self.name)
        try:
            reply: dict[str, Any] = ray.get(
                sync.register.remote(self.name, self.incarnation, [me]), timeout=300
            )
        except ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, ValueError):  # an older incarnation: fenced
                raise Fenced(str(err.cause)) from err
            raise
        if reply["finished"]:
            self.stop("token budget reached before this learner started")
        return reply

    def _report(self, sync: Any, step_time: float | None) -> None:
        core = self.core
        assert core is not None
        self._reports.append(
            sync.report.remote(
                self.name, self.incarnation, core.step, step_time, core.cursor, self.loss
            )
        )
        self._drain_reports(sync, block=len(self._reports) > MAX_REPORTS_IN_FLIGHT)

    def _drain_reports(self, sync: Any, block: bool = False) -> None:
        while self._reports:
            if block:
                logger.info("learner %s waits for the synchronizer to answer reports", self.name)
            ready, _ = ray.wait([self._reports[0]], timeout=None if block else 0)
            block = False
            if not ready:
                return
            try:
                reply = ray.get(self._reports.popleft())
            except ray.exceptions.RayError as err:
                kind = classify_ray_error(err)
                self.counts[f"report_error_{kind}"] += 1
                logger.warning("learner %s: report failed (%s): %s", self.name, kind, err)
                continue
            if reply["stop"]:
                self.stop("token budget reached")
            elif not reply["ok"]:
                self._rejoin(sync)

    def _rejoin(self, sync: Any) -> None:
        """The synchronizer does not know this incarnation (it restarted from a checkpoint):
        register again and adopt its current versions (algorithm.md section 7)."""
        logger.warning("learner %s: report refused; registering again", self.name)
        self._reports.clear()
        reply = self._register(sync)
        with self._cond:
            assert self.core is not None
            self.core.adopt(reply["snapshot"])
        self.counts["rejoins"] += 1

    def _offer(self, sync: Any, meta: Any, delta: dict[str, Encoded]) -> None:
        self._offers.append(sync.offer.remote(meta, delta))  # runs on the sender thread

    def _drain_offers(self) -> None:
        while self._offers:
            ready, _ = ray.wait([self._offers[0]], timeout=0)
            if not ready:
                return
            try:
                verdict = ray.get(self._offers.popleft())
            except ray.exceptions.RayError as err:
                verdict = f"error_{classify_ray_error(err)}"
            self.counts[f"offer_{verdict}"] += 1

    def _step_boundary(self, sync: Any, core: LearnerCore) -> None:
        with self._cond:
            core.apply_received()
            waiting = core.blocked_on()
        if not waiting:
            return
        # Synchronous mode: wait for the fragments offered tau steps ago. Keep reporting (as a
        # heartbeat, without a step time) so the synchronizer sees this learner alive and the
        # stop at the token budget reaches it.
        self._set_state(LearnerState.BLOCKED, f"waiting for fragments {waiting}")
        logger.debug("learner %s waits for fragments %s", self.name, waiting)
        beat = self.cfg.synchronizer.heartbeat_timeout_s / 3
        start = next_beat = time.monotonic()
        warned = False
        while waiting and not self._stop.is_set():
            if time.monotonic() >= next_beat:
                self._report(sync, None)
                next_beat = time.monotonic() + beat
            if not warned and time.monotonic() - start > BLOCKED_WARN_S:
                logger.warning("learner %s waits for fragments %s", self.name, waiting)
                warned = True
            with self._cond:
                # Check and wait under one lock hold, so a receive() cannot slip in between.
                core.apply_received()
                waiting = core.blocked_on()
                if waiting:
                    self._cond.wait(timeout=min(beat, 0.5))
            self._drain_reports(sync)
        if not self._stop.is_set():
            self._set_state(LearnerState.TRAINING, "fragments arrived")

    def _set_state(self, state: LearnerState, reason: str) -> None:
        self.state = state
        self.transitions.append({"time": time.time(), "state": state.value, "reason": reason})
