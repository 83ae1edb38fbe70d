"""Layer: runtime (Ray shell). How a synchronizer shard sends merged fragments out.

Each publication is put in the object store once (`ray.put`, owned by the synchronizer, so a
learner's death never takes a global fragment with it) and sent to every recipient's hosts, each
send delayed by the learner region's emulated downstream link (serial, as in the reference run). A
round's publication is tracked (`runtime/synchronizer/deliveries.py`): the round counts, and the
version mark records it, once a learner holds it.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import TYPE_CHECKING, Any

import psutil
import ray

from ray_diloco.runtime.resources import LOCAL_REGION

if TYPE_CHECKING:  # JAX-using: imported inside the actor, never at module level
    from ray_diloco.algorithm.downstream import Message
    from ray_diloco.algorithm.sync_core import Publication, SynchronizerCore
    from ray_diloco.control.events import RoundClosed
    from ray_diloco.runtime.synchronizer.restore import ShardStore


class PublishDuty:
    # What the synchronizer provides (synchronizer.py).
    core: SynchronizerCore
    hosts: dict[str, list[Any]]
    regions: dict[str, str]
    delivered: dict[int, int]
    journal: Any
    metrics: Any
    store: ShardStore | None
    deliveries: Any
    _closing: dict[tuple[int, int], RoundClosed]
    _lock: threading.Lock
    _wan: Any
    _links: Any

    def _delivered(self, fragment: int, version: int) -> None:
        """A learner holds `version` of `fragment` (the deliveries thread): the round
        counts, and the version mark says it (a restart recovers it from the learners)."""
        with self._lock:
            for key in sorted(k for k in self._closing if k[0] == fragment and k[1] <= version):
                self.journal.record(self._closing.pop(key))
            if version <= self.delivered.get(fragment, 0):
                return
            self.delivered[fragment] = version
            if self.store is not None:
                self.store.mark.update({fragment: version})

    def _targets(self) -> dict[str, list[Any]]:
        """Hosts of every registered learner that is not fenced or retired. Like the
        reference run, a learner momentarily silent (compiling, blocked) still gets it."""
        members = self.core.book.members
        return {n: h for n, h in self.hosts.items() if n in members and members[n].active}

    def _publish(
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
                delay = self._wan.arrival(region, "down", msg.nbytes, now) - now
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
