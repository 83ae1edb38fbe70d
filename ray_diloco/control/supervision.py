"""Layer: control (pure Python; no Ray, no JAX). The supervisor's controller.

Observations go in (a learner answered its heartbeat, a heartbeat call failed with a classified
failure, a restarted learner contributed again), commands and tape events come out. The
supervisor actor only executes the commands: it never decides. Time is the caller's, so the
same controller runs under tests on a hand-driven clock.

Per learner: training --(a host silent past its timeout | error)--> dead: the old
incarnation is fenced (`KillLearner`), the policy decides; Restart -> restarting until the
backoff expires (`StartLearner` with incarnation + 1) -> starting -> training again when it
answers; once the synchronizer merges a contribution from the new incarnation, it has rejoined.

A learner with several hosts is heard only when every host answered since its (re)start, and
it is as fresh as its stalest host: one hung host silences the whole learner, which is then
restarted as a whole. Host 0 speaks for the learner's state (compiling, training, blocked), so
compile time is not counted as training on the tape.

Timeouts adapt to load (`control.detector.Cadence`): each host's heartbeat timeout follows the
gaps between its answers (kept across incarnations: they describe the machine, not the
process), and a starting incarnation's follows how long the run's boots took, each above its
configured floor. `overdue(now)` names the learners about to be declared hung, so the shell can
first ask Ray whether their node died (a lost node is `node_lost`, not a hang, whoever sees it
first).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from ray_diloco.config import SupervisorConfig
from ray_diloco.control.detector import Cadence
from ray_diloco.control.events import (
    Event,
    FailureDetected,
    FailureKind,
    GiveUp,
    LearnerRejoined,
    LearnerRestarted,
    LearnerState,
    LearnerStateChanged,
    Restart,
)
from ray_diloco.control.policy import RestartPolicy
from ray_diloco.control.protocol import LearnerRow

log = logging.getLogger(__name__)


def heartbeat_cadence(cfg: SupervisorConfig) -> Cadence:
    """The timeout of a heartbeat (a learner host's answers, the synchronizer's): the
    configured floor, factor and ceiling."""
    return Cadence(
        cfg.heartbeat_timeout_s, cfg.heartbeat_timeout_factor, cfg.heartbeat_timeout_max_s
    )


@dataclass(frozen=True)
class KillLearner:
    """Fence an incarnation: kill every host actor of the learner's group."""

    learner: str
    incarnation: int
    rebuild_group: bool


@dataclass(frozen=True)
class StartLearner:
    learner: str
    incarnation: int


Command = KillLearner | StartLearner


@dataclass
class _Watch:
    incarnation: int = 0
    state: LearnerState = LearnerState.STARTING
    last_seen_s: float = 0.0
    detected_s: float | None = None
    restart_at_s: float | None = None
    restarted_s: float | None = None
    attempt: int = 0
    started_s: float = 0.0  # when this incarnation was started
    host_seen: dict[int, float] = field(default_factory=dict)  # this incarnation's answers
    reported: LearnerState | None = None  # host 0's last reported state


