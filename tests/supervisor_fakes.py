"""Fake collaborators for the supervisor's health and membership logic: its slots, the
synchronizer watch and the shards' leave calls, recorded, with no Ray."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ray_diloco.config import LearnerGroupConfig, RunConfig, SupervisorConfig
from ray_diloco.control.degradation import DegradationMonitor
from ray_diloco.control.events import Event, LearnerState, StopReason
from ray_diloco.control.protocol import HostPing, SynchronizerStatus
from ray_diloco.control.supervision import Command, Supervision
from ray_diloco.runtime.supervisor.health import wire
from ray_diloco.runtime.supervisor.phase import RunPhase


@dataclass
class FakeSlot:
    info: dict[int, HostPing] = field(default_factory=dict)
    launched: list[int] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    released: bool = False
    running: bool = True

    def launch(self, incarnation: int) -> None:
        self.launched.append(incarnation)

    def give_placement(self, placement: Any) -> None:
        pass

    def leave(self, reason: str) -> bool:
        self.left.append(reason)
        return self.running

    def release(self) -> None:
        self.released = True


@dataclass
class FakeSync:
    status: SynchronizerStatus | None = None
    up: bool = True


@dataclass
class FakeLeaves:
    sent: list[tuple[str, str]] = field(default_factory=list)
    acks: list[tuple[str, str, int]] = field(default_factory=list)

    def send(self, name: str, reason: str) -> None:
        self.sent.append((name, reason))

    def acknowledged(self) -> list[tuple[str, str, int]]:
        acks, self.acks = self.acks, []
        return acks


class Supervised:
    """Health and membership wired as the supervisor wires them, around fakes."""

    def __init__(
        self, names: list[str], cfg: RunConfig | None = None, hosts: int = 1
    ) -> None:
        self.cfg = cfg or RunConfig()
        self.control = Supervision(SupervisorConfig(), names, 0.0, {n: hosts for n in names})
        self.slots: dict[str, FakeSlot] = {n: FakeSlot() for n in names}
        self.sync = FakeSync()
        self.leaves = FakeLeaves()
        self.draining: set[str] = set()
        self.phase = RunPhase()
        self.events: list[Event] = []
        self.commands: list[Command] = []
        self.degradation = DegradationMonitor(names, window_s=1.0)
        self.membership, self.health = wire(
            self.cfg,
            self.control,
            self.slots,
            {n: "local" for n in names},
            self.sync,
            self.degradation,
            self.phase,
            lambda lg, index: FakeSlot(),
            self.leaves,
            self.events.append,
            lambda commands, now: self.commands.extend(commands),
            draining=lambda: self.draining,
            lost=lambda nodes: set(),
        )

    def ping(
        self,
        name: str,
        state: LearnerState,
        now: float,
        step: int = 0,
        host: int = 0,
        stop: StopReason = StopReason.REQUESTED,
        detail: str = "",
        error: str | None = None,
    ) -> None:
        reply = HostPing(
            name,
            host,
            self.control.incarnation(name),
            state,
            step,
            stop,
            detail,
            error,
            node_id=f"node-{name}",
        )
        self.slots[name].info[host] = reply
        self.health.on_reply(name, host, reply, now)

    def kinds(self) -> list[str]:
        return [e.kind for e in self.events]


def learner(name: str) -> LearnerGroupConfig:
    return LearnerGroupConfig(name=name)
