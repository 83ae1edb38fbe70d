"""Layer: control (pure Python; no Ray, no JAX). Everything that goes on the event tape.

Events are frozen dataclasses with `t` (seconds since run start) and a `kind` class constant
that names them on the tape; `to_dict()` and `event_from_dict()` are an exact round trip, so a
run can be replayed and accounted for (goodput.py) from its tape alone. Decisions (`Restart`,
`GiveUp`, `NoAction`) are what policies return and the supervisor executes, in the style of
Ray Train v2: the policy decides, the controller acts. `FailureKind` lives here rather than in
policy.py because `FailureDetected` must serialize it and policy.py imports this module.
"""

from __future__ import annotations

import enum
import types
import typing
from dataclasses import dataclass, fields
from typing import Any, ClassVar, TypeVar


class LearnerState(enum.StrEnum):
    """Where a learner is in its life; the supervisor records every change."""

    STARTING = "starting"
    COMPILING = "compiling"
    TRAINING = "training"
    BLOCKED = "blocked"
    DEAD = "dead"
    RESTARTING = "restarting"
    GAVE_UP = "gave_up"
    FINISHED = "finished"
    LEFT = "left"  # left the run on purpose (a request, a drained node, retired): no failure


class StopReason(enum.StrEnum):
    """Why a learner's loop ended of its own accord, carried from where it stops to where the
    supervisor decides (`policy.restart_after_stop`); the words beside it are for people."""

    BUDGET = "budget"  # the run's token budget was reached: a normal finish
    REQUESTED = "requested"  # the driver or the supervisor asked it to stop
    LEFT = "left"  # it left the run on purpose (a request, a drained node)
    FENCED = "fenced"  # the synchronizer no longer accepts this incarnation


# A host's loop has ended in these (learner.py sets one of them last): it will not step again.
LOOP_ENDED = frozenset({LearnerState.FINISHED, LearnerState.LEFT, LearnerState.DEAD})


class FailureKind(enum.StrEnum):
    """Why a learner stopped; selects the restart budget and whether the group is rebuilt."""

    CRASH = "crash"
    PREEMPTION = "preemption"
    HANG = "hang"
    NODE_LOST = "node_lost"
    PARTITION = "partition"
    NUMERICAL = "numerical"


@dataclass(frozen=True)
class Event:
    """Base of every tape entry. Subclasses set `kind` and register with `_register`."""

    kind: ClassVar[str] = "event"
    t: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: enums as their values, dict keys as strings (JSON requires it)."""
        out: dict[str, Any] = {"kind": self.kind}
        for f in fields(self):
            out[f.name] = _encode(getattr(self, f.name))
        return out


_E = TypeVar("_E", bound=type[Event])
_REGISTRY: dict[str, type[Event]] = {}


def _register(cls: _E) -> _E:
    if cls.kind in _REGISTRY:
        raise TypeError(f"event kind {cls.kind!r} registered twice")
    _REGISTRY[cls.kind] = cls
    return cls


def _encode(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    return value


def _decode(value: Any, hint: Any) -> Any:
    """Undo `_encode` from the field's type hint (enums, int dict keys, int -> float)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return _decode(value, inner)
    if origin is dict:
        key_t, val_t = typing.get_args(hint)
        return {_decode(k, key_t): _decode(v, val_t) for k, v in value.items()}
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(value)
    if hint in (float, int):
        return hint(value)
    return value


