"""Layer: algorithm (pure, no Ray). The synchronizer's state and work, without any transport.

Holds the global value of every fragment, the per-fragment outer optimizer state, the newest
published version (what a joining learner adopts), the record of what each learner was sent
(downstream.py: the bases its deltas are relative to, and what quantized publications are
differences to), the round book and the token ledger. `offer` checks a contribution's structure
(fragment, leaves, shapes, wire dtype), decodes its wire delta, guards it and hands its outer
gradient to the round book; `poll` closes due rounds: token-weighted RDA merge, (partial)
Nesterov outer step, commit, and the value to publish (algorithm.md sections 5 to 7). The
in-process reference run (`simulate.py`) and the Ray synchronizer actor both wrap this class,
so they cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ray_diloco.algorithm import merge, outer, wire
from ray_diloco.algorithm.downstream import Downstream, Message, Published
from ray_diloco.algorithm.fragments import FragmentPlan
from ray_diloco.algorithm.leases import DataPool, Lease
from ray_diloco.algorithm.ledger import TokenLedger
from ray_diloco.algorithm.rounds import (
    ContributionMeta,
    RoundBook,
    RoundClose,
    RoundPolicy,
    Verdict,
)
from ray_diloco.config import RunConfig

Values = dict[str, np.ndarray]
# Refusals after which a learner of the current incarnation must adopt the newest version.
CATCH_UP = frozenset(
    {
        Verdict.STALE_VERSION,
        Verdict.FUTURE_VERSION,
        Verdict.LATE,
        Verdict.NORM_OUTLIER,
        Verdict.NON_FINITE,
    }
)
# Refusals whose counters say nothing about work lost (a stranger's, a replay's, a lie).
UNTRUSTED_COUNTERS = frozenset(
    {
        Verdict.UNKNOWN_LEARNER,
        Verdict.UNKNOWN_FRAGMENT,
        Verdict.ABSURD_COUNTERS,
        Verdict.REPLAYED,
    }
)


@dataclass(frozen=True)
class Admission:
    """What a registered learner starts from: fragment versions, its leases of the data (the
    first one `offset` tokens in), and its cursor (tokens it trained so far)."""

    versions: dict[int, int]
    leases: list[Lease]
    offset: int
    cursor: int


@dataclass(frozen=True)
class Publication:
    """A merged fragment's new version (`messages` says what each recipient gets of it)."""

    fragment: int
    published: Published
    close: RoundClose
    sync_time_s: float

    @property
    def version(self) -> int:
        return self.published.version


