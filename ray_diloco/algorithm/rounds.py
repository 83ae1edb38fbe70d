"""Layer: algorithm (pure, no Ray, no arrays). The synchronizer's round state machine.

This is where the quorum rule lives (docs/algorithm.md section 5) together with membership,
fencing and the numerical guards (section 7). Each fragment has its own sequence of rounds;
round n of fragment p produces version n+1 of G_p. The machine never touches parameters: a
contribution carries an opaque `payload` handle that comes back, untouched, in the
`RoundClose` that tells the caller what to merge. Time comes from the caller (`now` arguments),
so the in-process reference run, the Ray synchronizer and the goodput simulator all drive the
same rules on their own clocks.

A round of fragment p closes when both hold:
  1. at least K distinct learners are pending for p (K = `quorum_min`, never more than the
     learners in the run, a learner that left does not count, nor in decoupled mode than the
     live ones, whose reports are recent; synchronous mode: all of them;
     a learner whose pending work a restart set apart, `kept`, counts as pending),
  2. the grace window has expired, or every live learner is pending.
The grace window is fixed when the quorum is reached:
  grace = min(grace_max_s, grace_fraction * max(0, overlap_steps * step_time
                                                  - (quorum_wait + sync_time)))

Guards (section 7) refuse, with a reason (`Verdict`), what must never reach the global model or
the ledger: unknown learners, older incarnations, versions out of range, empty or implausible
counters, a replay of work already taken, non-finite values, and an update whose own norm per
inner step is more than `norm_guard` times the median of the learner's own recent ones
(`norm_guard` squared times everyone's for a learner without a history of its own yet;
algorithm/guards.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ray_diloco.algorithm.guards import Gate, NormHistory
from ray_diloco.algorithm.round_types import (
    ContributionMeta,
    Pending,
    RoundClose,
    RoundPolicy,
    Verdict,
)


@dataclass
class _FragmentState:
    version: int = 0
    pending: dict[str, Pending] = field(default_factory=dict)
    opened_s: float | None = None
    quorum_s: float | None = None
    grace_s: float = 0.0
    merging: bool = False
    # Entries of an incarnation that a restart replaced while they were pending: accepted work
    # (the guards passed it while that process was the registered one), merged with the round
    # like any other: dropping them lost a tenth of all trained tokens with K = 2 under
    # aggressive failures (benchmarks/goodput.py). Their learners count as in
    # (the quorum, "every live learner"), so the round does not wait for the new incarnation's
    # offer: that comes only when the fragment is next due on its schedule, and a synchronous
    # round that waited for it while the learner waited, blocked, on rounds that needed the
    # others' offers deadlocked (benchmarks/goodput.py, aggressive failures).
    kept: list[Pending] = field(default_factory=list)
    # Per-step norms of accepted updates taken after the inner warm-up (the guard's medians).
    norms: NormHistory = field(default_factory=NormHistory)
    # learner -> the inner step of its newest accepted contribution (of its incarnation).
    taken_step: dict[str, int] = field(default_factory=dict)
    # learner -> (base version, steps, tokens) of its counters already merged on that base,
    # and what they were before the round now merging (restored if the merge is aborted).
    merged: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    undo: dict[str, tuple[int, int, int] | None] = field(default_factory=dict)


def _join_next_round(frag: _FragmentState) -> list[Pending]:
    """`late_policy: next_round`: what arrived while its round merged joins the next one."""
    return []


def _drop_late(frag: _FragmentState) -> list[Pending]:
    """`late_policy: drop`: contributions that arrived while their round was merging are
    late; they leave the pending set (returned, to be counted as refused)."""
    late = [e for e in frag.pending.values() if e.meta.base_version < frag.version]
    for e in late:
        del frag.pending[e.meta.learner]
    late += [e for e in frag.kept if e.meta.base_version < frag.version]
    frag.kept = [e for e in frag.kept if e.meta.base_version >= frag.version]
    if late:
        entries = [*frag.pending.values(), *frag.kept]
        frag.opened_s = min((e.arrived_s for e in entries), default=None)
        frag.quorum_s, frag.grace_s = None, 0.0
    return late


LATE_POLICIES: dict[str, Callable[[_FragmentState], list[Pending]]] = {
    "next_round": _join_next_round,
    "drop": _drop_late,
}


@dataclass
class _Member:
    incarnation: int
    last_seen_s: float
    step_time_s: float | None = None
    active: bool = True
    tokens_per_step: int | None = None  # what one inner step reads; None: not checked


class RoundBook:
    """Pending sets, quorum and grace per fragment, plus membership and fencing."""

    def __init__(
        self,
        policy: RoundPolicy,
        num_fragments: int,
        sync_time_s: float = 0.0,
        roster: set[str] | None = None,
        owned: Iterable[int] | None = None,
    ) -> None:
        self.policy = policy
        self.gate = Gate(policy)  # fencing and the numerical guards (algorithm/guards.py)
        self._late = LATE_POLICIES[policy.late_policy]
        # The fragments whose rounds this book runs (a synchronizer shard owns some of them).
        ids = range(num_fragments) if owned is None else sorted(owned)
        self.fragments = {p: _FragmentState() for p in ids}
        self.members: dict[str, _Member] = {}
        self.sync_time_s = sync_time_s  # EMA of merge + publish time
        # The learners in the run (the configured ones, joined, not yet left): K never exceeds
        # their number. None: a fixed K, whoever registers.
        self.roster = set(roster) if roster is not None else None
        # Fragments whose value is being recovered after a restart: no round closes for them.
        self.held: set[int] = set()

    # -- membership (section 7) -------------------------------------------------------------

    def register(
        self, learner: str, incarnation: int, now: float, tokens_per_step: int | None = None
    ) -> dict[int, int]:
        """Admit `incarnation` of `learner`, fencing older ones (their later offers are refused;
        what they offered before stays in its round, `_FragmentState.kept`); `tokens_per_step`:
        what one of its inner steps reads (bounds the tokens it may claim). Returns the versions
        to adopt."""
        old = self.members.get(learner)
        if old is not None and incarnation < old.incarnation:
            raise ValueError(
                f"learner {learner!r}: incarnation {incarnation} is older than the registered "
                f"{old.incarnation}; a restarted learner must use a higher incarnation"
            )
        self.members[learner] = _Member(
            incarnation=incarnation, last_seen_s=now, tokens_per_step=tokens_per_step
        )
        if self.roster is not None:
            self.roster.add(learner)
        if old is None or incarnation != old.incarnation:
            for frag in self.fragments.values():  # a new incarnation adopts every one afresh
                frag.merged.pop(learner, None)
                frag.taken_step.pop(learner, None)
                frag.norms.forget(learner)
                # Set apart, not dropped: the new incarnation's counters start afresh, so its
                # own entry must not absorb this one (its payload does not hold that work).
                entry = frag.pending.pop(learner, None)
                if entry is not None:
                    frag.kept.append(entry)
        # (The same incarnation registering again kept training through a synchronizer
        # restart: its counters still hold the work the restored book says was merged.)
        return self.versions()

    @staticmethod
    def _in(frag: _FragmentState) -> set[str]:
        """The learners that count toward the open round's quorum: pending, or kept."""
        return frag.pending.keys() | {e.meta.learner for e in frag.kept}

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
        for frag in self.fragments.values():
            if not frag.merging and (frag.pending or frag.kept):
                self._maybe_reach_quorum(frag, now)

    def quorum(self, now: float) -> int:
        """K now: `quorum_min`, or every learner in the run in synchronous mode, never more
        than the learners in the run (and at least 1). In decoupled mode, at `now`, never more
        than the live learners either: a failed learner stays in the run until its restart
        registers, and with K = M one failure would otherwise hold every round until then
        (`heartbeat_timeout_s` after its last report it no longer counts). A synchronous
        round waits for every learner in the run: that is its barrier."""
        if self.roster is None:
            return self.policy.quorum_min
        k = len(self.roster) if self.policy.everyone else self.policy.quorum_min
        if not self.policy.everyone and k > 1:
            k = min(k, len(self.live(now)))
        return max(1, min(k, len(self.roster)))

    def live(self, now: float) -> set[str]:
        horizon = now - self.policy.heartbeat_timeout_s
        return {n for n, m in self.members.items() if m.active and m.last_seen_s >= horizon}

    def versions(self) -> dict[int, int]:
        return {p: f.version for p, f in self.fragments.items()}

    def slowest_step_time(self, now: float) -> float:
        live = self.live(now)
        times = [
            m.step_time_s
            for n, m in self.members.items()
            if n in live and m.step_time_s is not None
        ]
        return max(times, default=0.0)

    # -- contributions (sections 5 and 7) ---------------------------------------------------

    def taken_tokens(self, meta: ContributionMeta) -> int:
        """Of `meta`'s tokens (its learner's since its base), those an earlier offer of the
        same incarnation on the same base put into a merged round or the pending set: a
        refusal of `meta` loses only the rest."""
        member, frag = self.members.get(meta.learner), self.fragments.get(meta.fragment)
        if member is None or frag is None or member.incarnation != meta.incarnation:
            return 0
        done, entry = frag.merged.get(meta.learner), frag.pending.get(meta.learner)
        taken = [done[2]] if done is not None and done[0] == meta.base_version else []
        if entry is not None and entry.meta.base_version == meta.base_version:
            taken.append(entry.meta.num_tokens)
        return min(meta.num_tokens, max(taken, default=0))

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
        `update_norm`: the L2 norm of the learner's own update (its delta to its base)."""
        member = self.members.get(meta.learner)
        frag = self.fragments[meta.fragment]
        verdict = self.gate.verdict(
            meta,
            None if member is None else member.incarnation,
            None if member is None else member.tokens_per_step,
            frag.version,
            meta.fragment in self.held,
            frag.taken_step.get(meta.learner, -1),
            frag.norms,
            finite,
            update_norm,
        )
        if verdict is not Verdict.ACCEPTED:
            return verdict
        steps, tokens = meta.num_steps, meta.num_tokens
        done = frag.merged.get(meta.learner)
        if done is not None and done[0] == meta.base_version:
            # The learner offered p again before the version its last offer went into reached
            # it: its counters (since its base) still include work already merged. Count only
            # the new work, or the ledger merges those tokens twice.
            steps, tokens = steps - done[1], tokens - done[2]
            if steps <= 0 or tokens <= 0:
                return Verdict.EMPTY
        frag.taken_step[meta.learner] = meta.step
        self.gate.accepted(frag.norms, meta, update_norm)
        old = frag.pending.get(meta.learner)
        carried = (0, 0)
        if old is not None:
            # The learner's counters restart when it adopts a new version, so work in an entry
            # based on an older version is not inside the newer counters: carry all of it, or
            # it is lost. With equal bases the newer counters already include the older
            # entry's own work, but not what that entry carried from older bases.
            if old.meta.base_version < meta.base_version:
                carried = (old.num_steps, old.num_tokens)
            else:
                carried = (old.carried_steps, old.carried_tokens)
        frag.pending[meta.learner] = Pending(
            meta, steps + carried[0], tokens + carried[1], now, payload, *carried
        )
        if frag.opened_s is None:
            frag.opened_s = now
        self._maybe_reach_quorum(frag, now)
        return Verdict.ACCEPTED

    def _maybe_reach_quorum(self, frag: _FragmentState, now: float) -> None:
        if frag.quorum_s is not None or len(self._in(frag)) < self.quorum(now):
            return
        frag.quorum_s = now
        assert frag.opened_s is not None
        quorum_wait = now - frag.opened_s
        slack = self.policy.overlap_steps * self.slowest_step_time(now) - (
            quorum_wait + self.sync_time_s
        )
        frag.grace_s = min(self.policy.grace_max_s, self.policy.grace_fraction * max(0.0, slack))

    # -- closing rounds ---------------------------------------------------------------------

    def poll(self, now: float, limit: int | None = None) -> list[RoundClose]:
        """Close every round whose quorum is met and whose grace window is over (or moot);
        at most `limit` of them (the others stay due)."""
        live = self.live(now)
        closes: list[RoundClose] = []
        for p, frag in self.fragments.items():
            if limit is not None and len(closes) >= limit:
                break
            if not frag.merging and (frag.pending or frag.kept):
                self._maybe_reach_quorum(frag, now)  # a learner may have stopped reporting
            if frag.merging or frag.quorum_s is None or p in self.held:
                continue
            entered = self._in(frag)
            if live <= entered or now >= frag.quorum_s + frag.grace_s:
                closes.append(self._close(p, frag, now, len(live | entered)))
        return closes

    def close_all(self, now: float) -> list[RoundClose]:
        """The run's end: close every round that holds work, whatever its quorum and grace
        (the learners have stopped and handed in their unsent work; no offer comes after)."""
        live = self.live(now)
        closes: list[RoundClose] = []
        for p, frag in self.fragments.items():
            if frag.merging or p in self.held or not (frag.pending or frag.kept):
                continue
            if frag.quorum_s is None:
                frag.quorum_s, frag.grace_s = now, 0.0
            closes.append(self._close(p, frag, now, len(live | self._in(frag))))
        return closes

    def open_work(self) -> bool:
        """Some round holds work or is merging (what the end of a run waits for)."""
        return any(f.merging or f.pending or f.kept for f in self.fragments.values())

    def next_deadline(self) -> float | None:
        """The earliest time a grace window expires: when the caller should poll next."""
        deadlines = [
            f.quorum_s + f.grace_s
            for p, f in self.fragments.items()
            if f.quorum_s is not None and not f.merging and p not in self.held
        ]
        return min(deadlines, default=None)

    def _close(self, p: int, frag: _FragmentState, now: float, learners: int) -> RoundClose:
        entries = tuple(sorted([*frag.pending.values(), *frag.kept], key=lambda e: e.meta.learner))
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
            learners=learners,
        )
        # The counters merged on each learner's base, for its next offer (a kept entry's
        # incarnation makes no more offers).
        frag.undo = {n: frag.merged.get(n) for n in frag.pending}
        for e in frag.pending.values():
            frag.merged[e.meta.learner] = (
                e.meta.base_version,
                e.meta.num_steps,
                e.meta.num_tokens,
            )
        frag.pending, frag.kept = {}, []
        frag.opened_s = frag.quorum_s = None
        frag.grace_s = 0.0
        frag.merging = True
        return close

    def commit(self, close: RoundClose, sync_time_s: float, now: float) -> list[Pending]:
        """The caller merged and published `close`: bump the version and learn the sync time.
        Returns the contributions dropped as late (`late_policy: drop`): refusals to count."""
        frag = self.fragments[close.fragment]
        frag.version = close.version
        frag.merging = False
        frag.undo = {}
        a = self.policy.step_time_ema
        self.sync_time_s = a * sync_time_s + (1 - a) * self.sync_time_s
        late = self._late(frag)
        self._maybe_reach_quorum(frag, now)
        return late

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
            if e.meta.incarnation != self.members[e.meta.learner].incarnation:
                frag.kept.append(e)  # a restart replaced its incarnation while it merged
                continue
            newer = frag.pending.get(e.meta.learner)
            if newer is None:
                frag.pending[e.meta.learner] = e
            else:
                # On e's base, the newer entry's counters had e's subtracted (as merged); they
                # are not merged, and what e carried from older bases stays carried. On a newer
                # base its counters restarted: none of e's work is in them, all of it carried.
                same = newer.meta.base_version == e.meta.base_version
                newer.num_steps += e.num_steps
                newer.num_tokens += e.num_tokens
                newer.carried_steps += e.carried_steps if same else e.num_steps
                newer.carried_tokens += e.carried_tokens if same else e.num_tokens
        if (frag.pending or frag.kept) and frag.opened_s is None:
            frag.opened_s = close.opened_s
        self._maybe_reach_quorum(frag, now)

    def replay(self, fragment: int, version: int, merged: dict[str, tuple[int, int, int]]) -> None:
        """A round committed before a restart (from the round log): the fragment is at
        `version` and `merged` holds each contributor's (base version, steps, tokens), so a
        re-offer of work that round merged is not counted twice."""
        frag = self.fragments[fragment]
        frag.version = version
        frag.merged.update(merged)

    # -- checkpointing ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What survives a synchronizer restart: versions, norm history, learned sync time.
        Pending sets are not kept: their payloads live in memory and learners resend."""
        norms = [f.norms.state() for f in self.fragments.values()]
        return {
            "versions": [f.version for f in self.fragments.values()],
            "norms": [everyone for everyone, _ in norms],
            "own_norms": [own for _, own in norms],
            "sync_time_s": self.sync_time_s,
            "incarnations": {n: m.incarnation for n, m in self.members.items()},
            "roster": sorted(self.roster) if self.roster is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any], now: float) -> None:
        if self.roster is not None and state.get("roster") is not None:
            self.roster = set(state["roster"])
        frags = self.fragments.values()
        own_norms = state.get("own_norms") or [{} for _ in frags]  # older checkpoints: none
        for frag, v, norms, own in zip(
            frags, state["versions"], state["norms"], own_norms, strict=True
        ):
            frag.version = int(v)
            frag.norms.load(norms, own)
        self.sync_time_s = float(state["sync_time_s"])
        # Remember incarnations so a process from before the restart stays fenced; it must
        # re-register (with the same or a newer incarnation) before it counts as live again.
        for name, inc in state["incarnations"].items():
            self.members[name] = _Member(incarnation=int(inc), last_seen_s=now, active=False)
