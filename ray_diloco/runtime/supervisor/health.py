"""Layer: runtime (Ray shell). The supervisor's health logic: what a learner's heartbeat answers
and the synchronizer's status say about each learner.

A reply moves the learner's state (or reports it dead, finished, or saying goodbye while
leaving); a merge of a new incarnation's contribution is its rejoin; a failure, unless the run is
over or the learner was leaving anyway, becomes the controller's decision (a restart) with the
work it throws away on the tape. `Health` is given everything it acts on (the controller, the
learners' slots, the synchronizer watch, membership, how to record and execute), so a test
drives it with fakes and no Ray.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from ray_diloco.config import LearnerGroupConfig, RunConfig
from ray_diloco.control.degradation import DegradationMonitor
from ray_diloco.control.events import (
    LOOP_ENDED,
    Event,
    FailureKind,
    LearnerState,
    WorkLost,
)
from ray_diloco.control.policy import restart_after_stop
from ray_diloco.control.protocol import HostPing
from ray_diloco.control.supervision import Command, Supervision
from ray_diloco.runtime.supervisor.membership import LeaveCalls, Membership, S
from ray_diloco.runtime.supervisor.nodes import draining_nodes, lost_nodes
from ray_diloco.runtime.supervisor.phase import RunPhase

logger = logging.getLogger(__name__)


class Slot(Protocol):
    """What health reads of a learner's slot: its hosts' last ping answers."""

    info: dict[int, HostPing]


class SyncView(Protocol):
    """What health reads of the synchronizer: its latest status and whether it is up."""

    @property
    def status(self) -> Any: ...

    @property
    def up(self) -> bool: ...


class Leaves(Protocol):
    """What health asks of membership: who is leaving, and ending a leave."""

    @property
    def leaving(self) -> Mapping[str, str]: ...

    def finish_leave(self, name: str, now: float) -> None: ...


class Health:
    def __init__(
        self,
        control: Supervision,
        slots: Mapping[str, Slot],
        sync: SyncView,
        degradation: DegradationMonitor,
        phase: RunPhase,
        membership: Leaves,
        record_all: Callable[[list[Event]], None],
        execute: Callable[[list[Command], float], None],
        lost: Callable[[Iterable[str]], set[str]] = lost_nodes,
    ) -> None:
        self.control, self.slots, self.sync = control, slots, sync
        self.degradation, self.phase, self.membership = degradation, phase, membership
        self._record_all, self._execute, self._lost = record_all, execute, lost
        # learner -> when its current training spell began (a learner that left keeps its
        # entry: names are never reused, and it fails no more)
        self.training_since: dict[str, float] = {}

    def on_reply(self, name: str, host: int, reply: HostPing, now: float) -> None:
        inc, state = reply.incarnation, reply.state
        if name in self.membership.leaving and state in LOOP_ENDED:
            self.membership.finish_leave(name, now)  # it said goodbye (or died saying it)
        elif state is LearnerState.DEAD:
            error = (reply.error or "").strip().splitlines()
            self.failed(name, inc, FailureKind.CRASH, now, error[-1] if error else "dead")
        elif state is LearnerState.FINISHED and host == 0:
            # Host 0 speaks for the learner: the other hosts end when its broadcast says so,
            # without a reason of their own.
            reason, detail = reply.stop_reason, reply.stop_detail
            if restart_after_stop(reason, self.phase.over):
                self.failed(name, inc, FailureKind.CRASH, now, f"stopped: {detail or reason}")
            else:
                self._record_all(self.control.finished(name, now, detail or reason))
        else:
            reported = state if host == 0 else None
            changes = self.control.heartbeat(name, inc, now, host, reported)
            self._record_all(changes)
            if self.control.watches[name].state is not LearnerState.TRAINING:
                self.training_since.pop(name, None)
            elif changes:
                self.training_since[name] = now
            if host == 0 and self.control.watches[name].state is LearnerState.TRAINING:
                self._record_all(self.degradation.steps(name, reply.step, now))

    def on_sync_status(self, st: Any, now: float) -> None:
        """The synchronizer's combined status (`SynchronizerStatus`)."""
        if st.finished:
            self.phase.over = True
        for name in self.slots:
            inc = self.control.incarnation(name)
            if st.merged_incarnations.get(name) == inc:
                reg = st.registered.get(name)
                versions = reg.versions if reg is not None and reg.incarnation == inc else {}
                self._record_all(self.control.contributed(name, inc, now, dict(versions)))
            merged = st.contributions_merged.get(name, 0)
            self._record_all(self.degradation.merged(name, merged, now))
            if self.sync.up and self.control.watches[name].state is LearnerState.TRAINING:
                self._record_all(self.degradation.check_starved(name, now))

    def failed(
        self, name: str, incarnation: int, kind: FailureKind, now: float, detail: str
    ) -> None:
        if self.phase.ending:
            return  # the run is over: a learner stopping now is no failure
        if name in self.membership.leaving:
            self.membership.finish_leave(name, now)  # it was leaving anyway: no restart
            return
        if kind is FailureKind.CRASH and self.node_lost(name):
            kind, detail = FailureKind.NODE_LOST, f"{detail}; its node died"
        lost = self._work_lost(name, now)
        events, commands = self.control.failed(name, incarnation, kind, now, detail)
        if events:
            logger.warning("learner %s incarnation %d: %s (%s)", name, incarnation, kind, detail)
            self._record_all(events + lost)
        self._execute(commands, now)

    def node_lost(self, name: str) -> bool:
        """Ray declared the node of one of the learner's hosts dead."""
        nodes = {i.node_id for i in self.slots[name].info.values() if i.node_id}
        return bool(self._lost(nodes))

    def _work_lost(self, name: str, now: float) -> list[Event]:
        """What a restart throws away: the training since the learner's last merged
        contribution (it adopts the global fragments), counted in host 0's steps and in
        seconds of training of this incarnation."""
        info, st = self.slots[name].info.get(0), self.sync.status
        since = self.training_since.get(name)
        if info is None or since is None:
            return []
        merged_step = st.merged_steps.get(name, 0) if st is not None else 0
        steps = max(0, info.step - merged_step)
        last_merge = self.degradation.tracks[name].last_merged_s
        seconds = now - max(since, last_merge if last_merge is not None else since)
        return [WorkLost(now, name, steps, seconds)] if steps else []


def wire(
    cfg: RunConfig,
    control: Supervision,
    slots: dict[str, S],
    regions: dict[str, str],
    sync: SyncView,
    degradation: DegradationMonitor,
    phase: RunPhase,
    new_slot: Callable[[LearnerGroupConfig, int], S],
    leaves: LeaveCalls,
    record: Callable[[Event], None],
    execute: Callable[[list[Command], float], None],
    draining: Callable[[], set[str]] = draining_nodes,
    lost: Callable[[Iterable[str]], set[str]] = lost_nodes,
) -> tuple[Membership[S], Health]:
    """The supervisor's membership and health logic, wired to each other and to what they act
    on."""
    membership = Membership(
        cfg, control, slots, regions, degradation, phase, new_slot, leaves, record, draining
    )

    def record_all(events: list[Event]) -> None:
        for e in events:
            record(e)

    health = Health(
        control, slots, sync, degradation, phase, membership, record_all, execute, lost
    )
    return membership, health
