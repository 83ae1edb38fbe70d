"""Layer: runtime (Ray shell). The supervisor's membership logic: joins and leaves of a running job.

Requests (`add_learner`, `remove_learner`, `elastic.schedule`, the scavenger) are queued and
carried out on the control loop's thread (`change`); the drain watch turns a node Ray drains into
leaves; a leave is graceful (the learner's goodbye first, then every synchronizer shard takes it
out of the quorum and its unread data back, acknowledged on the tape as `learner_left`); a
learner given up on is retired while `elastic.min_learners` others remain. `Membership` is given
the slots, a slot factory, the shards' leave calls and the drain query, so a test drives it with
fakes and no Ray.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

import ray

from ray_diloco.config import LearnerGroupConfig, RunConfig
from ray_diloco.control.degradation import DegradationMonitor
from ray_diloco.control.events import Event, LearnerJoined, LearnerLeft, LearnerState
from ray_diloco.control.protocol import HostPing
from ray_diloco.control.supervision import Supervision
from ray_diloco.runtime.supervisor.nodes import Scavenger, draining_nodes
from ray_diloco.runtime.supervisor.phase import RunPhase

logger = logging.getLogger(__name__)

DRAIN_POLL_S = 1.0  # how often the drain watch asks Ray which nodes it is draining
UP = frozenset({LearnerState.COMPILING, LearnerState.TRAINING, LearnerState.BLOCKED})


class Slot(Protocol):
    """What membership does with a learner's slot (runtime/learner/slot.py)."""

    info: dict[int, HostPing]

    def launch(self, incarnation: int) -> None: ...

    def give_placement(self, placement: Any) -> None: ...

    def leave(self, reason: str) -> bool: ...

    def release(self) -> None: ...


S = TypeVar("S", bound=Slot)


class LeaveCalls(Protocol):
    """How membership tells the synchronizer that a learner left (`ShardLeaves`)."""

    def send(self, name: str, reason: str) -> None: ...

    def acknowledged(self) -> list[tuple[str, str, int]]: ...


class ShardLeaves:
    """Tells every synchronizer shard that a learner left and collects their answers (shard
    0's: the unread tokens it took back); a failed call (a shard being restored) is resent."""

    def __init__(self, shards: list[Any]) -> None:
        self.shards = shards
        self._pending: dict[str, tuple[list[Any], str]] = {}

    def send(self, name: str, reason: str) -> None:
        self._pending[name] = ([h.leave.remote(name) for h in self.shards], reason)

    def acknowledged(self) -> list[tuple[str, str, int]]:
        """(learner, reason, tokens given back) of every leave all shards answered."""
        done = []
        for name, (refs, reason) in list(self._pending.items()):
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            if len(ready) < len(refs):
                continue
            try:
                tokens = [int(t) for t in ray.get(refs)]
            except ray.exceptions.RayError as err:
                logger.info("leave of %s not acknowledged (%s); resending", name, err)
                self.send(name, reason)
                continue
            del self._pending[name]
            done.append((name, reason, tokens[0]))
        return done


