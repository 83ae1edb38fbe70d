"""Layer: algorithm (pure, no Ray, no arrays). The synchronizer's round state machine.

This is where the quorum rule lives (algorithm.md section 5) together with membership,
fencing and the numerical guards (section 7). Each fragment has its own sequence of rounds;
round n of fragment p produces version n+1 of G_p. The machine never touches parameters: a
contribution carries an opaque `payload` handle that comes back, untouched, in the
`RoundClose` that tells the caller what to merge. Time comes from the caller (`now` arguments),
so the in-process reference run, the Ray synchronizer and the goodput simulator all drive the
same rules on their own clocks.

A round of fragment p closes when both hold:
  1. at least K distinct learners are pending for p (K = `quorum_min`, never more than the
     learners in the run: a learner that left does not count; synchronous mode: all of them),
  2. the grace window has expired, or every live learner is pending.
The grace window is fixed when the quorum is reached:
  grace = min(grace_max_s, grace_fraction * max(0, overlap_steps * step_time
                                                  - (quorum_wait + sync_time)))

Guards (section 7) refuse, with a reason (`Verdict`), what must never reach the global model or
the ledger: unknown learners and fragments, older incarnations, versions out of range, empty or
impossible counters (more tokens than its batches hold, more steps than it has taken since it
registered), a replay of a step already offered, non-finite values, and an update whose norm per
inner step is more than `norm_guard` times the median of the fragment's recent accepted ones.
"""

from __future__ import annotations

import enum
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ray_diloco.config import DilocoConfig, SynchronizerConfig

NORM_HISTORY = 32  # accepted per-step update norms kept per fragment for the running median


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
    norm_guard_min_samples: int
    heartbeat_timeout_s: float
    step_time_ema: float
    inner_warmup_steps: int = 0
    everyone: bool = False  # K is every learner in the run (synchronous mode's barrier)

    @classmethod
    def from_config(
        cls,
        diloco: DilocoConfig,
        sync: SynchronizerConfig,
        num_learners: int,
        inner_warmup_steps: int = 0,
    ) -> RoundPolicy:
        # Synchronous mode (algorithm.md section 8): K = M and no grace, i.e. a barrier.
        synchronous = diloco.mode == "synchronous"
        return cls(
            quorum_min=num_learners if synchronous else diloco.quorum_min,
            grace_fraction=0.0 if synchronous else diloco.grace_fraction,
            grace_max_s=0.0 if synchronous else diloco.grace_max_s,
            overlap_steps=diloco.overlap_steps,
            late_policy=diloco.late_policy,
            max_staleness_versions=diloco.max_staleness_versions,
            norm_guard=diloco.norm_guard,
            norm_guard_min_samples=diloco.norm_guard_min_samples,
            heartbeat_timeout_s=sync.heartbeat_timeout_s,
            step_time_ema=sync.step_time_ema,
            inner_warmup_steps=inner_warmup_steps,
            everyone=synchronous,
        )


@dataclass(frozen=True)
class ContributionMeta:
    """What a learner says about one fragment it offers (algorithm.md section 4)."""

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
    UNKNOWN_FRAGMENT = "unknown_fragment"
    OLD_INCARNATION = "old_incarnation"
    STALE_VERSION = "stale_version"
    FUTURE_VERSION = "future_version"
    LATE = "late"  # arrived while its round was merging, under `late_policy: drop`
    EMPTY = "empty"
    ABSURD_COUNTERS = "absurd_counters"
    REPLAYED = "replayed"
    NON_FINITE = "non_finite"
    NORM_OUTLIER = "norm_outlier"
    WRONG_SHAPE = "wrong_shape"
    WRONG_DTYPE = "wrong_dtype"
    MALFORMED = "malformed"


@dataclass
class Pending:
    """One learner's entry in a fragment's pending set. Counters may absorb a replaced entry."""

    meta: ContributionMeta
    num_steps: int
    num_tokens: int
    arrived_s: float
    payload: Any


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
    live: frozenset[str] = frozenset()  # the learners live when it closed

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.contributions)


@dataclass
class _FragmentState:
    version: int = 0
    pending: dict[str, Pending] = field(default_factory=dict)
    opened_s: float | None = None
    quorum_s: float | None = None
    grace_s: float = 0.0
    merging: bool = False
    norms: deque[float] = field(default_factory=lambda: deque(maxlen=NORM_HISTORY))
    last_step: dict[str, int] = field(default_factory=dict)  # learner -> step of its last offer
    # learner -> (base version, steps, tokens) of its counters already merged on that base,
    # and what they were before the round now merging (restored if the merge is aborted).
    merged: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    undo: dict[str, tuple[int, int, int] | None] = field(default_factory=dict)


