"""Layer: runtime (Ray shell). A learner's side of the synchronizer (used by its host 0).

The synchronizer may be split into shards (`synchronizer.num_shards`,
runtime/synchronizer/shards.py), each owning some fragments: the learner registers with every shard
(shard 0 also hands it its data), reports to every shard (each needs to know who is live) and sends
each contribution to the shard that owns its fragment; each shard publishes its own fragments to the
learner.

`register` admits this incarnation and returns what it adopts. `report` sends a progress
report without waiting for it: replies are read later with `ray.wait(timeout=0)` (at most
`MAX_REPORTS_IN_FLIGHT` outstanding per shard, beyond which only one report per beat is sent
while training goes on: a synchronizer being restarted never stops a learner); a reply can stop
the learner (the budget is spent) or ask it to register again with that shard (it restarted
and no longer knows it): the learner states what it holds (data, cursor, the newest version of
each fragment), hands the shard the values it asks for (`wanted`): the shard recovers its
newest global values from the learners (docs/algorithm.md section 7, docs/contracts.md), and adopts
the shard's snapshot.

`offer` hands each contribution to a sender thread that holds it for the emulated upstream
link time, then pushes it by value with
`shard.offer.remote`, at most `synchronizer.max_offers_in_flight` unanswered per shard: beyond
that an offer waits, and a newer offer of the same fragment replaces the waiting one. The newer
one carries the older one's work when both have the same base version (its counters run since
that base: the work is merged later, "coalesced"); otherwise the learner adopted a new version
in between and the older work is gone ("dropped": its tokens go to the ledger with the next
report). Either way nothing queues without bound behind a slow synchronizer.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import ray

from ray_diloco.config import LearnerGroupConfig, RunConfig
from ray_diloco.control.delay import DelayedCalls
from ray_diloco.control.events import StopReason
from ray_diloco.control.protocol import Registration, ReportReply
from ray_diloco.runtime.errors import classify_ray_error
from ray_diloco.runtime.synchronizer.shards import shard_handles

if TYPE_CHECKING:
    from ray_diloco.algorithm.learner_core import LearnerCore
    from ray_diloco.algorithm.round_types import ContributionMeta

logger = logging.getLogger(__name__)

MAX_REPORTS_IN_FLIGHT = 16
REGISTER_TIMEOUT_S = 300.0
Stop = Callable[[StopReason, str], None]  # LearnerHost.stop
Offer = tuple["ContributionMeta", dict[str, Any]]
Held = Callable[["LearnerCore"], dict[int, tuple[int, Any]]]


class Fenced(Exception):
    """The synchronizer refused this incarnation (a newer one registered)."""


class SyncChannel:
    def __init__(
        self,
        cfg: RunConfig,
        lg: LearnerGroupConfig,
        incarnation: int,
        counts: collections.Counter[str],
        held: Held,
    ) -> None:
        from ray_diloco.algorithm import links

        s = cfg.synchronizer
        self.held = held  # the newest publication of each fragment the learner holds
        self.wire_dtype = cfg.diloco.wire_dtype
        self.shards = shard_handles(cfg)
        self.owner: list[int] = []  # fragment -> shard, from the plan at registration
        self.me = ray.get_runtime_context().current_actor
        self.name, self.region, self.incarnation = lg.name, lg.region, incarnation
        self.num_hosts = lg.num_hosts
        self.batch_size = lg.batch_size
        self.counts = counts
        # This learner's upstream pipe. (In the reference run the learners of a region share
        # one; here each learner has its own, as separate processes.)
        self.wan = links.LinkEmulator(cfg.links)
        self.sender = DelayedCalls(f"{lg.name}-uplink")
        self.beat_s = s.heartbeat_timeout_s / 3
        self.max_offers = s.max_offers_in_flight
        num = len(self.shards)
        self._next_beat = [0.0] * num
        self._reports: list[collections.deque[Any]] = [collections.deque() for _ in range(num)]
        self._leases: list[tuple[int, int, int]] = []  # given in report replies, not yet read
        self._pulled: list[int] = []  # the same for pulled fragments
        # Offers per shard: sent and unanswered, and waiting for room (newest per fragment).
        # The sender thread adds, the training thread drains: one lock for both.
        self._offer_lock = threading.Lock()
        self._inflight: list[collections.deque[Any]] = [collections.deque() for _ in range(num)]
        self._waiting: list[dict[int, Offer]] = [{} for _ in range(num)]
        self.tokens_dropped = 0

    # -- registration -------------------------------------------------------------------------

    def register(self, stop: Stop, held: Any = None) -> Registration:
        """Register with every shard; returns the snapshot (every fragment), the data and the
        plan to start from."""
        from ray_diloco.algorithm.shards import fragment_owners

        logger.info("learner %s: registering with the synchronizer", self.name)
        replies = [self._register(shard, held) for shard in range(len(self.shards))]
        reply = dataclasses.replace(  # shard 0 hands out the data
            replies[0],
            snapshot={p: v for r in replies for p, v in r.snapshot.items()},
            finished=any(r.finished for r in replies),
        )
        self.owner = fragment_owners(reply.plan.sizes, len(self.shards))
        if reply.finished:
            stop(StopReason.BUDGET, "token budget reached before this learner started")
        return reply

    def _register(self, shard: int, held: Any) -> Registration:
        try:
            ref: Any = self.shards[shard].register.remote(
                self.name, self.incarnation, [self.me], self.region, held, self.batch_size
            )
            return cast(Registration, ray.get(ref, timeout=REGISTER_TIMEOUT_S))
        except ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, ValueError):  # an older incarnation: fenced
                raise Fenced(str(err.cause)) from err
            raise

    def _rejoin(self, core: LearnerCore, stop: Stop, shard: int) -> None:
        """Shard `shard` does not know this incarnation (it restarted): register with it again,
        hand it the newer values it wants, and adopt what it holds newer (section 7)."""
        if self.num_hosts > 1:
            # The other hosts would need the new snapshot too: the group restarts as a whole.
            raise Fenced("the synchronizer no longer knows this multi-host learner")
        logger.warning(
            "learner %s: report refused by shard %d; registering again", self.name, shard
        )
        self._reports[shard].clear()
        # It kept training: its leases, cursor and fragments are newer than the restored books.
        reader = core.reader
        fragments = self.held(core)
        versions = {p: version for p, (version, _) in fragments.items()}
        held = ([lease.as_tuple() for lease in reader.queue], reader.offset, core.cursor, versions)
        reply = self._register(shard, held)
        if reply.finished:
            stop(StopReason.BUDGET, "token budget reached")
        self._provide(shard, fragments, reply.wanted)
        # A fragment it holds newer than the restored one (which the shard is recovering from
        # the learners) is taken at its own version, the others at the shard's; one whose base
        # is still the newest keeps the steps trained through the outage.
        snapshot = dict(reply.snapshot)
        for p, (version, values) in fragments.items():
            if p in snapshot and version > snapshot[p][0]:
                snapshot[p] = (version, values)
        kept = core.rejoin(snapshot)
        self.counts["fragments_kept_on_rejoin"] += len(kept)
        self.counts["rejoins"] += 1

    def _provide(
        self, shard: int, fragments: dict[int, tuple[int, Any]], wanted: dict[int, int]
    ) -> None:
        """Hand the restarted shard the newer values it is recovering (not awaited)."""
        from ray_diloco.algorithm import wire

        dtype = wire.publish_dtype(self.wire_dtype)
        for p, best in wanted.items():
            version, values = fragments.get(p, (0, None))
            if version > best:  # the same bytes it was published as
                encoded = wire.encode_tree(values, dtype)
                self.shards[shard].provide.remote(self.name, self.incarnation, p, version, encoded)
                self.counts["fragments_provided"] += 1

    # -- progress reports ---------------------------------------------------------------------

    def report(
        self, core: LearnerCore, step_time: float | None, loss: float | None, stop: Stop
    ) -> None:
        for shard, handle in enumerate(self.shards):
            reports = self._reports[shard]
            if len(reports) >= MAX_REPORTS_IN_FLIGHT:
                # The shard is slow or being reconstructed from its checkpoint: keep training
                # (a learner never waits for it), report once per beat until it answers.
                self._drain_reports(core, stop, shard)
                if (
                    len(reports) >= MAX_REPORTS_IN_FLIGHT
                    and time.monotonic() < self._next_beat[shard]
                ):
                    self.counts["reports_skipped"] += 1
                    continue
            reports.append(
                handle.report.remote(
                    self.name,
                    self.incarnation,
                    core.step,
                    step_time,
                    core.cursor,
                    loss,
                    self.tokens_dropped,
                )
            )
            self._next_beat[shard] = time.monotonic() + self.beat_s
            self._drain_reports(core, stop, shard)

    def heartbeat(self, core: LearnerCore, loss: float | None, stop: Stop) -> None:
        """While blocked: a report without a step time every third of the heartbeat timeout."""
        if time.monotonic() >= min(self._next_beat):
            self.report(core, None, loss, stop)
        else:
            for shard in range(len(self.shards)):
                self._drain_reports(core, stop, shard)

    def _drain_reports(self, core: LearnerCore, stop: Stop, shard: int) -> None:
        reports = self._reports[shard]
        while reports:
            ready, _ = ray.wait([reports[0]], timeout=0)
            if not ready:
                return
            try:
                reply: ReportReply = ray.get(reports.popleft())
            except ray.exceptions.RayError as err:
                kind = classify_ray_error(err)
                self.counts[f"report_error_{kind}"] += 1
                logger.warning("learner %s: report failed (%s): %s", self.name, kind, err)
                continue
            if reply.stop:
                stop(StopReason.BUDGET, "token budget reached")
            elif not reply.ok:
                self._rejoin(core, stop, shard)
            else:
                self._leases.extend(reply.leases)
                self._pulled.extend(reply.pull)

    def take_leases(self) -> list[tuple[int, int, int]]:
        """Leases the synchronizer added since the last call, for the next step boundary."""
        leases, self._leases = self._leases, []
        return leases

    def take_pulled(self) -> list[int]:
        """Fragments the synchronizer pulled since the last call (`schedule: pull`), offered
        by every host of the learner from the next step on."""
        pulled, self._pulled = self._pulled, []
        return pulled

    # -- contributions ------------------------------------------------------------------------

    def offer(self, offers: list[Offer]) -> None:
        from ray_diloco.algorithm.wire import tree_bytes

        for meta, delta in offers:
            now = time.monotonic()
            delay = self.wan.arrival(self.region, "up", tree_bytes(delta), now) - now
            self.sender.call_later(delay, functools.partial(self._send, meta, delta))
        self._drain_offers()

    def _send(self, meta: ContributionMeta, delta: dict[str, Any]) -> None:
        """On the sender thread, once the emulated uplink delivered it: send, or wait."""
        with self._offer_lock:
            shard = self.owner[meta.fragment]
            if len(self._inflight[shard]) < self.max_offers:
                self._inflight[shard].append(self.shards[shard].offer.remote(meta, delta))
                return
            waiting = self._waiting[shard]
            older = waiting.pop(meta.fragment, None)
            waiting[meta.fragment] = (meta, delta)
            if older is None:
                self.counts["offers_waited"] += 1
            elif older[0].base_version == meta.base_version:
                self.counts["offers_coalesced"] += 1  # its work rides on the newer offer
            else:
                self.counts["offers_dropped"] += 1
                self.tokens_dropped += older[0].num_tokens

    def _drain_offers(self, flush: bool = False) -> None:
        """Count the answered offers and send waiting ones into the room they leave (all of
        them when `flush`)."""
        with self._offer_lock:
            for shard, inflight in enumerate(self._inflight):
                while inflight:
                    ready, _ = ray.wait([inflight[0]], timeout=0)
                    if not ready:
                        break
                    try:
                        verdict = ray.get(inflight.popleft())
                    except ray.exceptions.RayError as err:
                        verdict = f"error_{classify_ray_error(err)}"
                    self.counts[f"offer_{verdict}"] += 1
                waiting = self._waiting[shard]
                while waiting and (flush or len(inflight) < self.max_offers):
                    fragment = next(iter(waiting))
                    meta, delta = waiting.pop(fragment)
                    inflight.append(self.shards[shard].offer.remote(meta, delta))

    def farewell(self, core: LearnerCore, loss: float | None, timeout_s: float = 60.0) -> None:
        """Leaving the run for good: a last progress report (the ledger's cursor) and the last
        contributions, delivered before this returns, so no finished work is lost."""
        reports = [
            h.report.remote(
                self.name, self.incarnation, core.step, None, core.cursor, loss, self.tokens_dropped
            )
            for h in self.shards
        ]
        self.offer(core.final_offers())
        self.sender.close(drain_s=timeout_s)  # the emulated uplink delivers what it holds
        self._drain_offers(flush=True)
        with self._offer_lock:
            pending = [ref for inflight in self._inflight for ref in inflight]
        try:
            ray.get([*reports, *pending], timeout=timeout_s)
        except ray.exceptions.RayError as err:
            logger.warning("learner %s: farewell not fully delivered: %s", self.name, err)
        with self._offer_lock:
            for inflight in self._inflight:
                inflight.clear()

    def close(self) -> None:
        self.sender.close()
