"""Layer: control (pure Python; no Ray, no JAX). What the actors say to each other.

Every answer an actor gives another is one of these frozen dataclasses: a learner host's ping and
status, the synchronizer's registration and report replies and its status, the supervisor's
status. Decisions read their typed fields (a `StopReason`, a `LearnerState`), never words; the
text beside them (`stop_detail`, `error`) is for people and logs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ray_diloco.control.events import LearnerState, StopReason

Lease = tuple[int, int, int]  # part, start, end (algorithm/leases.Lease.as_tuple)


@dataclass(frozen=True)
class HostPing:
    """A learner host's cheap liveness answer: who it is, where it runs, how far it got."""

    learner: str
    host: int
    incarnation: int
    state: LearnerState
    step: int
    stop_reason: StopReason
    stop_detail: str = ""
    error: str | None = None
    pid: int | None = None
    node_id: str | None = None


@dataclass(frozen=True)
class HostStatus:
    """A learner host's full status (host 0 speaks for its learner)."""

    learner: str
    host: int
    incarnation: int
    state: LearnerState
    step: int
    cursor: int
    loss: float | None
    counts: dict[str, int]
    stop_reason: StopReason
    stop_detail: str = ""
    error: str | None = None
    layout: dict[str, Any] | None = None  # algorithm/sharding.LayoutReport, once built


@dataclass(frozen=True)
class Registration:
    """The synchronizer's answer to a learner that registers: what it adopts."""

    snapshot: Any  # the newest published version of every fragment it owns
    wanted: dict[int, int]  # fragments being recovered -> the newest version found so far
    data: tuple[int, int, list[Lease]]  # cursor, offset into the first lease, leases
    plan: Any  # the fragment plan, one source for every learner
    finished: bool  # the run's token budget is spent


@dataclass(frozen=True)
class ReportReply:
    """The synchronizer's answer to a progress report (the heartbeat)."""

    ok: bool  # False: this incarnation is fenced, or the shard restarted and wants it back
    stop: bool  # the token budget is spent
    leases: list[Lease] = field(default_factory=list)  # data added to its supply
    # `diloco.schedule: pull`: fragments the synchronizer pulls, to offer at the next step
    pull: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Registered:
    """The incarnation a learner registered with a shard, and the versions it adopted."""

    incarnation: int
    versions: dict[int, int]


@dataclass(frozen=True)
class LearnerProgress:
    """A learner as its progress reports show it (the synchronizer's journal)."""

    step: int
    cursor: int
    loss: float | None
    step_time_s: float | None
    reports: int
    seconds_since_report: float


@dataclass(frozen=True)
class ShardSummary:
    """One shard's line in a combined status (None in its place: it has not answered)."""

    shard: int
    rounds: int
    restored: dict[str, Any] | None
    rss_mb: float


@dataclass(frozen=True)
class SynchronizerStatus:
    """A synchronizer shard's status, or every shard's combined (`runtime/synchronizer/shards.py`).

    `events` are the journal's events after the asked sequence number in their tape form
    (`Event.to_dict`); `restored` is the restore record of a shard that started from a
    checkpoint (`runtime/synchronizer/restore.py`), None for a fresh one."""

    run: str
    shard: int
    fragments: list[int]
    rss_mb: float
    started_at: float  # a new value tells watchers the actor was restarted
    config_digest: str
    num_params: int
    tokens_per_example: int
    tokens: int  # trained, by the ledger
    rounds: int  # delivered to a learner
    versions: dict[int, int]
    live: list[str]
    mean_contributors: float
    contributions_merged: dict[str, int]
    # learner -> tokens of its work merged, summed over the status's fragments (every token
    # trains every fragment, so a learner's share divides by fragments x its cursor)
    tokens_merged: dict[str, int]
    heldout_loss: float | None
    evals: list[dict[str, float]]
    bytes_up: dict[str, int]
    bytes_down: dict[str, int]
    rejected: dict[str, int]
    ledger_violations: list[str]
    tokens_dropped: int
    recovering: list[int]
    checkpoint_writing: bool
    learners: dict[str, LearnerProgress]
    finished: bool
    merge_error: str | None
    restored: dict[str, Any] | None
    registered: dict[str, Registered]
    merged_incarnations: dict[str, int]  # learner -> incarnation of its last merged offer
    merged_steps: dict[str, int]  # learner -> step of its last merged offer
    events: list[dict[str, Any]]
    event_seq: int
    shards: list[ShardSummary | None] = field(default_factory=list)  # combined status only

    def merged_shares(self) -> dict[str, float]:
        """Per learner: the share of the tokens it trained whose work reached the global value
        of the status's fragments (its versions), the cursor by shard 0's ledger; 0 before it
        trained. On a combined status, over every answered shard."""
        out = {}
        for name, progress in self.learners.items():
            trained = progress.cursor * len(self.versions)
            out[name] = self.tokens_merged.get(name, 0) / trained if trained > 0 else 0.0
        return out

    def merged_share(self) -> float:
        """The same over every learner: tokens of work that reached the global value over the
        tokens trained."""
        if not (self.tokens and self.versions):
            return 0.0
        return sum(self.tokens_merged.values()) / (len(self.versions) * self.tokens)


@dataclass(frozen=True)
class LearnerRow:
    """A learner as the supervisor watches it."""

    state: LearnerState
    incarnation: int
    restarts: int
    crash_restarts: int = 0
    preemption_restarts: int = 0
    region: str = "local"
    step: int | None = None  # host 0's last answer
    degraded: list[str] = field(default_factory=list)  # e.g. slow, starved


@dataclass(frozen=True)
class SynchronizerView:
    """The synchronizer as the supervisor last saw it."""

    up: bool = False
    restores: int = 0
    rounds: int = 0
    tokens: int = 0


@dataclass(frozen=True)
class SupervisorStatus:
    """The supervisor's status: its learners, the synchronizer, chaos, and what the event tape
    says so far (goodput and uptime, seconds per learner state, failures, fault outcomes). The
    defaults are its status before the first tick."""

    t: float = 0.0  # run time of this status (the end, once the run is over)
    done: bool = False  # the run is over and every learner stopped
    all_gave_up: bool = False  # nobody left to train and nobody about to join
    learners: dict[str, LearnerRow] = field(default_factory=dict)
    synchronizer: SynchronizerView = field(default_factory=SynchronizerView)
    chaos_injected: int = 0
    chaos_skipped: int = 0
    goodput: float = 0.0
    uptime: float | None = None
    uptime_window_s: float = 0.0
    learner_seconds: dict[str, dict[str, float]] = field(default_factory=dict)
    num_failures: int = 0
    recovery: dict[str, dict[str, Any]] = field(default_factory=dict)  # fault kind -> figures
    faults: list[dict[str, Any]] = field(default_factory=list)  # each injected fault's outcome
    final: dict[str, HostStatus] = field(default_factory=dict)  # host 0's, once done