class SynchronizerCore:
    def __init__(self, cfg: RunConfig, plan: FragmentPlan, init_values: Mapping[str, Any]) -> None:
        self.cfg = cfg
        self.plan = plan
        self.book = RoundBook(
            RoundPolicy.from_config(
                cfg.diloco, cfg.synchronizer, cfg.num_learners, cfg.inner.warmup_steps
            ),
            plan.num_fragments,
            sync_time_s=cfg.sync_time_s,
            roster={lg.name for lg in cfg.learners},
        )
        e = cfg.elastic
        self.ledger = TokenLedger(DataPool(cfg.data_parts, e.lease_tokens, e.lease_ahead))
        # The configured learners read their own part of the data; joiners have none.
        self.homes = {lg.name: i for i, lg in enumerate(cfg.learners) if i < cfg.data_parts}
        self.values: list[Values] = [
            {k: np.array(init_values[k], np.float32) for k in frag} for frag in plan.fragments
        ]
        self.outer_states = [outer.init_outer_state(cfg.outer, v) for v in self.values]
        # Version 0 is the shared initialisation every learner starts from, exactly (float32).
        self.newest = [Published(0, v, wire.encode_tree(v, "float32"), v) for v in self.values]
        self.down = Downstream(cfg.diloco, plan.num_fragments)
        self.bytes_up: dict[str, int] = {}
        self.bytes_down: dict[str, int] = {}
        self.rejected: dict[str, int] = {}
        self.rejected_tokens = 0

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
        cursor) of a learner that kept training through a synchronizer restore.
        `tokens_per_step`: its batch, which bounds the tokens its contributions may claim and
        sizes a full round (`round_share`); None: not checked. Its contributions still pending
        from an older incarnation are dropped and counted as rejected (RoundBook.register)."""
        cursor = self.ledger.resume_cursor(learner)
        if held is not None:
            cursor = max(cursor, held[2])
        versions, dropped = self.book.register(
            learner,
            incarnation,
            now,
            start_step=cursor // tokens_per_step if tokens_per_step else 0,
            tokens_per_step=tokens_per_step,
        )
        for entry in dropped:
            self._reject(Verdict.OLD_INCARNATION, entry.meta, entry.num_tokens)
        self.down.adopted(learner, self.snapshot())
        if held is not None:
            self.ledger.pool.reclaim(learner, *held)
            acct = self.ledger.account(learner)
            acct.cursor = max(acct.cursor, held[2])
        leases, offset = self.ledger.join(learner, self.homes.get(learner))
        return Admission(versions, leases, offset, self.ledger.resume_cursor(learner))

    def leave(self, learner: str, now: float) -> list[Lease]:
        """`learner` left the run for good: out of the quorum, its unread data back to the
        pool (returned)."""
        self.book.leave(learner, now)
        return self.ledger.leave(learner)

    def snapshot(self) -> dict[int, tuple[int, Mapping[str, np.ndarray]]]:
        """The latest published version of every fragment: what a (re)joining learner adopts."""
        return {p: (pub.version, pub.decoded) for p, pub in enumerate(self.newest)}

    def report(
        self, learner: str, incarnation: int, now: float, step_time_s: float | None, cursor: int
    ) -> list[Lease] | None:
        """A progress report: the leases that keep the learner supplied, or None when the
        report comes from a fenced (or unknown) incarnation."""
        if not self.book.heartbeat(learner, incarnation, now, step_time_s):
            return None
        return self.ledger.record_progress(learner, cursor)

    def offer(
        self, meta: ContributionMeta, delta: Mapping[str, wire.Encoded], now: float
    ) -> Verdict:
        """Take a contribution: `delta` is theta minus the value of its base version, as the
        learner holds it. Anything refused is counted in `rejected` and changes nothing else."""
        bad = self._malformed(meta, delta)
        if bad is not None:
            return self._reject(bad, meta)
        self.bytes_up[meta.learner] = self.bytes_up.get(meta.learner, 0) + wire.tree_bytes(delta)
        decoded = wire.decode_tree(delta)
        finite = merge.all_finite(decoded)
        norm = merge.tree_norm(decoded) if finite else None
        if self.cfg.diloco.anchor == "base":
            # The outer gradient is the learner's own update, G_base - theta = -delta.
            payload: Values = {k: -d for k, d in decoded.items()}
        else:
            fenced = self.book.fence(meta)
            if fenced is not None:
                return self._reject(fenced, meta)
            base = self.down.base(meta.learner, meta.fragment, meta.base_version)
            if base is None and finite:
                # Older than the copies kept (or from before a synchronizer restart): it cannot
                # be reconstructed, so it is fenced like any other too-stale contribution.
                newest = self.newest[meta.fragment].version
                stale = meta.base_version < newest
                return self._reject(
                    Verdict.STALE_VERSION if stale else Verdict.FUTURE_VERSION, meta
                )
            payload = {k: base[k] + d for k, d in decoded.items()} if base is not None else {}
        verdict = self.book.offer(meta, now, finite=finite, update_norm=norm, payload=payload)
        if verdict is not Verdict.ACCEPTED:
            return self._reject(verdict, meta)
        self.down.offered(meta.learner, meta.fragment, meta.base_version)
        return verdict

    def _malformed(
        self, meta: ContributionMeta, delta: Mapping[str, wire.Encoded]
    ) -> Verdict | None:
        """What is wrong with a contribution's structure, before anything is decoded: its
        fragment index, its leaves, their shapes and their wire format."""
        if not 0 <= meta.fragment < self.plan.num_fragments:
            return Verdict.UNKNOWN_FRAGMENT
        values = self.values[meta.fragment]
        if not isinstance(delta, Mapping) or set(delta) != set(values):
            return Verdict.MALFORMED
        d = self.cfg.diloco
        for k, enc in delta.items():
            if not isinstance(enc, wire.Encoded):
                return Verdict.MALFORMED
            if tuple(enc.shape) != values[k].shape:
                return Verdict.WRONG_SHAPE
            if (enc.dtype, enc.block_size) != (
                d.wire_dtype,
                wire.block_size_of(d.wire_dtype, d.int4_block_size),
            ):
                return Verdict.WRONG_DTYPE
            if not wire.well_formed(enc):
                return Verdict.MALFORMED
        return None

    def _reject(
        self, verdict: Verdict, meta: ContributionMeta, tokens: int | None = None
    ) -> Verdict:
        self.rejected[verdict.value] = self.rejected.get(verdict.value, 0) + 1
        if verdict not in UNTRUSTED_COUNTERS:
            self.rejected_tokens += meta.num_tokens if tokens is None else tokens
        return verdict

    # -- rounds -------------------------------------------------------------------------------

    def poll(self, now: float, sync_time_s: float | None = None) -> list[Publication]:
        """Close, merge and commit every due round. `sync_time_s` fixes the merge time on a
        virtual clock; on a real clock leave it None and the merge is timed."""
        pubs = [self.merge(close, sync_time_s) for close in self.close_due(now)]
        for pub in pubs:
            self.commit(pub, now)
        return pubs

    def close_due(self, now: float) -> list[RoundClose]:
        return self.book.poll(now)

    def merge(self, close: RoundClose, sync_time_s: float | None = None) -> Publication:
        """Token-weighted merge and outer step of one closed round. Touches only fragment
        `close.fragment`, whose round book entry is marked merging, so callers may run it
        outside the lock that guards offers and reports."""
        t0 = time.perf_counter()
        p = close.fragment
        d = self.cfg.diloco
        contributions = [
            (c.payload, merge.token_weight(c.num_tokens, c.num_steps, s, d.staleness_penalty))
            for c, s in zip(close.contributions, close.staleness, strict=True)
        ]
        embedding = self.plan.embedding
        if d.anchor == "current":
            grad = merge.outer_gradient(self.values[p], contributions, embedding, d.merge)
        else:
            grad = merge.merge_outer_gradients(self.values[p], contributions, embedding, d.merge)
        share = self.round_share(close) if d.round_step == "share" else 1.0
        values, self.outer_states[p] = outer.outer_step(
            self.cfg.outer, self.values[p], self.outer_states[p], grad, share
        )
        published = self.down.publish(close.version, values)
        # Swap whole objects so a concurrent reader sees the old or the new state, never a mix.
        self.values[p], self.newest[p] = values, published
        elapsed = time.perf_counter() - t0 if sync_time_s is None else sync_time_s
        return Publication(p, published, close, elapsed)

    def round_share(self, close: RoundClose) -> float:
        """The share of a full round's work a round merged: its tokens over the tokens every
        learner live at its close trains in `sync_every` steps (1 when that is unknown)."""
        members = self.book.members
        per_step = sum(members[n].tokens_per_step or 0 for n in close.live if n in members)
        full = self.cfg.diloco.sync_every * per_step
        return min(1.0, close.num_tokens / full) if full > 0 else 1.0

    def commit(self, pub: Publication, now: float) -> None:
        self.ledger.record_merge(pub.close)
        self.book.commit(pub.close, pub.sync_time_s, now)
        self.down.prune(pub.fragment, pub.version - self.cfg.diloco.max_staleness_versions)

    def recipients(self, pub: Publication, learners: Iterable[str]) -> list[str]:
        """Which of `learners` (the live ones) get `pub` (`diloco.publish_to`)."""
        if self.cfg.diloco.publish_to == "all":
            return list(learners)
        merged = {c.meta.learner for c in pub.close.contributions}
        return [n for n in learners if n in merged]

    def messages(self, pub: Publication, learners: Iterable[str]) -> dict[str, Message]:
        """What each of `learners` receives of `pub` (full values, or the quantized difference
        to what it holds: downstream.py). The caller sends them and reports `sent`."""
        return self.down.messages(pub.fragment, pub.published, learners)

    def catch_up(self, meta: ContributionMeta, verdict: Verdict) -> Message | None:
        """The newest version of the fragment for the learner whose contribution was just
        refused for being behind, or broken, when publications only go to contributors: it
        would otherwise never hear of a newer version. None otherwise."""
        if self.cfg.diloco.publish_to == "all" or verdict not in CATCH_UP:
            return None
        p = meta.fragment
        return self.down.messages(p, self.newest[p], [meta.learner])[meta.learner]

    def sent(self, learner: str, nbytes: int) -> None:
        self.bytes_down[learner] = self.bytes_down.get(learner, 0) + nbytes

    def global_params(self) -> Values:
        """The current global parameters (all fragments), e.g. for held-out evaluation."""
        out: Values = {}
        for v in self.values:
            out.update(v)
        return out

    # -- checkpointing ------------------------------------------------------------------------

    def resume_versions(self, published: Mapping[int, int]) -> int:
        """After a restore: `published` holds the highest version of each fragment published
        before the restart (persisted at every commit). Where that is newer than what the
        checkpoint holds, the restored value gets a fresh version number above it, so versions
        never go backwards and no learner can take the restored value for a lost one that
        carried the same number (its deltas against a lost version are rejected as stale and
        it adopts this one when it registers again). Returns the rounds lost."""
        lost = 0
        for p, high in published.items():
            frag = self.book.fragments[p]
            if high <= frag.version:
                continue
            lost += high - frag.version
            frag.version = high + 1
            self.newest[p] = dataclasses.replace(self.newest[p], version=high + 1)
        return lost

    def state_dict(self) -> dict[str, Any]:
        return {
            "values": self.values,
            "outer_states": self.outer_states,
            "published": [{pub.version: pub.decoded} for pub in self.newest],
            "book": self.book.state_dict(),
            "ledger": self.ledger.state_dict(),
            "bytes_up": dict(self.bytes_up),
            "bytes_down": dict(self.bytes_down),
        }

    def load_state_dict(self, state: Mapping[str, Any], now: float) -> None:
        self.values = [
            {k: np.asarray(a, np.float32) for k, a in v.items()} for v in state["values"]
        ]
        self.outer_states = list(state["outer_states"])
        self.newest = []
        for values, newest in zip(self.values, state["published"], strict=True):
            ((version, decoded),) = newest.items()
            # float32: exactly the values learners hold, whatever dtype they came in
            full = wire.encode_tree(decoded, "float32")
            self.newest.append(Published(int(version), values, full, decoded))
        self.book.load_state_dict(state["book"], now)
        self.ledger.load_state_dict(state["ledger"])
        self.bytes_up = dict(state["bytes_up"])
        self.bytes_down = dict(state["bytes_down"])