def event_from_dict(data: dict[str, Any]) -> Event:
    """Rebuild an event from `to_dict()` output; unknown kinds or fields raise ValueError."""
    kind = data.get("kind")
    cls = _REGISTRY.get(str(kind))
    if cls is None:
        raise ValueError(f"unknown event kind {kind!r}; known: {sorted(_REGISTRY)}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    extra = set(data) - names - {"kind"}
    if extra:
        raise ValueError(f"event {kind!r}: unknown fields {sorted(extra)}")
    try:
        kwargs = {name: _decode(data[name], hints[name]) for name in names if name in data}
        return cls(**kwargs)
    except (TypeError, AttributeError, ValueError) as err:
        raise ValueError(f"event {kind!r}: {err}") from None


def event_kinds() -> dict[str, type[Event]]:
    """The kind -> class registry (a copy)."""
    return dict(_REGISTRY)


@_register
@dataclass(frozen=True)
class RunStarted(Event):
    kind: ClassVar[str] = "run_started"
    config_digest: str


@_register
@dataclass(frozen=True)
class LearnerStateChanged(Event):
    """The learner's state from `t` on, until its next change (goodput.py builds time lines)."""

    kind: ClassVar[str] = "learner_state_changed"
    learner: str
    incarnation: int
    state: LearnerState
    reason: str = ""


@_register
@dataclass(frozen=True)
class LearnerJoined(Event):
    """A learner joined the running job (`reason`: requested, scavenged, scheduled)."""

    kind: ClassVar[str] = "learner_joined"
    learner: str
    region: str
    accelerator: str
    reason: str = ""


@_register
@dataclass(frozen=True)
class LearnerLeft(Event):
    """A learner left the run for good, on purpose: not a failure. `tokens_returned`: its
    unread leased data, given back to the pool."""

    kind: ClassVar[str] = "learner_left"
    learner: str
    reason: str
    tokens_returned: int = 0


@_register
@dataclass(frozen=True)
class FaultInjected(Event):
    """A chaos fault was executed; `fault` is a config.FaultKind string."""

    kind: ClassVar[str] = "fault_injected"
    fault: str
    target: str | None
    duration_s: float = 0.0
    detail: str = ""


@_register
@dataclass(frozen=True)
class FailureDetected(Event):
    """`detection_s`: seconds from the failure (or injected fault) to this detection;
    `timeout_s`: for a silence, the (load-adapted) timeout it exceeded."""

    kind: ClassVar[str] = "failure_detected"
    learner: str
    failure: FailureKind
    detection_s: float
    detail: str = ""
    timeout_s: float | None = None


@_register
@dataclass(frozen=True)
class LearnerRestarted(Event):
    """A new incarnation is up; `recovered_in_s` counts from the failure's detection."""

    kind: ClassVar[str] = "learner_restarted"
    learner: str
    incarnation: int
    attempt: int
    recovered_in_s: float


@_register
@dataclass(frozen=True)
class LearnerRejoined(Event):
    """The moment a restarted incarnation contributes again (docs/algorithm.md section 7):
    it adopted `adopted_versions` (fragment -> version); `recovered_in_s` from detection."""

    kind: ClassVar[str] = "learner_rejoined"
    learner: str
    incarnation: int
    adopted_versions: dict[int, int]
    recovered_in_s: float


@_register
@dataclass(frozen=True)
class ContributionRejected(Event):
    """Fencing or a numerical guard refused a contribution (docs/algorithm.md section 7)."""

    kind: ClassVar[str] = "contribution_rejected"
    learner: str
    incarnation: int
    fragment: int
    reason: str


@_register
@dataclass(frozen=True)
class RoundClosed(Event):
    """Round of `fragment` closed and published `version`; uptime counts these. `grace_s`:
    the grace window the round allowed after reaching quorum; `waited_s`: how long it
    actually stayed open after quorum (less when every live learner was in). None on tapes
    written before they were recorded."""

    kind: ClassVar[str] = "round_closed"
    fragment: int
    version: int
    num_contributors: int
    tokens: int
    grace_s: float | None = None
    waited_s: float | None = None
    shard: int = 0  # the synchronizer shard that owns the fragment


@_register
@dataclass(frozen=True)
class HeldoutEvaluated(Event):
    """The synchronizer evaluated the global parameters: the run's loss curve."""

    kind: ClassVar[str] = "heldout_evaluated"
    tokens: int
    rounds: int
    loss: float


@_register
@dataclass(frozen=True)
class WorkLost(Event):
    """Training seconds a restart threw away (steps after the last accepted contribution)."""

    kind: ClassVar[str] = "work_lost"
    learner: str
    steps: int
    seconds: float


@_register
@dataclass(frozen=True)
class SynchronizerRestored(Event):
    """The synchronizer (shard `shard`) came back from a checkpoint at `from_versions`
    (fragment -> version)."""

    kind: ClassVar[str] = "synchronizer_restored"
    from_versions: dict[int, int]
    rounds_lost: int
    shard: int = 0


@_register
@dataclass(frozen=True)
class SynchronizerLost(Event):
    """The supervisor's calls to the synchronizer failed or went unanswered for
    `detection_s` seconds (it is being restarted, or it hangs)."""

    kind: ClassVar[str] = "synchronizer_lost"
    detection_s: float
    detail: str = ""
    shard: int = 0


@_register
@dataclass(frozen=True)
class LearnerDegraded(Event):
    """A live learner is not dying but not helping either: `cause` is `slow_steps` (its step
    rate fell well below its own baseline: a straggler) or `no_contributions` (it trains, yet
    nothing of it was merged for a while: a cut or slow link, fencing, a lost synchronizer)."""

    kind: ClassVar[str] = "learner_degraded"
    learner: str
    cause: str
    detail: str = ""


@_register
@dataclass(frozen=True)
class LearnerRecovered(Event):
    """The degradation `cause` of `learner` ended after `degraded_s` seconds."""

    kind: ClassVar[str] = "learner_recovered"
    learner: str
    cause: str
    degraded_s: float


@_register
@dataclass(frozen=True)
class RunFinished(Event):
    kind: ClassVar[str] = "run_finished"
    tokens: int
    reason: str


# Decisions: returned by policies and executed by the supervisor, which records what it did
# (LearnerStateChanged, LearnerRestarted); decisions themselves are not tape entries.


@dataclass(frozen=True)
class Restart:
    """Restart `learner` after `delay_s`; `rebuild_group` re-creates all of its hosts."""

    learner: str
    delay_s: float
    reason: str
    rebuild_group: bool
    attempt: int = 1


@dataclass(frozen=True)
class GiveUp:
    """Stop restarting `learner`; the run goes on without it."""

    learner: str
    reason: str


@dataclass(frozen=True)
class NoAction:
    reason: str = ""


Decision = Restart | GiveUp | NoAction