@dataclass
class _Member:
    incarnation: int
    last_seen_s: float
    step_time_s: float | None = None
    active: bool = True
    start_step: int = 0  # the inner step this incarnation started at
    tokens_per_step: int | None = None  # its batch; None: not checked


class RoundBook:
    """Pending sets, quorum and grace per fragment, plus membership and fencing."""

    def __init__(
        self,
        policy: RoundPolicy,
        num_fragments: int,
        sync_time_s: float = 0.0,
        roster: set[str] | None = None,
    ) -> None:
        self.policy = policy
        self.fragments = [_FragmentState() for _ in range(num_fragments)]
        self.members: dict[str, _Member] = {}
        self.sync_time_s = sync_time_s  # EMA of merge + publish time
        # The learners in the run (the configured ones, joined, not yet left): K never exceeds
        # their number. None: a fixed K, whoever registers.
        self.roster = set(roster) if roster is not None else None

    # -- membership (section 7) -------------------------------------------------------------

    def register(
        self,
        learner: str,
        incarnation: int,
        now: float,
        *,
        start_step: int = 0,
        tokens_per_step: int | None = None,
    ) -> tuple[dict[int, int], list[Pending]]:
        """Admit `incarnation` of `learner` (starting at inner step `start_step`), fencing
        older ones. Returns the versions to adopt and the learner's pending entries that were
        dropped: it adopts every fragment afresh and its counters restart, so an entry from
        before cannot be combined with its next offers (its work is lost, like any fenced
        contribution's; the caller counts it as rejected)."""
        old = self.members.get(learner)
        if old is not None and incarnation < old.incarnation:
            raise ValueError(
                f"learner {learner!r}: incarnation {incarnation} is older than the registered "
                f"{old.incarnation}; a restarted learner must use a higher incarnation"
            )
        self.members[learner] = _Member(
            incarnation=incarnation,
            last_seen_s=now,
            start_step=start_step,
            tokens_per_step=tokens_per_step,
        )
        if self.roster is not None:
            self.roster.add(learner)
        dropped = []
        for frag in self.fragments:  # the new incarnation adopts every fragment afresh
            frag.merged.pop(learner, None)
            frag.last_step.pop(learner, None)
            entry = frag.pending.pop(learner, None)
            if entry is not None:
                dropped.append(entry)
                self._reopen(frag, now)
        return self.versions(), dropped

    def heartbeat(
        self, learner: str, incarnation: int, now: float, step_time_s: float | None
    ) -> bool:
        """Record a progress report. Returns False when the report comes from a fenced process."""
        m = self.members.get(learner)
        if m is None or m.incarnation != incarnation or not m.active:
            return False
        m.last_seen_s = now
        if step_time_s is not None and step_time_s > 0:
            a = self.policy.step_time_ema
            m.step_time_s = (
                step_time_s
                if m.step_time_s is None
                else (a * step_time_s + (1 - a) * m.step_time_s)
            )
        return True

    def leave(self, learner: str, now: float) -> None:
        """`learner` left the run for good: it is no longer live, no longer counts toward K,
        and rounds that only waited for it may now reach their quorum. Its pending
        contributions stay and are merged (a graceful leave offers its work first)."""
        if learner in self.members:
            self.members[learner].active = False
        if self.roster is not None:
            self.roster.discard(learner)
        for frag in self.fragments:
            if not frag.merging and frag.pending:
                self._maybe_reach_quorum(frag, now)

    def quorum(self) -> int:
        """K now: `quorum_min`, or every learner in the run in synchronous mode, never more
        than the learners in the run (and at least 1)."""
        if self.roster is None:
            return self.policy.quorum_min
        k = len(self.roster) if self.policy.everyone else self.policy.quorum_min
        return max(1, min(k, len(self.roster)))

    def live(self, now: float) -> set[str]:
        horizon = now - self.policy.heartbeat_timeout_s
        return {n for n, m in self.members.items() if m.active and m.last_seen_s >= horizon}

    def versions(self) -> dict[int, int]:
        return {p: f.version for p, f in enumerate(self.fragments)}

    def slowest_step_time(self, now: float) -> float:
        live = self.live(now)
        times = [
            m.step_time_s
            for n, m in self.members.items()
            if n in live and m.step_time_s is not None
        ]
        return max(times, default=0.0)

    # -- contributions (sections 5 and 7) ---------------------------------------------------

    def offer(
        self,
        meta: ContributionMeta,
        now: float,
        *,
        finite: bool = True,
        update_norm: float | None = None,
        payload: Any = None,
    ) -> Verdict:
        """Fence and guard a contribution, then add it to its fragment's pending set.
        `update_norm` is the L2 norm of the learner's own update (its delta to its base)."""
        verdict = self._check(meta, finite, update_norm)
        if verdict is not Verdict.ACCEPTED:
            return verdict
        frag = self.fragments[meta.fragment]
        frag.last_step[meta.learner] = meta.step
        steps, tokens = meta.num_steps, meta.num_tokens
        done = frag.merged.get(meta.learner)
        if done is not None and done[0] == meta.base_version:
            # The learner offered p again before the version its last offer went into reached
            # it: its counters (since its base) still include work already merged. Count only
            # the new work, or the ledger merges those tokens twice.
            steps, tokens = steps - done[1], tokens - done[2]
            if steps <= 0 or tokens <= 0:
                return Verdict.EMPTY
        if update_norm is not None and self._past_warmup(meta):
            frag.norms.append(update_norm / meta.num_steps)
        old = frag.pending.get(meta.learner)
        if old is not None and old.meta.base_version < meta.base_version:
            # The learner's counters restart when it adopts a new version, so work in an entry
            # based on an older version is not inside the newer counters: add it, or it is lost.
            # With equal bases the newer counters already include the older entry's work.
            steps += old.num_steps
            tokens += old.num_tokens
        frag.pending[meta.learner] = Pending(meta, steps, tokens, now, payload)
        if frag.opened_s is None:
            frag.opened_s = now
        self._maybe_reach_quorum(frag, now)
        return Verdict.ACCEPTED

    def fence(self, meta: ContributionMeta) -> Verdict | None:
        """Who may contribute at all: a registered learner's current incarnation, to a fragment
        that exists. None when it may."""
        m = self.members.get(meta.learner)
        if m is None:
            return Verdict.UNKNOWN_LEARNER
        if not 0 <= meta.fragment < len(self.fragments):
            return Verdict.UNKNOWN_FRAGMENT
        if meta.incarnation != m.incarnation:
            return Verdict.OLD_INCARNATION
        return None

    def _check(self, meta: ContributionMeta, finite: bool, norm: float | None) -> Verdict:
        fenced = self.fence(meta)
        if fenced is not None:
            return fenced
        m = self.members[meta.learner]
        # Non-finite before the version checks: it says the learner's state may be corrupt
        # (the supervisor restarts it), which matters however stale the contribution is.
        if not finite or (norm is not None and norm != norm):
            return Verdict.NON_FINITE
        frag = self.fragments[meta.fragment]
        if meta.base_version > frag.version:
            return Verdict.FUTURE_VERSION
        if frag.version - meta.base_version > self.policy.max_staleness_versions:
            return Verdict.STALE_VERSION
        if meta.num_steps <= 0 or meta.num_tokens <= 0:
            return Verdict.EMPTY
        if self._absurd(meta, m):
            return Verdict.ABSURD_COUNTERS
        # Steps only grow within an incarnation: an offer at a step already offered is a replay
        # (or a reordered older message), and merging it would count its tokens twice.
        if meta.step <= frag.last_step.get(meta.learner, -1):
            return Verdict.REPLAYED
        if frag.merging and self.policy.late_policy == "drop":
            return Verdict.LATE
        if norm is not None and self._outlier(frag, norm / meta.num_steps):
            return Verdict.NORM_OUTLIER
        return Verdict.ACCEPTED

    @staticmethod
    def _absurd(meta: ContributionMeta, m: _Member) -> bool:
        """Counters no honest learner can send: more steps since its base than it has taken
        in this incarnation, or more tokens than its batches hold."""
        if meta.num_steps > meta.step - m.start_step:
            return True
        return m.tokens_per_step is not None and meta.num_tokens > (
            meta.num_steps * m.tokens_per_step
        )

    def _past_warmup(self, meta: ContributionMeta) -> bool:
        """The contribution covers only steps after the inner learning-rate warm-up."""
        return meta.step - meta.num_steps >= self.policy.inner_warmup_steps

    def _outlier(self, frag: _FragmentState, per_step: float) -> bool:
        """The norm guard (algorithm.md section 7, revised): the learner's own update per inner
        step against the median of the fragment's last accepted ones. Per step, because a
        contribution covering more steps is longer by construction; the learner's own update,
        because the distance to the current global value includes other learners' drift; and
        only history from after the inner warm-up, while which updates still grow tenfold.
        Armed once `norm_guard_min_samples` such norms are known."""
        if len(frag.norms) < max(1, self.policy.norm_guard_min_samples):
            return False
        median = statistics.median(frag.norms)
        return median > 0 and per_step > self.policy.norm_guard * median

    def _maybe_reach_quorum(self, frag: _FragmentState, now: float) -> None:
        if frag.quorum_s is not None or len(frag.pending) < self.quorum():
            return
        frag.quorum_s = now
        assert frag.opened_s is not None
        quorum_wait = now - frag.opened_s
        slack = self.policy.overlap_steps * self.slowest_step_time(now) - (
            quorum_wait + self.sync_time_s
        )
        frag.grace_s = min(self.policy.grace_max_s, self.policy.grace_fraction * max(0.0, slack))

    # -- closing rounds ---------------------------------------------------------------------

    def poll(self, now: float) -> list[RoundClose]:
        """Close every round whose quorum is met and whose grace window is over (or moot)."""
        live = self.live(now)
        closes = []
        for p, frag in enumerate(self.fragments):
            if frag.merging or frag.quorum_s is None:
                continue
            everyone_in = live <= frag.pending.keys()
            if everyone_in or now >= frag.quorum_s + frag.grace_s:
                closes.append(self._close(p, frag, now, live))
        return closes

    def next_deadline(self) -> float | None:
        """The earliest time a grace window expires: when the caller should poll next."""
        deadlines = [
            f.quorum_s + f.grace_s
            for f in self.fragments
            if f.quorum_s is not None and not f.merging
        ]
        return min(deadlines, default=None)

    def _close(self, p: int, frag: _FragmentState, now: float, live: set[str]) -> RoundClose:
        entries = tuple(sorted(frag.pending.values(), key=lambda e: e.meta.learner))
        assert frag.opened_s is not None and frag.quorum_s is not None
        close = RoundClose(
            fragment=p,
            version=frag.version + 1,
            contributions=entries,
            staleness=tuple(frag.version - e.meta.base_version for e in entries),
            opened_s=frag.opened_s,
            quorum_s=frag.quorum_s,
            grace_s=frag.grace_s,
            closed_s=now,
            live=frozenset(live),
        )
        frag.undo = {e.meta.learner: frag.merged.get(e.meta.learner) for e in entries}
        for e in entries:
            frag.merged[e.meta.learner] = (
                e.meta.base_version,
                e.meta.num_steps,
                e.meta.num_tokens,
            )
        frag.pending = {}
        frag.opened_s = frag.quorum_s = None
        frag.grace_s = 0.0
        frag.merging = True
        return close

    def commit(self, close: RoundClose, sync_time_s: float, now: float) -> int:
        """The caller merged and published `close`: bump the version and learn the sync time."""
        frag = self.fragments[close.fragment]
        frag.version = close.version
        frag.merging = False
        frag.undo = {}
        a = self.policy.step_time_ema
        self.sync_time_s = a * sync_time_s + (1 - a) * self.sync_time_s
        self._maybe_reach_quorum(frag, now)
        return frag.version

    def _reopen(self, frag: _FragmentState, now: float) -> None:
        """The pending set lost an entry: the round's opening and quorum follow what is left."""
        frag.opened_s = min((e.arrived_s for e in frag.pending.values()), default=None)
        if len(frag.pending) < self.policy.quorum_min:
            frag.quorum_s, frag.grace_s = None, 0.0

    def abort(self, close: RoundClose, now: float) -> None:
        """Merging failed: put the contributions back so no work is forgotten."""
        frag = self.fragments[close.fragment]
        frag.merging = False
        for learner, before in frag.undo.items():
            if before is None:
                frag.merged.pop(learner, None)
            else:
                frag.merged[learner] = before
        frag.undo = {}
        for e in close.contributions:
            newer = frag.pending.get(e.meta.learner)
            if newer is None:
                frag.pending[e.meta.learner] = e
            elif newer.meta.base_version == e.meta.base_version:
                # The newer entry's counters had e's subtracted (as merged); they are not.
                newer.num_steps += e.num_steps
                newer.num_tokens += e.num_tokens
        if frag.pending and frag.opened_s is None:
            frag.opened_s = close.opened_s
        self._maybe_reach_quorum(frag, now)

    # -- checkpointing ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What survives a synchronizer restart: versions, norm history, learned sync time.
        Pending sets are not kept: their payloads live in memory and learners resend."""
        return {
            "versions": [f.version for f in self.fragments],
            "norms": [list(f.norms) for f in self.fragments],
            "sync_time_s": self.sync_time_s,
            "incarnations": {n: m.incarnation for n, m in self.members.items()},
            "roster": sorted(self.roster) if self.roster is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any], now: float) -> None:
        if self.roster is not None and state.get("roster") is not None:
            self.roster = set(state["roster"])
        for frag, v, norms in zip(self.fragments, state["versions"], state["norms"], strict=True):
            frag.version = int(v)
            frag.norms.extend(float(x) for x in norms)
        self.sync_time_s = float(state["sync_time_s"])
        # Remember incarnations so a process from before the restart stays fenced; it must
        # re-register (with the same or a newer incarnation) before it counts as live again.
        for name, inc in state["incarnations"].items():
            self.members[name] = _Member(incarnation=int(inc), last_seen_s=now, active=False)
