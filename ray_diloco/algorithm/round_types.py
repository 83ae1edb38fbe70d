"""Layer: algorithm (pure, no Ray, no arrays). What the round state machine (rounds.py) takes
and gives: its policy, a contribution's counters, the verdicts of its guards, a pending entry
and the decision to close a round."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from ray_diloco.config import DilocoConfig, SynchronizerConfig


@dataclass(frozen=True)
class RoundPolicy:
    """The knobs the state machine reads; `from_config` applies the mode's semantics."""

    quorum_min: int
    grace_fraction: float
    grace_max_s: float
    overlap_steps: int
    late_policy: str
    max_staleness_versions: int
    norm_guard: float
    norm_guard_warmup_rounds: int
    heartbeat_timeout_s: float
    step_time_ema: float
    everyone: bool = False  # K is every learner in the run (synchronous mode's barrier)
    inner_warmup_steps: int = 0  # the norm guard judges only updates taken after these
    max_tokens: int | None = None  # the run's token budget: no contribution holds more work

    @classmethod
    def from_config(
        cls,
        diloco: DilocoConfig,
        sync: SynchronizerConfig,
        num_learners: int,
        inner_warmup_steps: int = 0,
        token_budget: int | None = None,
    ) -> RoundPolicy:
        # Synchronous mode (docs/algorithm.md section 8): K = M and no grace, i.e. a barrier.
        synchronous = diloco.mode == "synchronous"
        return cls(
            quorum_min=num_learners if synchronous else diloco.quorum_min,
            grace_fraction=0.0 if synchronous else diloco.grace_fraction,
            grace_max_s=0.0 if synchronous else diloco.grace_max_s,
            overlap_steps=diloco.overlap_steps,
            late_policy=diloco.late_policy,
            max_staleness_versions=diloco.max_staleness_versions,
            norm_guard=diloco.norm_guard,
            norm_guard_warmup_rounds=diloco.norm_guard_warmup_rounds,
            heartbeat_timeout_s=sync.heartbeat_timeout_s,
            step_time_ema=sync.step_time_ema,
            everyone=synchronous,
            inner_warmup_steps=inner_warmup_steps,
            max_tokens=token_budget,
        )


@dataclass(frozen=True)
class ContributionMeta:
    """What a learner says about one fragment it offers (docs/algorithm.md section 4)."""

    learner: str
    incarnation: int
    fragment: int
    base_version: int
    step: int
    num_steps: int
    num_tokens: int


class Verdict(enum.StrEnum):
    ACCEPTED = "accepted"
    UNKNOWN_LEARNER = "unknown_learner"
    OLD_INCARNATION = "old_incarnation"
    STALE_VERSION = "stale_version"
    FUTURE_VERSION = "future_version"
    EMPTY = "empty"
    NON_FINITE = "non_finite"
    NORM_OUTLIER = "norm_outlier"
    MALFORMED = "malformed"  # wrong leaves, shapes, encoding, or a fragment it does not own
    IMPLAUSIBLE = "implausible"  # more steps or tokens than the learner can have trained
    REPLAYED = "replayed"  # no newer than work of this incarnation already taken
    LATE = "late"  # `late_policy: drop`, and it arrived while its round was merging
    RECOVERING = "recovering"  # the fragment's shard is adopting its newest value after a restart


@dataclass
class Pending:
    """One learner's entry in a fragment's pending set. Counters may absorb a replaced entry;
    `carried_*` is the part of them that came from entries on older bases (work the learner's
    own counters, restarted at its newer base, no longer include)."""

    meta: ContributionMeta
    num_steps: int
    num_tokens: int
    arrived_s: float
    payload: Any
    carried_steps: int = 0
    carried_tokens: int = 0


@dataclass(frozen=True)
class RoundClose:
    """A decision: merge these contributions into fragment `fragment`, producing `version`."""

    fragment: int
    version: int
    contributions: tuple[Pending, ...]
    staleness: tuple[int, ...]
    opened_s: float
    quorum_s: float
    grace_s: float
    closed_s: float
    # The learners in the run at the close (live or contributing): the share's denominator.
    learners: int

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.contributions)
