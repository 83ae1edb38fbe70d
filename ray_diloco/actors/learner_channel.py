"""Layer: actors (Ray shell). A learner's side of the synchronizer (used by its host 0).

`register` admits this incarnation and returns what it adopts. `report` sends a progress
report without waiting for it: replies are read later with `ray.wait(timeout=0)` (at most
`MAX_REPORTS_IN_FLIGHT` outstanding, beyond which only one report per beat is sent while
training goes on: a synchronizer being restarted never stops a learner); a reply can stop the
learner (the budget is spent) or ask it to register again (the synchronizer restarted from a
checkpoint and no longer knows it). `offer` hands each contribution to a sender thread that
holds it for the emulated upstream link time, then pushes it by value with `sync.offer.remote`.
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import ray

from ray_diloco.actors.delay import DelayedCalls
from ray_diloco.actors.errors import classify_ray_error
from ray_diloco.config import LearnerGroupConfig, RunConfig

if TYPE_CHECKING:
    from ray_diloco.algorithm.learner_core import LearnerCore

logger = logging.getLogger(__name__)

MAX_REPORTS_IN_FLIGHT = 16
REGISTER_TIMEOUT_S = 300.0
Stop = Callable[[str], None]


class Fenced(Exception):
    """The synchronizer refused this incarnation (a newer one registered)."""


class SyncChannel:
    def __init__(
        self,
        cfg: RunConfig,
        lg: LearnerGroupConfig,
        incarnation: int,
        counts: collections.Counter[str],
    ) -> None:
        from ray_diloco.algorithm import links

        s = cfg.synchronizer
        self.sync = ray.get_actor(s.name, namespace=s.namespace)
        self.me = ray.get_runtime_context().current_actor
        self.name, self.region, self.incarnation = lg.name, lg.region, incarnation
        self.num_hosts = lg.num_hosts
        self.counts = counts
        # This learner's upstream pipe. (In the reference run the learners of a region share
        # one; here each learner has its own, as separate processes.)
        self.wan = links.LinkEmulator(cfg.links)
        self.sender = DelayedCalls(f"{lg.name}-uplink")
        self.beat_s = s.heartbeat_timeout_s / 3
        self._next_beat = 0.0
        self._reports: collections.deque[Any] = collections.deque()
        self._offers: collections.deque[Any] = collections.deque()
        self._leases: list[tuple[int, int, int]] = []  # given in report replies, not yet read

    def register(self, stop: Stop, held: Any = None) -> dict[str, Any]:
        logger.info("learner %s: registering with the synchronizer", self.name)
        try:
            ref: Any = self.sync.register.remote(
                self.name, self.incarnation, [self.me], self.region, held
            )
            reply = cast(dict[str, Any], ray.get(ref, timeout=REGISTER_TIMEOUT_S))
        except ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, ValueError):  # an older incarnation: fenced
                raise Fenced(str(err.cause)) from err
            raise
        if reply["finished"]:
            stop("token budget reached before this learner started")
        return reply

    def report(
        self, core: LearnerCore, step_time: float | None, loss: float | None, stop: Stop
    ) -> None:
        if len(self._reports) >= MAX_REPORTS_IN_FLIGHT:
            # The synchronizer is slow or being reconstructed from its checkpoint: keep
            # training (a learner never waits for it), report once per beat until it answers.
            self._drain_reports(core, stop)
            if len(self._reports) >= MAX_REPORTS_IN_FLIGHT and time.monotonic() < self._next_beat:
                self.counts["reports_skipped"] += 1
                return
        self._reports.append(
            self.sync.report.remote(
                self.name, self.incarnation, core.step, step_time, core.cursor, loss
            )
        )
        self._next_beat = time.monotonic() + self.beat_s
        self._drain_reports(core, stop)

    def heartbeat(self, core: LearnerCore, loss: float | None, stop: Stop) -> None:
        """While blocked: a report without a step time every third of the heartbeat timeout."""
        if time.monotonic() >= self._next_beat:
            self.report(core, None, loss, stop)
        else:
            self._drain_reports(core, stop)

    def _drain_reports(self, core: LearnerCore, stop: Stop, block: bool = False) -> None:
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
                stop("token budget reached")
            elif not reply["ok"]:
                self._rejoin(core, stop)
            else:
                self._leases.extend(reply["leases"])

    def take_leases(self) -> list[tuple[int, int, int]]:
        """Leases the synchronizer added since the last call, for the next step boundary."""
        leases, self._leases = self._leases, []
        return leases

    def _rejoin(self, core: LearnerCore, stop: Stop) -> None:
        """The synchronizer does not know this incarnation (it restarted from a checkpoint):
        register again and adopt its current versions (algorithm.md section 7)."""
        if self.num_hosts > 1:
            # The other hosts would need the new snapshot too: the group restarts as a whole.
            raise Fenced("the synchronizer no longer knows this multi-host learner")
        logger.warning("learner %s: report refused; registering again", self.name)
        self._reports.clear()
        # It kept training: its leases and cursor are newer than the restored books.
        reader = core.reader
        held = ([lease.as_tuple() for lease in reader.queue], reader.offset, core.cursor)
        core.adopt(self.register(stop, held)["snapshot"])
        self.counts["rejoins"] += 1

    def offer(self, offers: list[tuple[Any, dict[str, Any]]]) -> None:
        from ray_diloco.algorithm.wire import tree_bytes

        for meta, delta in offers:
            now = time.monotonic()
            delay = self.wan.arrival(self.region, "up", tree_bytes(delta), now) - now
            self.sender.call_later(delay, functools.partial(self._send, meta, delta))
        self._drain_offers()

    def _send(self, meta: Any, delta: dict[str, Any]) -> None:
        self._offers.append(self.sync.offer.remote(meta, delta))  # on the sender thread

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

    def farewell(self, core: LearnerCore, loss: float | None, timeout_s: float = 60.0) -> None:
        """Leaving the run for good: a last progress report (the ledger's cursor) and the last
        contributions, delivered before this returns, so no finished work is lost."""
        report: Any = self.sync.report.remote(
            self.name, self.incarnation, core.step, None, core.cursor, loss
        )
        self.offer(core.final_offers())
        self.sender.close(drain_s=timeout_s)  # the emulated uplink delivers what it holds
        try:
            ray.get([report, *self._offers], timeout=timeout_s)
        except ray.exceptions.RayError as err:
            logger.warning("learner %s: farewell not fully delivered: %s", self.name, err)
        self._offers.clear()

    def close(self) -> None:
        self.sender.close()
