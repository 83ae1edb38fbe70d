"""Layer: runtime (Ray shell). How a synchronizer shard sends merged fragments out.

Each publication is put in the object store once (`ray.put`, owned by the synchronizer, so a
learner's death never takes a global fragment with it) and sent to every recipient's hosts, each
send delayed by the learner region's emulated downstream link (serial, as in the reference run). A
round's publication is tracked (`runtime/synchronizer/deliveries.py`): the round counts, and the
version mark records it, once a learner holds it. `Publisher` owns who can be sent to (the
registered learners' hosts and regions) and what was delivered.
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psutil
import ray

from ray_diloco.control.delay import DelayedCalls
from ray_diloco.control.journal import Journal
from ray_diloco.runtime.metrics import Metrics
from ray_diloco.runtime.resources import LOCAL_REGION
from ray_diloco.runtime.synchronizer.deliveries import Deliveries

if TYPE_CHECKING:  # JAX-using: imported inside the actor, never at module level
    from ray_diloco.algorithm.downstream import Message
    from ray_diloco.algorithm.links import LinkEmulator
    from ray_diloco.algorithm.sync_core import Publication, SynchronizerCore
    from ray_diloco.control.events import RoundClosed
    from ray_diloco.runtime.synchronizer.restore import ShardStore


@dataclass(frozen=True)
class StagedRound:
    pub: Publication
    groups: list[tuple[list[str], list[Message]]]  # recipients -> the messages they get
    active: dict[str, list[Any]]  # learner -> host actors
    live: int  # learners heard from recently, for the metrics


class Publisher:
    def __init__(
        self,
        core: SynchronizerCore,
        lock: threading.Lock,
        journal: Journal,
        metrics: Metrics,
        wan: LinkEmulator,
        store: ShardStore | None,
        regions: dict[str, str],
    ) -> None:
        self.core, self._lock, self.journal, self.metrics = core, lock, journal, metrics
        self.wan, self.store = wan, store
        self.hosts: dict[str, list[Any]] = {}  # registered learner -> its host actors
        self.regions = regions  # learner -> its region (its emulated links)
        # The newest version of each fragment a learner received: what `rounds` counts.
        self.delivered = core.book.versions()
        self._closing: dict[tuple[int, int], RoundClosed] = {}  # committed, not yet delivered
        # Committed rounds whose sends are not all answered yet (the run's end waits for them).
        self._unsettled: set[tuple[int, int]] = set()
        self._links = DelayedCalls("publish-links")
        self.deliveries = Deliveries(self._delivered, self._undelivered)

    def settled(self) -> bool:
        """Under the lock: every committed round's publication reached a learner or failed
        to reach any."""
        return not self._unsettled

    def rounds(self) -> int:
        """Rounds that reached a learner (the sum of the newest delivered versions)."""
        return sum(self.delivered.values())

    def adopt(self, fragment: int, version: int) -> None:
        """A restarted shard ended the recovery of `fragment` at `version` (learners hold it)."""
        self.delivered[fragment] = version

    def close(self) -> None:
        self._links.close()
        self.deliveries.close()

    def _delivered(self, fragment: int, version: int) -> None:
        """A learner holds `version` of `fragment` (the deliveries thread): the round
        counts, and the version mark says it (a restart recovers it from the learners)."""
        with self._lock:
            self._unsettled.discard((fragment, version))
            for key in sorted(k for k in self._closing if k[0] == fragment and k[1] <= version):
                self.journal.record(self._closing.pop(key))
            if version <= self.delivered.get(fragment, 0):
                return
            self.delivered[fragment] = version
            if self.store is not None:
                self.store.mark.update({fragment: version})

    def _undelivered(self, fragment: int, version: int) -> None:
        """No learner got `version` of `fragment`: it counts once a later one is delivered."""
        with self._lock:
            self._unsettled.discard((fragment, version))

    def targets(self) -> dict[str, list[Any]]:
        """Hosts of every registered learner that is not fenced or retired. Like the
        reference run, a learner momentarily silent (compiling, blocked) still gets it."""
        members = self.core.book.members
        return {n: h for n, h in self.hosts.items() if n in members and members[n].active}

    def stage(self, pub: Publication, closed: RoundClosed, now: float) -> StagedRound:
        """Under the lock: who gets a committed round's publication, and which messages; the
        round counts once a learner holds it (`closed` goes on the journal then)."""
        self._closing[(pub.fragment, pub.version)] = closed
        self._unsettled.add((pub.fragment, pub.version))
        active = self.targets()
        groups = self.core.messages(pub, self.core.recipients(pub, active))
        return StagedRound(pub, groups, active, len(self.core.book.live(now)))

    def send(self, staged: StagedRound) -> None:
        """Outside the lock: send a staged round's messages and count the round's metrics."""
        pub, active = staged.pub, staged.active
        sends = sum(len(active[n]) for names, _ in staged.groups for n in names)
        self.deliveries.expect(pub.fragment, pub.version, sends)
        for names, msgs in staged.groups:
            self.publish(msgs, {n: active[n] for n in names}, track=True)
        self._round_metrics(pub, staged.live)

    def publish(
        self, msgs: list[Message], targets: dict[str, list[Any]], track: bool = False
    ) -> None:
        """Send `msgs` (one version, or the differences up to it) to `targets`, in order;
        `track`: a round's publication, counted once its last message arrives
        (`deliveries`)."""
        refs = [ray.put(msg) for msg in msgs]  # owned by the synchronizer, shared by every send
        now = time.monotonic()
        for learner, handles in targets.items():
            # Each copy occupies the region's serial downstream pipe, as in the reference run.
            region = self.regions.get(learner, LOCAL_REGION)
            for i, (msg, ref) in enumerate(zip(msgs, refs, strict=True)):
                delay = self.wan.arrival(region, "down", msg.nbytes, now) - now
                last = track and i == len(msgs) - 1
                for host in handles:
                    send = functools.partial(self._send, host, msg, ref, last)
                    self._links.call_later(delay, send)
                self.metrics.link_bytes(learner, region, "down", msg.nbytes)

    def _send(self, host: Any, msg: Message, ref: Any, track: bool) -> None:
        # A learner that is down gets the latest version when it registers again.
        call = host.receive.remote(ref)
        if track:
            self.deliveries.sent(msg.fragment, msg.version, call)

    def _round_metrics(self, pub: Publication, live: int) -> None:
        m = self.metrics
        m.outer_round()
        m.contributors(len(pub.close.contributions))
        m.grace_window(pub.close.grace_s)
        for s in pub.close.staleness:
            m.staleness(s)
        m.global_version(pub.version)
        m.live_learners(live)
        m.synchronizer_memory(psutil.Process().memory_info().rss)