class Membership(Generic[S]):
    def __init__(
        self,
        cfg: RunConfig,
        control: Supervision,
        slots: dict[str, S],
        regions: dict[str, str],
        degradation: DegradationMonitor,
        phase: RunPhase,
        new_slot: Callable[[LearnerGroupConfig, int], S],
        leaves: LeaveCalls,
        record: Callable[[Event], None],
        draining: Callable[[], set[str]] = draining_nodes,
    ) -> None:
        self.cfg, self.control, self.slots, self.regions = cfg, control, slots, regions
        self.degradation, self.phase = degradation, phase
        self._new_slot, self._leaves, self._record, self._draining = (
            new_slot,
            leaves,
            record,
            draining,
        )
        # Membership changes wait here for the control loop (callers never block on it).
        self._requests: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self.joining: set[str] = set()  # queued joins, until carried out
        self.leaving: dict[str, str] = {}  # learner -> why, until it has left
        self._retired: set[str] = set()
        self._drains_polled = 0.0
        self._schedule = list(cfg.elastic.schedule)  # the reference run's, on the run clock
        scavenging = cfg.elastic.scavenge and cfg.elastic.templates
        self.scavenger = Scavenger(cfg, self._scavenged, self.taken) if scavenging else None

    def _record_all(self, events: list[Event]) -> None:
        for e in events:
            self._record(e)

    # -- requests (any thread) ----------------------------------------------------------------

    def taken(self, name: str) -> bool:
        return name in self.slots or name in self.joining

    def headcount(self) -> int:
        return len(self.control.in_run()) + len(self.joining)

    def request_join(self, lg: LearnerGroupConfig, reason: str) -> None:
        """Queue `lg` to join; a taken name or a full run raises ValueError naming it."""
        if self.taken(lg.name):
            raise ValueError(f"learner name {lg.name!r} is taken in this run; pick another")
        if self.headcount() >= self.cfg.elastic.max_learners:
            raise ValueError(
                f"the run already has elastic.max_learners={self.cfg.elastic.max_learners} learners"
            )
        self.joining.add(lg.name)
        self._requests.put(("join", lg, None, reason))

    def request_leave(self, name: str, reason: str) -> None:
        """Queue a graceful leave of `name`; one not in the run raises ValueError."""
        if name not in self.slots or name not in self.control.in_run():
            raise ValueError(
                f"no learner {name!r} in the run; learners: {sorted(self.control.in_run())}"
            )
        self._requests.put(("leave", name, reason))

    def _scavenged(self, lg: LearnerGroupConfig, placement: Any) -> bool:
        """The scavenger found room for `lg` (its placement is reserved): join, if allowed."""
        if self.phase.ending or self.taken(lg.name):
            return False
        if self.headcount() >= self.cfg.elastic.max_learners:
            return False
        self.joining.add(lg.name)
        self._requests.put(("join", lg, placement, "scavenged"))
        return True

    # -- the control loop's thread ------------------------------------------------------------

    def change(self, now: float) -> None:
        """Carry out what is due: scheduled changes, requests, drains, acknowledged leaves."""
        while self._schedule and self._schedule[0].at_s <= now:
            change = self._schedule.pop(0)
            if change.join is not None:
                self.joining.add(change.join.name)
                self._requests.put(("join", change.join, None, "scheduled"))
            else:
                self._requests.put(("leave", change.leave, "scheduled"))
        while True:
            try:
                request = self._requests.get_nowait()
            except queue.Empty:
                break
            if self.phase.ending:
                continue  # the run is ending: nobody joins or leaves any more
            if request[0] == "join":
                self._join(request[1], request[2], request[3], now)
            else:
                self._start_leave(request[1], request[2], now)
        if now - self._drains_polled >= DRAIN_POLL_S:
            self._drains_polled = now
            self._leave_draining_nodes(now)
        for name, reason, tokens in self._leaves.acknowledged():
            self._record(LearnerLeft(now, name, reason, tokens))

    def _join(self, lg: LearnerGroupConfig, placement: Any, reason: str, now: float) -> None:
        self.joining.discard(lg.name)
        slot = self._new_slot(lg, len(self.slots))
        if placement is not None:
            slot.give_placement(placement)
        self.slots[lg.name] = slot
        self.regions[lg.name] = lg.region
        self.degradation.add(lg.name)
        self._record(LearnerJoined(now, lg.name, lg.region, lg.accelerator, reason))
        self._record_all(self.control.add(lg.name, now, lg.num_hosts))
        logger.warning("learner %s joins the run (%s)", lg.name, reason)
        slot.launch(0)

    def _start_leave(self, name: str, reason: str, now: float) -> None:
        if name in self.leaving or name not in self.control.in_run():
            return
        self.leaving[name] = reason
        logger.warning("learner %s leaves the run (%s)", name, reason)
        state = self.control.watches[name].state
        if state not in UP or not self.slots[name].leave(reason):
            self.finish_leave(name, now)  # nothing running to say goodbye

    def finish_leave(self, name: str, now: float) -> None:
        """The learner said goodbye (or cannot): stop watching it, free its hosts, and have
        the synchronizer take it out of the quorum and its unread data back."""
        reason = self.leaving.pop(name, "left")
        self._record_all(self.control.leave(name, now, reason))
        self.slots[name].release()
        self._leaves.send(name, reason)

    def _leave_draining_nodes(self, now: float) -> None:
        draining = self._draining()
        if not draining:
            return
        for name in self.control.in_run():
            nodes = {info.node_id for info in self.slots[name].info.values()}
            if nodes & draining:
                self._start_leave(name, "its node is being drained (preemption)", now)

    def retire_given_up(self) -> None:
        """A learner out of restarts leaves the run (its data back to the pool, out of the
        quorum) while at least `elastic.min_learners` others remain."""
        for name, w in self.control.watches.items():
            if w.state is not LearnerState.GAVE_UP or name in self._retired:
                continue
            if len(self.control.in_run()) < self.cfg.elastic.min_learners:
                return
            self._retired.add(name)
            self.slots[name].release()
            self._leaves.send(name, "retired: gave up")
