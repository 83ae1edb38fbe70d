"""Layer: runtime (Ray shell). The supervisor's membership duty: joins and leaves of a running
job, carried out by the supervisor's control loop (`Supervisor` mixes this in; see its module
doc). Requests (`add_learner`, `remove_learner`, `elastic.schedule`, the scavenger) are queued
and carried out on the loop's thread; the drain watch turns a node Ray drains into leaves; a
leave is graceful (the learner's goodbye first, then the synchronizer takes it out of the
quorum and its unread data back, acknowledged on the tape as `learner_left`); a learner given
up on is retired while `elastic.min_learners` others remain.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from typing import Any

import ray

from ray_diloco.config import LearnerGroupConfig, RunConfig
from ray_diloco.control.degradation import DegradationMonitor
from ray_diloco.control.events import Event, LearnerJoined, LearnerLeft, LearnerState
from ray_diloco.control.supervision import Supervision
from ray_diloco.runtime.learner.slot import make_slot
from ray_diloco.runtime.supervisor.nodes import Scavenger, draining_nodes

logger = logging.getLogger(__name__)

DRAIN_POLL_S = 1.0  # how often the drain watch asks Ray which nodes it is draining
UP = frozenset({LearnerState.COMPILING, LearnerState.TRAINING, LearnerState.BLOCKED})


class MembershipDuty:
    # What the supervisor provides (supervisor.py).
    cfg: RunConfig
    control: Supervision
    slots: dict[str, Any]
    regions: dict[str, str]
    degradation: DegradationMonitor
    shards: list[Any]
    log_level: str
    pin_region: bool
    _finish: str | None
    _run_over: bool
    _training_since: dict[str, float]
    _record: Callable[[Event], None]
    _record_all: Callable[[list[Event]], None]

    def _init_membership(self, cfg: RunConfig) -> None:
        # Membership changes wait here for the control loop (callers never block on it).
        self._requests: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._joining: set[str] = set()  # queued joins, until carried out
        self._leaving: dict[str, str] = {}  # learner -> why, until it has left
        self._sync_leaves: dict[str, tuple[list[Any], str]] = {}  # shards' acks awaited
        self._retired: set[str] = set()
        self._drains_polled = 0.0
        self._schedule = list(cfg.elastic.schedule)  # the reference run's, on the run clock
        scavenging = cfg.elastic.scavenge and cfg.elastic.templates
        self.scavenger = Scavenger(cfg, self._scavenged, self._taken) if scavenging else None

    def _taken(self, name: str) -> bool:
        return name in self.slots or name in self._joining

    def _headcount(self) -> int:
        return len(self.control.in_run()) + len(self._joining)

    def _scavenged(self, lg: LearnerGroupConfig, placement: Any) -> bool:
        """The scavenger found room for `lg` (its placement is reserved): join, if allowed."""
        if self._finish is not None or self._run_over or self._taken(lg.name):
            return False
        if self._headcount() >= self.cfg.elastic.max_learners:
            return False
        self._joining.add(lg.name)
        self._requests.put(("join", lg, placement, "scavenged"))
        return True

    def _change_membership(self, now: float) -> None:
        while self._schedule and self._schedule[0].at_s <= now:
            change = self._schedule.pop(0)
            if change.join is not None:
                self._joining.add(change.join.name)
                self._requests.put(("join", change.join, None, "scheduled"))
            else:
                self._requests.put(("leave", change.leave, "scheduled"))
        while True:
            try:
                request = self._requests.get_nowait()
            except queue.Empty:
                break
            if self._finish is not None or self._run_over:
                continue  # the run is ending: nobody joins or leaves any more
            if request[0] == "join":
                self._join(request[1], request[2], request[3], now)
            else:
                self._start_leave(request[1], request[2], now)
        if now - self._drains_polled >= DRAIN_POLL_S:
            self._drains_polled = now
            self._leave_draining_nodes(now)
        self._collect_sync_leaves(now)

    def _join(self, lg: LearnerGroupConfig, placement: Any, reason: str, now: float) -> None:
        self._joining.discard(lg.name)
        slot = make_slot(self.cfg, lg, len(self.slots), self.log_level, self.pin_region)
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
        if name in self._leaving or name not in self.control.in_run():
            return
        self._leaving[name] = reason
        logger.warning("learner %s leaves the run (%s)", name, reason)
        state = self.control.watches[name].state
        if state not in UP or not self.slots[name].leave(reason):
            self._finish_leave(name, now)  # nothing running to say goodbye

    def _finish_leave(self, name: str, now: float) -> None:
        """The learner said goodbye (or cannot): stop watching it, free its hosts, and have
        the synchronizer take it out of the quorum and its unread data back."""
        reason = self._leaving.pop(name, "left")
        self._record_all(self.control.leave(name, now, reason))
        self._training_since.pop(name, None)
        self.slots[name].release()
        self._sync_leaves[name] = (self._leave_all(name), reason)

    def _leave_all(self, name: str) -> list[Any]:
        """Tell every shard that `name` left (shard 0 takes its data back)."""
        return [h.leave.remote(name) for h in self.shards]

    def _collect_sync_leaves(self, now: float) -> None:
        """Acknowledged leaves go on the tape with the data they gave back (shard 0's answer);
        failed calls (a shard being restored) are sent again."""
        for name, (refs, reason) in list(self._sync_leaves.items()):
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            if len(ready) < len(refs):
                continue
            try:
                tokens = [int(t) for t in ray.get(refs)]
            except ray.exceptions.RayError as err:
                logger.info("leave of %s not acknowledged (%s); resending", name, err)
                self._sync_leaves[name] = (self._leave_all(name), reason)
                continue
            del self._sync_leaves[name]
            self._record(LearnerLeft(now, name, reason, tokens[0]))

    def _leave_draining_nodes(self, now: float) -> None:
        draining = draining_nodes()
        if not draining:
            return
        for name in self.control.in_run():
            nodes = {str(info.get("node_id")) for info in self.slots[name].info.values()}
            if nodes & draining:
                self._start_leave(name, "its node is being drained (preemption)", now)

    def _retire_given_up(self, now: float) -> None:
        """A learner out of restarts leaves the run (its data back to the pool, out of the
        quorum) while at least `elastic.min_learners` others remain."""
        for name, w in self.control.watches.items():
            if w.state is not LearnerState.GAVE_UP or name in self._retired:
                continue
            if len(self.control.in_run()) < self.cfg.elastic.min_learners:
                return
            self._retired.add(name)
            self.slots[name].release()
            self._sync_leaves[name] = (self._leave_all(name), "retired: gave up")
