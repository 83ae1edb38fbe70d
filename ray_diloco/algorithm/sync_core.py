"""Layer: algorithm (pure, no Ray). The synchronizer's state and work, without any transport.

Holds the global value of every fragment it owns (all of them, or a shard's share: see
`algorithm/shards.py`), the per-fragment outer optimizer state, the published versions that
learners' deltas can still be relative to (`version_history.py`), the round book and the token
ledger; the core that `owns_data` (shard 0) hands out the data pool's leases, every core keeps the
cursors the learners report. `offer` measures a contribution from its wire delta and the base it is
relative to, guards it and hands it to the round book still encoded; `poll` closes due rounds:
token-weighted RDA merge read from the encoded offers a chunk at a time (`stream_merge.py`),
Nesterov outer step, commit, and the value to publish (docs/algorithm.md sections 5 to 7). What it
keeps per parameter is in docs/synchronizer-memory.md. The in-process reference run (`simulate.py`)
and the Ray synchronizer actor both wrap this class, so they cannot drift apart.
Its recovery after a restart (no merged round lost) lives in `sync_recovery.py`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ray_diloco.algorithm import merge, outer, wire
from ray_diloco.algorithm.buffers import Buffers
from ray_diloco.algorithm.downstream import Downstream, Message, kept
from ray_diloco.algorithm.fragments import FragmentPlan
from ray_diloco.algorithm.leases import DataPool, Lease
from ray_diloco.algorithm.ledger import TokenLedger
from ray_diloco.algorithm.round_log import LoggedRound
from ray_diloco.algorithm.round_types import ContributionMeta, RoundClose, RoundPolicy, Verdict
from ray_diloco.algorithm.rounds import RoundBook
from ray_diloco.algorithm.stream_merge import Streamed, arrival_norms, stream_outer_gradient
from ray_diloco.algorithm.sync_recovery import Recoveries, Recovery, Values
from ray_diloco.algorithm.variants import Variants, scaled
from ray_diloco.algorithm.version_history import VersionHistory
from ray_diloco.config import RunConfig

# Refusals after which a learner of the current incarnation must adopt the newest version.
CATCH_UP = frozenset(
    {Verdict.STALE_VERSION, Verdict.FUTURE_VERSION, Verdict.NORM_OUTLIER, Verdict.NON_FINITE}
)


def _well_formed(delta: object, like: Values) -> bool:
    """`delta` holds one decodable encoded leaf of the right shape for every leaf of `like`
    (the fragment's value), and nothing else."""
    if not isinstance(delta, Mapping) or set(delta) != set(like):
        return False
    return all(wire.well_formed(e, like[k].shape) for k, e in delta.items())


def _owner(a: Any) -> Any:
    """The object that owns `a`'s memory: an array's base (its bytes, for a view of a
    message's payload), or `a` itself."""
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return a


@dataclass(frozen=True)
class Admission:
    """What a registered learner starts from: fragment versions, its leases of the data (the
    first one `offset` tokens in), and its cursor (tokens it trained so far)."""

    versions: dict[int, int]
    leases: list[Lease]
    offset: int
    cursor: int


@dataclass(frozen=True)
class Held:
    """A pending contribution (the round book's opaque payload), kept as it came off the wire:
    its values are `start + decode(delta)` (`start` the synchronizer's own array, shared by
    every offer on it, never a copy), with `||G - theta||^2` per leaf measured by the norm
    guard against `anchor`, the global value then; the merge reuses them while G is still
    that value, and decodes the delta a chunk at a time (`stream_merge.py`)."""

    delta: Mapping[str, wire.Encoded]
    start: Values
    sq: dict[str, float]
    anchor: Values


@dataclass(frozen=True)
class Publication:
    """A merged fragment, to send to its recipients (`messages`)."""

    fragment: int
    version: int
    close: RoundClose
    sync_time_s: float


class SynchronizerCore:
    """`fragments`: the fragments this core owns (default: all); `owns_data`: whether it hands
    out the data pool's leases (exactly one core of a run does)."""

    def __init__(
        self,
        cfg: RunConfig,
        plan: FragmentPlan,
        init_values: Mapping[str, Any],
        fragments: Sequence[int] | None = None,
        owns_data: bool = True,
    ) -> None:
        self.cfg = cfg
        self.plan = plan
        self.owned = tuple(range(plan.num_fragments) if fragments is None else sorted(fragments))
        self.owns_data = owns_data
        self.book = RoundBook(
            RoundPolicy.from_config(
                cfg.diloco,
                cfg.synchronizer,
                cfg.num_learners,
                cfg.inner.warmup_steps,
                cfg.token_budget,
            ),
            plan.num_fragments,
            sync_time_s=cfg.sync_time_s,
            roster={lg.name for lg in cfg.learners},
            owned=self.owned,
        )
        e = cfg.elastic
        self.ledger = TokenLedger(DataPool(cfg.data_parts, e.lease_tokens, e.lease_ahead))
        # The configured learners read their own part of the data; joiners have none.
        self.homes = {lg.name: i for i, lg in enumerate(cfg.learners) if i < cfg.data_parts}
        self.tx = outer.make_outer_optimizer(cfg.outer)
        self.variants = Variants.of(cfg.diloco)
        self.values: dict[int, Values] = {
            p: {k: np.array(init_values[k], np.float32) for k in plan.fragments[p]}
            for p in self.owned
        }
        self.outer_states = {p: outer.init_outer_state(self.tx, v) for p, v in self.values.items()}
        # A round's merged gradient (the new trace), new value and the Q_v it publishes (up
        # to 4 + 4 + 4 bytes a parameter), reused once unreferenced; kept unused: at most what
        # the largest fragment's round takes.
        largest = max((plan.sizes[p] for p in self.owned), default=0)
        self.buffers = Buffers(limit_bytes=12 * largest)
        self.history = VersionHistory(self.values)
        self.down = Downstream(cfg.diloco, self.owned, self.buffers)
        self.bytes_up: dict[str, int] = {}
        self.bytes_down: dict[str, int] = {}
        self.rejected: dict[str, int] = {}
        # Tokens refused per (learner, incarnation, fragment, base): an offer carries every
        # token since its base, so a second refusal on the same base repeats the first's
        # tokens and a later acceptance on it merges them (no longer lost).
        self._refused: dict[tuple[str, int, int, int], int] = {}
        self.recovery = Recoveries(plan, self.book, self.ledger, self.down)

    # -- recovery after a restart (sync_recovery.py) --------------------------------------------

    @property
    def recovering(self) -> dict[int, Recovery]:
        return self.recovery.recovering

    def start_recovery(self, logged: Iterable[LoggedRound], delivered: Mapping[int, int]) -> None:
        self.recovery.start(logged, delivered)

    def wanted(self) -> dict[int, int]:
        return self.recovery.wanted()

    def provide(self, fragment: int, version: int, values: Mapping[str, Any]) -> bool:
        return self.recovery.provide(fragment, version, values)

    def finish_recovery(self, fragment: int) -> tuple[int, int]:
        return self.recovery.finish(fragment, self.values, self.history.published)

    # -- learners -----------------------------------------------------------------------------

    def register(
        self,
        learner: str,
        incarnation: int,
        now: float,
        held: tuple[list[Lease], int, int] | None = None,
        tokens_per_step: int | None = None,
    ) -> Admission:
        """Admit `incarnation` of `learner` (fencing older ones): the versions it adopts and
        the data it reads (its leases, resumed at its cursor). `held`: (leases, offset,
        cursor) of a learner that kept training through a synchronizer restore;
        `tokens_per_step`: what one of its inner steps reads (bounds the tokens it claims)."""
        versions = self.book.register(learner, incarnation, now, tokens_per_step)
        adopted = {p: v for p, (v, _) in self.snapshot().items()}
        self.down.adopted(learner, adopted)
        self.history.adopt(learner, adopted)
        if not self.owns_data:
            cursor = self.ledger.record_cursor(learner, 0 if held is None else held[2])
            return Admission(versions, [], 0, cursor)
        if held is not None:
            self.ledger.pool.reclaim(learner, *held)
            acct = self.ledger.account(learner)
            acct.cursor = max(acct.cursor, held[2])
        leases, offset = self.ledger.join(learner, self.homes.get(learner))
        cursor = self.ledger.resume_cursor(learner)
        return Admission(versions, leases, offset, cursor)

    def leave(self, learner: str, now: float) -> list[Lease]:
        """`learner` left the run for good: out of the quorum, its unread data back to the
        pool (returned)."""
        self.book.leave(learner, now)
        self.down.left(learner)
        self.history.leave(learner)
        return self.ledger.leave(learner) if self.owns_data else []

    def snapshot(self) -> dict[int, tuple[int, Values]]:
        """The newest published version of every fragment: what a (re)joining learner adopts."""
        return self.history.snapshot()

    def report(
        self, learner: str, incarnation: int, now: float, step_time_s: float | None, cursor: int
    ) -> list[Lease] | None:
        """A progress report: the leases that keep the learner supplied, or None when the
        report comes from a fenced (or unknown) incarnation."""
        if not self.book.heartbeat(learner, incarnation, now, step_time_s):
            return None
        if not self.owns_data:
            self.ledger.record_cursor(learner, cursor)
            return []
        return self.ledger.record_progress(learner, cursor)

    def offer(
        self, meta: ContributionMeta, delta: Mapping[str, wire.Encoded], now: float
    ) -> Verdict:
        """Take a contribution: `delta` is theta minus the published value of its base version.
        A contribution whose distance to G squares past float32 (above ~1.8e19 in an element)
        is garbage, and refused as non-finite like a NaN. A broken or malicious one (a fragment
        this core does not own, wrong leaves, shapes or encoding, counters no learner can
        reach, a replay) is refused with its reason and changes neither model nor ledger."""
        self.bytes_up[meta.learner] = self.bytes_up.get(meta.learner, 0) + wire.offered_bytes(delta)
        current = self.values.get(meta.fragment)
        if current is None:  # a fragment another shard owns (routed wrongly), or no such one
            return self._reject(Verdict.MALFORMED, meta)
        if meta.fragment in self.recovering:  # its value is not back yet: offered again later
            return self._reject(Verdict.RECOVERING, meta)
        if not _well_formed(delta, current):  # checked before anything decodes it
            return self._reject(Verdict.MALFORMED, meta)
        based = self.history.base(meta.fragment, meta.base_version)
        if based is None:
            if not merge.all_finite(wire.decode_tree(delta)):  # non-finite whatever its version
                return self._reject(self.book.offer(meta, now, finite=False), meta)
            # A version no current learner can be based on is dropped: an offer on one comes
            # from a fenced incarnation (or no registered learner), refused as that.
            fenced = self.book.offer(meta, now, finite=False)
            if fenced in (Verdict.OLD_INCARNATION, Verdict.UNKNOWN_LEARNER):
                return self._reject(fenced, meta)
            # Older than the history we keep (or from before a synchronizer restart): it cannot
            # be reconstructed, so it is fenced like any other too-stale contribution.
            stale = meta.base_version < self.history.newest(meta.fragment)[0]
            return self._reject(Verdict.STALE_VERSION if stale else Verdict.FUTURE_VERSION, meta)
        # A restore that fell back to an older value published it again under a fresh number: a
        # learner still on the old number holds the newest value, so its contribution is judged
        # from the newest number naming it, not as stale by the gap the rename left (the storm
        # chaos run: every offer refused as stale for 10 s, no round closing).
        alias, base = based
        if alias != meta.base_version:
            meta = replace(meta, base_version=alias)
        # Anchored at its base, a contribution is held as G + its own update: its outer
        # gradient G - theta is then that update, and its distance to G the update's norm.
        start = self.variants.anchor.start(current, base)
        sq, own = {}, 0.0
        for k, e in delta.items():
            sq[k], leaf_own = arrival_norms(e, start[k], current[k])
            own += leaf_own
        finite = math.isfinite(sum(sq.values()))
        norm = math.sqrt(own) if finite else None  # the learner's own update (the guard's)
        held = Held(delta, start, sq, current)
        verdict = self.book.offer(meta, now, finite=finite, update_norm=norm, payload=held)
        if verdict is not Verdict.ACCEPTED:
            return self._reject(verdict, meta)
        self.history.accepted(meta.fragment, meta.learner, meta.base_version)
        self._refused.pop(_work(meta), None)
        return verdict

    def _reject(self, verdict: Verdict, meta: ContributionMeta) -> Verdict:
        self.rejected[verdict.value] = self.rejected.get(verdict.value, 0) + 1
        # Tokens refused: the work lost. An implausible claim's counters are not believed; a
        # replay repeats an offer whose tokens were taken when it first arrived. An offer's
        # counters run from its base, so they include what an earlier offer on that base put
        # into a round: only the rest is lost.
        if verdict not in (Verdict.IMPLAUSIBLE, Verdict.REPLAYED):
            key, lost = _work(meta), meta.num_tokens - self.book.taken_tokens(meta)
            self._refused[key] = max(self._refused.get(key, 0), lost)
        return verdict

    @property
    def rejected_tokens(self) -> int:
        """Trained tokens refused and not merged since: the work lost."""
        return sum(self._refused.values())

    # -- rounds -------------------------------------------------------------------------------

    def poll(self, now: float, sync_time_s: float | None = None) -> list[Publication]:
        """Close, merge and commit every due round. `sync_time_s` fixes the merge time on a
        virtual clock; on a real clock leave it None and the merge is timed."""
        pubs = [self.merge(close, sync_time_s) for close in self.close_due(now)]
        for pub in pubs:
            self.commit(pub, now)
        return pubs

    def close_due(self, now: float, limit: int | None = None) -> list[RoundClose]:
        return self.book.poll(now, limit)

    def close_final(self, now: float) -> list[RoundClose]:
        """The final rounds: every fragment's held work, whatever its quorum (`RoundBook.
        close_all`), merged like any other round."""
        return self.book.close_all(now)

    def merge(self, close: RoundClose, sync_time_s: float | None = None) -> Publication:
        """Token-weighted merge and outer step of one closed round. Touches only fragment
        `close.fragment`, whose round book entry is marked merging, so callers may run it
        outside the lock that guards offers and reports."""
        t0 = time.perf_counter()
        p = close.fragment
        d = self.cfg.diloco
        rule = self.variants
        g = self.values[p]
        held: list[Held] = [c.payload for c in close.contributions]
        weights = self._weights(close)
        contributions = [
            (Streamed(h.delta, h.start, rule.anchor.moved_from(h.anchor, g)), weight)
            for h, weight in zip(held, weights, strict=True)
        ]
        # The guard's norms hold while G is the value they were measured against.
        sq = [h.sq for h in held] if all(h.anchor is g for h in held) else None
        parts = stream_outer_gradient(
            g, contributions, self.plan.embedding, d.merge, sq, buffers=self.buffers
        )
        grad = {k: a for k, (a, _) in parts.items()}
        merged = len({c.meta.learner for c in close.contributions})
        grad_factor, fraction = rule.round_step(merged, close.learners)
        accelerated = rule.accelerate(
            weights, [c.num_steps for c in close.contributions], d.sync_every
        )
        values, self.outer_states[p] = outer.outer_step(
            self.tx,
            g,
            self.outer_states[p],
            grad,
            scaled({k: s for k, (_, s) in parts.items()}, grad_factor),
            fraction,
            accelerated,
            outer.warmup_lr_scale(self.tx, close.version),
            reuse_grad=True,  # the merge's own arrays, not read after
            buffers=self.buffers,
        )
        # What every learner holding the new version holds (downstream.py): contributions
        # based on it are rebuilt from exactly that.
        previous = self.history.published[p].get(close.version - 1)
        q, _ = self.down.publish(p, close.version, values, previous)
        self.history.add(p, close.version, q, d.max_staleness_versions)
        self.values[p] = values  # a whole new dict: a concurrent reader sees old or new
        elapsed = time.perf_counter() - t0 if sync_time_s is None else sync_time_s
        return Publication(p, close.version, close, elapsed)

    def _weights(self, close: RoundClose) -> list[float]:
        d = self.cfg.diloco
        return [
            merge.token_weight(c.num_tokens, c.num_steps, s, d.staleness_penalty)
            for c, s in zip(close.contributions, close.staleness, strict=True)
        ]

    def commit(self, pub: Publication, now: float) -> list[ContributionMeta]:
        """Account the merged round. Returns the contributions dropped as late (`late_policy:
        drop`), counted as refused: refusals to record."""
        self.ledger.record_merge(pub.close)
        # Under the lock that guards offers, which read the history.
        self.history.drop_unreachable(pub.fragment)
        late = [e.meta for e in self.book.commit(pub.close, pub.sync_time_s, now)]
        for meta in late:
            self._reject(Verdict.LATE, meta)
        return late

    def recipients(self, pub: Publication, learners: Iterable[str]) -> list[str]:
        """Which of `learners` (the live ones) get `pub` (`diloco.publish_to`)."""
        return self.variants.recipients({c.meta.learner for c in pub.close.contributions}, learners)

    def messages(
        self, pub: Publication, learners: Iterable[str]
    ) -> list[tuple[list[str], list[Message]]]:
        """What each of `learners` (the recipients) is sent of `pub`, grouped by message:
        the new value, or the differences since the version it holds (`diloco.
        publish_delta`). Counts the bytes each is sent."""
        q = self.history.published[pub.fragment][pub.version]
        groups = self.down.messages(pub.fragment, pub.version, q, learners)
        for names, msgs in groups:
            for n in names:
                self.sent(n, sum(m.nbytes for m in msgs))
        return groups

    def catch_up(self, meta: ContributionMeta, verdict: Verdict) -> Message | None:
        """The newest version of the fragment, in full, to send the learner whose
        contribution was just refused for being behind, or broken, when publications only go
        to contributors: it would otherwise never hear of a newer version. With `publish_to:
        all` only when its base is gone from the history (a restore that fell back to the
        checkpoint renamed it: were every learner in that state, no round would close and no
        publication would ever come), or when publications go down as differences (a learner
        that missed one cannot resolve the next). None otherwise."""
        if verdict not in CATCH_UP:
            return None
        d = self.cfg.diloco
        held = self.history.holds(meta.fragment, meta.base_version)
        if d.publish_to == "all" and d.publish_delta == "none" and held:
            return None
        version, value = self.history.newest(meta.fragment)
        return self.down.catch_up(meta.fragment, version, value, meta.learner)

    def merged_shares(self) -> dict[str, float]:
        """Per learner: the share of the tokens it trained whose work reached the global value
        of this core's fragments (merged, not pending, refused or discarded)."""
        return {n: self.ledger.merged_share(n, self.owned) for n in self.ledger.accounts}

    def sent(self, learner: str, nbytes: int) -> None:
        self.bytes_down[learner] = self.bytes_down.get(learner, 0) + nbytes

    def global_params(self) -> Values:
        """The current global parameters (all fragments), e.g. for held-out evaluation."""
        out: Values = {}
        for v in self.values.values():
            out.update(v)
        return out

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of every piece of state this core keeps between rounds, by piece (each array
        counted once, whoever shares it; docs/synchronizer-memory.md): `global` values and
        outer `momentum` (float32), the published `versions` that can still be a base (in the
        full dtype; version 0 is the float32 initialisation), the `differences` kept to send
        down, and `held` offers, as encoded, waiting for their round."""
        seen: set[int] = set()

        def size(arrays: Iterable[Any]) -> int:
            total = 0
            for a in arrays:
                owner = _owner(a)
                if id(owner) not in seen:
                    seen.add(id(owner))
                    total += owner.nbytes if isinstance(owner, np.ndarray) else len(owner)
            return total

        pending = [
            e.payload for f in self.book.fragments.values() for e in [*f.pending.values(), *f.kept]
        ]
        return {
            "global": size(a for v in self.values.values() for a in v.values()),
            "momentum": size(a for s in self.outer_states.values() for a in s["trace"].values()),
            "versions": size(
                a for h in self.history.published.values() for q in h.values() for a in q.values()
            ),
            "differences": size(
                b
                for chain in self.down.chain.values()
                for diff in chain.values()
                for e in diff.values()
                for b in (e.payload, e.scales)
            ),
            "held": size(
                b for h in pending for e in h.delta.values() for b in (e.payload, e.scales)
            ),
        }

    def spare_bytes(self) -> int:
        """Bytes of the round buffers kept unused for the next rounds (`buffers.py`): working
        memory, at most what the largest fragment's round takes (12 bytes a parameter of it),
        not state."""
        return self.buffers.nbytes_unused()

    # -- checkpointing ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "values": self.values,
            "outer_states": self.outer_states,
            "published": {p: {v: q} for p, (v, q) in self.history.snapshot().items()},
            "book": self.book.state_dict(),
            "ledger": self.ledger.state_dict(),
            "bytes_up": dict(self.bytes_up),
            "bytes_down": dict(self.bytes_down),
        }

    def load_state_dict(self, state: Mapping[str, Any], now: float) -> None:
        self.values = {
            int(p): {k: np.asarray(a, np.float32) for k, a in v.items()}
            for p, v in state["values"].items()
        }
        self.outer_states = {int(p): s for p, s in state["outer_states"].items()}
        self.history.published = {
            int(p): {
                int(v): kept(vals, self.down.full) if int(v) else vals for v, vals in h.items()
            }
            for p, h in state["published"].items()
        }
        self.book.load_state_dict(state["book"], now)
        self.ledger.load_state_dict(state["ledger"])
        self.bytes_up = dict(state["bytes_up"])
        self.bytes_down = dict(state["bytes_down"])


def _work(meta: ContributionMeta) -> tuple[str, int, int, int]:
    """The work an offer carries: its learner's steps on a fragment since a base."""
    return (meta.learner, meta.incarnation, meta.fragment, meta.base_version)
