"""Layer: runtime (Ray shell). The supervisor's health duty: what a learner's heartbeat answers
and the synchronizer's status say about each learner, carried out by the supervisor's control
loop (`Supervisor` mixes this in; see its module doc). A reply moves the learner's state (or
reports it dead, finished, or saying goodbye while leaving); a merge of a new incarnation's
contribution is its rejoin; a failure, unless the run is over or the learner was leaving
anyway, becomes the controller's decision (a restart) with the work it throws away on the tape.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ray_diloco.control.degradation import DegradationMonitor
from ray_diloco.control.events import (
    LOOP_ENDED,
    Event,
    FailureKind,
    LearnerState,
    StopReason,
    WorkLost,
)
from ray_diloco.control.policy import restart_after_stop
from ray_diloco.control.supervision import Command, Supervision
from ray_diloco.runtime.supervisor.nodes import lost_nodes
from ray_diloco.runtime.synchronizer.watch import ShardWatch

logger = logging.getLogger(__name__)


class HealthDuty:
    # What the supervisor provides (supervisor.py, runtime/supervisor/membership.py).
    control: Supervision
    slots: dict[str, Any]
    degradation: DegradationMonitor
    sync: ShardWatch
    _finish: str | None
    _run_over: bool
    _leaving: dict[str, str]
    _training_since: dict[str, float]
    _record_all: Callable[[list[Event]], None]
    _execute: Callable[[list[Command], float], None]
    _finish_leave: Callable[[str, float], None]

    def _on_reply(self, name: str, host: int, reply: dict[str, Any], now: float) -> None:
        inc, state = int(reply["incarnation"]), str(reply["state"])
        if name in self._leaving and state in LOOP_ENDED:
            self._finish_leave(name, now)  # it said goodbye (or died saying it)
        elif state == "dead":
            error = (reply.get("error") or "").strip().splitlines()
            self._failed(name, inc, FailureKind.CRASH, now, error[-1] if error else "dead")
        elif state == "finished":
            reason, detail = StopReason(reply["stop_reason"]), str(reply.get("stop_detail", ""))
            if restart_after_stop(reason, self._run_over):
                self._failed(name, inc, FailureKind.CRASH, now, f"stopped: {detail or reason}")
            else:
                self._record_all(self.control.finished(name, now, detail or reason))
        else:
            reported = LearnerState(state) if host == 0 else None
            changes = self.control.heartbeat(name, inc, now, host, reported)
            self._record_all(changes)
            if self.control.watches[name].state is not LearnerState.TRAINING:
                self._training_since.pop(name, None)
            elif changes:
                self._training_since[name] = now
            if host == 0 and self.control.watches[name].state is LearnerState.TRAINING:
                self._record_all(self.degradation.steps(name, int(reply.get("step", 0)), now))

    def _on_sync_status(self, st: dict[str, Any], now: float) -> None:
        if st.get("finished"):
            self._run_over = True
        merged_by = st.get("merged_incarnations", {})
        registered = st.get("registered", {})
        for name in self.slots:
            inc = self.control.incarnation(name)
            if merged_by.get(name) == inc:
                reg = registered.get(name, {})
                versions = reg.get("versions", {}) if reg.get("incarnation") == inc else {}
                adopted = {int(p): int(v) for p, v in versions.items()}
                self._record_all(self.control.contributed(name, inc, now, adopted))
            merged = int(st.get("contributions_merged", {}).get(name, 0))
            self._record_all(self.degradation.merged(name, merged, now))
            if self.sync.up and self.control.watches[name].state is LearnerState.TRAINING:
                self._record_all(self.degradation.check_starved(name, now))

    def _failed(
        self, name: str, incarnation: int, kind: FailureKind, now: float, detail: str
    ) -> None:
        if self._run_over or self._finish is not None:
            return  # the run is over: a learner stopping now is no failure
        if name in self._leaving:
            self._finish_leave(name, now)  # it was leaving anyway: no restart
            return
        if kind is FailureKind.CRASH and self._node_lost(name):
            kind, detail = FailureKind.NODE_LOST, f"{detail}; its node died"
        lost = self._work_lost(name, now)
        events, commands = self.control.failed(name, incarnation, kind, now, detail)
        if events:
            logger.warning("learner %s incarnation %d: %s (%s)", name, incarnation, kind, detail)
            self._record_all(events + lost)
        self._execute(commands, now)

    def _node_lost(self, name: str) -> bool:
        """Ray declared the node of one of the learner's hosts dead."""
        nodes = {str(i["node_id"]) for i in self.slots[name].info.values() if i.get("node_id")}
        return bool(lost_nodes(nodes))

    def _work_lost(self, name: str, now: float) -> list[Event]:
        """What a restart throws away: the training since the learner's last merged
        contribution (it adopts the global fragments), counted in host 0's steps and in
        seconds of training of this incarnation."""
        st, info = self.sync.status or {}, self.slots[name].info.get(0)
        since = self._training_since.get(name)
        if not info or since is None:
            return []
        merged_step = int(st.get("merged_steps", {}).get(name, 0))
        steps = max(0, int(info.get("step", 0)) - merged_step)
        last_merge = self.degradation.tracks[name].last_merged_s
        seconds = now - max(since, last_merge if last_merge is not None else since)
        return [WorkLost(now, name, steps, seconds)] if steps else []