class Supervision:
    def __init__(
        self,
        cfg: SupervisorConfig,
        learners: list[str],
        now: float,
        num_hosts: Mapping[str, int] | None = None,
    ) -> None:
        self.cfg = cfg
        self.policy = RestartPolicy(cfg)
        self.watches = {name: _Watch(last_seen_s=now, started_s=now) for name in learners}
        self.num_hosts = {name: (num_hosts or {}).get(name, 1) for name in learners}
        self.cadences: dict[tuple[str, int], Cadence] = {}  # (learner, host) -> its answers
        # Boots of every learner in the run: what one costs on this machine now. The floor
        # must cover the first boot, when nothing is known yet.
        self.boots = Cadence(
            cfg.startup_timeout_s, cfg.startup_timeout_factor, _BOOT_CEILING_S, min_gaps=1
        )

    def incarnation(self, learner: str) -> int:
        return self.watches[learner].incarnation

    # -- membership ---------------------------------------------------------------------------

    def add(self, learner: str, now: float, num_hosts: int = 1) -> list[Event]:
        """A learner joins the running job: watched from now on, starting (incarnation 0)."""
        if learner in self.watches and self.watches[learner].state is not LearnerState.LEFT:
            raise ValueError(f"learner {learner!r} is already in the run")
        self.watches[learner] = _Watch(last_seen_s=now, started_s=now)
        self.num_hosts[learner] = num_hosts
        return [LearnerStateChanged(now, learner, 0, LearnerState.STARTING, "joined")]

    def leave(self, learner: str, now: float, reason: str) -> list[Event]:
        """The learner leaves the run on purpose: never detected as failed, never restarted."""
        w = self.watches[learner]
        if w.state is LearnerState.LEFT:
            return []
        w.state, w.restart_at_s = LearnerState.LEFT, None
        return [LearnerStateChanged(now, learner, w.incarnation, LearnerState.LEFT, reason)]

    def in_run(self) -> list[str]:
        """Learners neither left nor given up on (capacity the run still counts on)."""
        gone = (LearnerState.LEFT, LearnerState.GAVE_UP, LearnerState.FINISHED)
        return [n for n, w in self.watches.items() if w.state not in gone]

    # -- observations -------------------------------------------------------------------------

    def heartbeat(
        self,
        learner: str,
        incarnation: int,
        now: float,
        host: int = 0,
        state: LearnerState | None = None,
    ) -> list[Event]:
        """Host `host` of the learner answered; host 0 may say which live state the learner
        is in (None: training once it answers). Returns the state change, if any."""
        w = self.watches[learner]
        if incarnation != w.incarnation or w.state in _DOWN:
            return []  # a fenced process answering late changes nothing
        w.host_seen[host] = now
        self._cadence(learner, host).arrived(now)
        if state is not None and LearnerState(state) in _LIVE:
            w.reported = LearnerState(state)
        if len(w.host_seen) < self.num_hosts[learner]:
            return []  # not every host of this incarnation answered yet
        w.last_seen_s = min(w.host_seen.values())
        new = w.reported or LearnerState.TRAINING
        if w.state is LearnerState.STARTING:
            self.boots.add_gap(now - w.started_s)
        if w.state is new:
            return []
        w.state = new
        return [LearnerStateChanged(now, learner, incarnation, new, "heartbeat")]

    def failed(
        self, learner: str, incarnation: int, failure: FailureKind, now: float, detail: str = ""
    ) -> tuple[list[Event], list[Command]]:
        """A heartbeat call failed (the actors layer classified the Ray error)."""
        w = self.watches[learner]
        if incarnation != w.incarnation or w.state in _DOWN:
            return [], []
        return self._detect(learner, failure, now, detail)

    def contributed(
        self, learner: str, incarnation: int, now: float, versions: dict[int, int]
    ) -> list[Event]:
        """The synchronizer merged work of this incarnation: a restarted learner has rejoined."""
        w = self.watches[learner]
        if incarnation != w.incarnation or w.restarted_s is None or w.detected_s is None:
            return []
        event = LearnerRejoined(now, learner, incarnation, versions, now - w.detected_s)
        w.restarted_s = None
        w.attempt = 0
        self.policy.record_healthy(learner)
        return [event]

    def finished(self, learner: str, now: float, reason: str = "budget") -> list[Event]:
        """The run no longer needs the learner: it is not watched or restarted any more."""
        w = self.watches[learner]
        if w.state in (LearnerState.FINISHED, LearnerState.GAVE_UP, LearnerState.LEFT):
            return []
        w.state = LearnerState.FINISHED
        w.restart_at_s = None
        return [LearnerStateChanged(now, learner, w.incarnation, LearnerState.FINISHED, reason)]

    def timeouts(self, learner: str) -> dict[int, float]:
        """Host -> the heartbeat timeout in force for it now (seconds)."""
        return {h: self._cadence(learner, h).timeout_s() for h in range(self.num_hosts[learner])}

    def startup_timeout_s(self) -> float:
        return self.boots.timeout_s()

    def snapshot(self) -> dict[str, LearnerRow]:
        """Per learner: state, incarnation and restarts so far (for status displays)."""
        out: dict[str, LearnerRow] = {}
        for name, w in self.watches.items():
            book = self.policy.book(name)
            out[name] = LearnerRow(
                state=w.state,
                incarnation=w.incarnation,
                restarts=book.crash_restarts + book.preemption_restarts,
                crash_restarts=book.crash_restarts,
                preemption_restarts=book.preemption_restarts,
            )
        return out

    # -- the clock ----------------------------------------------------------------------------

    def overdue(self, now: float) -> list[str]:
        """Live learners silent past their timeout: `tick(now)` declares them hung."""
        return [name for name, w in self.watches.items() if self._silence(name, w, now)]

    def tick(self, now: float) -> tuple[list[Event], list[Command]]:
        """Detect silent learners and start the restarts whose backoff expired."""
        events: list[Event] = []
        commands: list[Command] = []
        for name, w in self.watches.items():
            silence = self._silence(name, w, now)
            if silence is not None:
                # Silent but not dead to Ray: a hung or partitioned host (SIGSTOP, lost link).
                e, c = self._detect(name, FailureKind.HANG, now, *silence)
                events += e
                commands += c
            elif w.state is LearnerState.RESTARTING and now >= (w.restart_at_s or now):
                events += self._start(name, w, now)
                commands.append(StartLearner(name, w.incarnation))
        return events, commands

    def _silence(self, name: str, w: _Watch, now: float) -> tuple[str, float] | None:
        """Why the live learner counts as hung now and the timeout it exceeded, or None."""
        if w.state not in _LIVE:
            return None
        if w.state in (LearnerState.STARTING, LearnerState.COMPILING):
            # A host compiling its first step sends nothing until XLA returns (tens of seconds
            # on a busy machine): that is still the boot, judged by the startup timeout.
            silent, timeout = now - w.last_seen_s, self.boots.timeout_s()
            if silent > timeout:
                starting = w.state is LearnerState.STARTING
                return (
                    f"not up after {silent:.1f}s"
                    if starting
                    else f"compiling, silent for {silent:.1f}s"
                ), timeout
            return None
        for host, seen in sorted(w.host_seen.items()):
            silent, timeout = now - seen, self._cadence(name, host).timeout_s()
            if silent > timeout:
                return f"host {host} silent for {silent:.1f}s", timeout
        return None

    def _cadence(self, learner: str, host: int) -> Cadence:
        key = (learner, host)
        if key not in self.cadences:
            self.cadences[key] = heartbeat_cadence(self.cfg)
        return self.cadences[key]

    def _detect(
        self,
        learner: str,
        failure: FailureKind,
        now: float,
        detail: str,
        timeout_s: float | None = None,
    ) -> tuple[list[Event], list[Command]]:
        w = self.watches[learner]
        detection_s = now - w.last_seen_s
        w.detected_s = now
        w.host_seen, w.reported = {}, None
        decision = self.policy.decide(learner, failure, now)
        events: list[Event] = [
            FailureDetected(now, learner, failure, detection_s, detail, timeout_s),
            LearnerStateChanged(now, learner, w.incarnation, LearnerState.DEAD, failure.value),
        ]
        # A learner given up on is fenced as a whole; a restart says what it needs.
        rebuild = decision.rebuild_group if isinstance(decision, Restart) else True
        commands: list[Command] = [KillLearner(learner, w.incarnation, rebuild)]
        if isinstance(decision, GiveUp):
            w.state = LearnerState.GAVE_UP
            events.append(
                LearnerStateChanged(
                    now, learner, w.incarnation, LearnerState.GAVE_UP, decision.reason
                )
            )
            log.warning("giving up on learner %s: %s", learner, decision.reason)
            return events, commands
        assert isinstance(decision, Restart)
        w.state = LearnerState.RESTARTING
        w.restart_at_s = now + decision.delay_s
        w.attempt = decision.attempt
        events.append(
            LearnerStateChanged(
                now, learner, w.incarnation, LearnerState.RESTARTING, decision.reason
            )
        )
        return events, commands

    def _start(self, learner: str, w: _Watch, now: float) -> list[Event]:
        w.incarnation += 1
        w.state = LearnerState.STARTING
        w.restart_at_s = None
        w.restarted_s = now
        w.started_s = w.last_seen_s = now  # the new incarnation gets a full timeout to come up
        w.host_seen, w.reported = {}, None
        for host in range(self.num_hosts[learner]):
            self._cadence(learner, host).forget_last()  # no gap across the restart
        assert w.detected_s is not None
        return [
            LearnerRestarted(now, learner, w.incarnation, w.attempt, now - w.detected_s),
            LearnerStateChanged(now, learner, w.incarnation, LearnerState.STARTING, "restart"),
        ]


_BOOT_CEILING_S = 3600.0  # a boot this slow is a broken host, however busy the machine

_LIVE = frozenset(
    {LearnerState.STARTING, LearnerState.COMPILING, LearnerState.TRAINING, LearnerState.BLOCKED}
)
_DOWN = frozenset(
    {
        LearnerState.DEAD,
        LearnerState.RESTARTING,
        LearnerState.GAVE_UP,
        LearnerState.FINISHED,
        LearnerState.LEFT,
    }
)
