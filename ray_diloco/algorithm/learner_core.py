"""Layer: algorithm (pure, no Ray). One learner's state and loop body (docs/algorithm.md section 4).

Holds the local parameters, the inner optimizer state, the data cursor, the per-fragment
counters and the base version (and its published value) of every fragment. The caller owns
time and transport: it calls `train_step`, sends what `offers` returns, and hands published
fragments to `apply` at step boundaries. The in-process reference run and the Ray learner
actor both drive this class.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import optax

from ray_diloco.algorithm import downstream, inner, wire
from ray_diloco.algorithm.downstream import Message
from ray_diloco.algorithm.fragments import FragmentPlan, due_fragments
from ray_diloco.algorithm.lease_reader import LeaseReader
from ray_diloco.algorithm.leases import ENDLESS, Lease
from ray_diloco.algorithm.pytree import TreeLayout
from ray_diloco.algorithm.round_types import ContributionMeta
from ray_diloco.algorithm.setup import learner_layout, tokens_per_step, total_inner_steps
from ray_diloco.algorithm.sharding import ShardedLayout
from ray_diloco.config import InnerOptimizerConfig, LearnerGroupConfig, RunConfig
from ray_diloco.task import Batch, Task

logger = logging.getLogger(__name__)

Snapshot = Mapping[int, tuple[int, Mapping[str, np.ndarray]]]
Offer = tuple[ContributionMeta, dict[str, wire.Encoded]]


@functools.lru_cache(maxsize=8)
def _compiled_step(
    task: Task, layout: ShardedLayout, inner_cfg: InnerOptimizerConfig, total_steps: int
) -> tuple[optax.GradientTransformation, inner.TrainStep]:
    """One jitted step per task, layout and schedule, shared by every learner in the process
    (the reference run has M of them): XLA compiles once instead of M times."""
    tx = inner.inner_optimizer(task, inner_cfg, total_steps)
    return tx, layout.jit_step(inner.train_step_fn(task, layout.tree, tx), tx)


def compile_ahead(
    cfg: RunConfig, learner: LearnerGroupConfig, task: Task, layout: ShardedLayout
) -> None:
    """Compile the inner step a `LearnerCore` of `learner` on `layout` will run, from shapes
    (its first batch's, read from part 0), before the learner has any parameter value."""
    tx, step = _compiled_step(task, layout, cfg.inner, total_inner_steps(cfg, task))
    batch, _ = next(task.data.batches(0, cfg.data_parts, 0, learner.batch_size))
    layout.compile_ahead(step, tx, batch)


@dataclass
class PendingOffer:
    """A contribution on its way off the devices: its leaves' copies to this host started at
    the step it fell due (`meta.step`), against the base it was trained on."""

    meta: ContributionMeta
    base: Mapping[str, np.ndarray]
    arrays: dict[str, jax.Array]
    _theta: dict[str, np.ndarray] | None = None

    def theta(self) -> dict[str, np.ndarray]:
        """The fragment's values at the due step, float32, on this host (waits for the
        copies if they are not done)."""
        if self._theta is None:
            self._theta = {
                k: ShardedLayout.host(a).astype(np.float32, copy=False)
                for k, a in self.arrays.items()
            }
        return self._theta


class LearnerCore:
    """`task` and `tree` (the parameters' layout) say what is trained, `plan` how it is cut into
    fragments; the learner reads its `leases` of the task's data (parts of `num_parts`,
    algorithm/leases.py), `offset` tokens into the first, having consumed `cursor` tokens
    before (its whole life: the number its progress reports carry)."""

    def __init__(
        self,
        cfg: RunConfig,
        learner: LearnerGroupConfig,
        task: Task,
        tree: TreeLayout,
        plan: FragmentPlan,
        snapshot: Snapshot,
        *,
        incarnation: int = 0,
        leases: Sequence[Lease] = (Lease(0, 0, ENDLESS),),
        offset: int = 0,
        cursor: int = 0,
        num_parts: int = 1,
        total_steps: int | None = None,
        layout: ShardedLayout | None = None,
    ) -> None:
        self.cfg = cfg
        self.task, self.tree = task, tree
        # The learner's mesh over its devices (algorithm/sharding.py); in-process runs take
        # the process's devices (setup.learner_layout).
        self.layout = layout or learner_layout(cfg, task, tree, learner)
        self.name = learner.name
        self.batch_size = learner.batch_size
        self.incarnation = incarnation
        self.plan = plan
        self.num_parts = num_parts
        self.tokens_per_step = tokens_per_step(task, learner)
        steps = total_steps or total_inner_steps(cfg, task)
        self.tx, self.step_fn = _compiled_step(task, self.layout, cfg.inner, steps)
        self.cursor = cursor
        self.reader = LeaseReader(task.data, num_parts, learner.batch_size, leases, offset)
        # A restarted learner continues its schedule where its data cursor says it was.
        self.step = cursor // self.tokens_per_step
        num_fragments = plan.num_fragments
        self.base_version = [0] * num_fragments
        self.base_values: list[dict[str, np.ndarray]] = [{} for _ in range(num_fragments)]
        self.steps_since = [0] * num_fragments  # inner steps since fragment p was received
        self.tokens_since = [0] * num_fragments
        # p -> tokens since its base that the last offer on it carried; and the tokens of
        # local work a new version overwrote before they were offered (summed over fragments).
        self.offered_tokens = [0] * num_fragments
        self.overwritten_tokens = 0
        self.params: dict[str, jax.Array] = {}
        self.inbox: dict[int, tuple[int, Mapping[str, np.ndarray]]] = {}
        # p -> the last offer since the base was received: what of the local work is unsent
        # (`diloco.keep_unsent_work`).
        self.last_offer: dict[int, PendingOffer] = {}
        self.pending: list[PendingOffer] = []  # started, not collected (`collect_offers`)
        # Differences whose base version has not arrived yet: p -> base -> message.
        self.waiting: list[dict[int, Message]] = [{} for _ in range(num_fragments)]
        self.full_dtype = downstream.full_dtype(cfg.diloco)
        # The variants (docs/decisions/020): how a new version is taken, and when.
        d = cfg.diloco
        self._take = self._carry_over if d.keep_unsent_work else self._mix_in
        self._hold_to_overlap = d.mode == "synchronous" or d.apply_at == "overlap"
        # `schedule: pull`: the fragments the synchronizer pulled, offered at the next step
        # boundary in place of those due on this learner's own count.
        self._pulled = d.schedule == "pull"
        self.requested: set[int] = set()
        self.adopt(snapshot)
        self.opt_state = self._fresh_opt_state()
        self.outstanding: dict[int, tuple[int, int]] = {}  # p -> (step offered, base version)

    def _fresh_opt_state(self) -> Any:
        """Initialised with the parameters' shardings, every step count (the schedule's and
        Adam's) where this learner stands."""
        return self.layout.init_opt_state(self.tx, self.params, self.step)

    # -- adopting global fragments ------------------------------------------------------------

    def adopt(self, snapshot: Snapshot) -> None:
        """Take the published version of every fragment (start or reintegration, section 7)."""
        for p, (version, values) in snapshot.items():
            self._overwrite(p, version, values, alpha=0.0)

    def rejoin(self, snapshot: Snapshot) -> list[int]:
        """Back with a restarted synchronizer shard (section 7). `snapshot` holds the newest
        value of each of its fragments that either side has: those newer than this learner's
        base are adopted. A fragment whose base is still the newest keeps its steps since, the
        work of the outage on top of that very value, for its next offer to carry (a restart
        then drops no trained step). Returns the fragments kept."""
        kept = [p for p, (version, _) in snapshot.items() if version == self.base_version[p]]
        self.adopt({p: entry for p, entry in snapshot.items() if p not in kept})
        return kept

    def held(
        self, arrived: Sequence[Message] = ()
    ) -> dict[int, tuple[int, Mapping[str, np.ndarray]]]:
        """The newest publication of each fragment this learner holds (applied, or received
        for the next step boundary, or among `arrived`, messages not handed to `receive`
        yet): what a restarted synchronizer recovers from. Changes nothing."""
        out: dict[int, tuple[int, Mapping[str, np.ndarray]]] = {
            p: self._newest(p) for p in range(self.plan.num_fragments)
        }
        for msg in arrived:
            version, values = out[msg.fragment]
            if msg.version > version:
                base = values if msg.base == version else None
                if (new := downstream.decode(msg, base, self.full_dtype)) is not None:
                    out[msg.fragment] = (msg.version, new)
        return out

    def _newest(self, p: int) -> tuple[int, Mapping[str, np.ndarray]]:
        held = self.inbox.get(p)
        if held is not None and held[0] > self.base_version[p]:
            return held
        return self.base_version[p], self.base_values[p]

    def receive(self, msg: Message) -> None:
        """Hold a published fragment until the next step boundary (`apply_received`). A
        difference waits for the version it is based on (messages may arrive in any order)."""
        p = msg.fragment
        if msg.base is None:
            self._hold(p, msg.version, wire.decode_tree(msg.encoded))
        else:
            self.waiting[p][msg.base] = msg
        self._resolve(p)

    def _hold(self, p: int, version: int, values: Mapping[str, np.ndarray]) -> None:
        held = self.inbox.get(p)
        if version > self.base_version[p] and (held is None or version > held[0]):
            self.inbox[p] = (version, values)

    def _resolve(self, p: int) -> None:
        """Apply the waiting differences that follow the newest version held, in order;
        forget those based on older versions (a newer full value superseded them)."""
        waiting = self.waiting[p]
        while waiting:
            version, values = self._newest(p)
            for base in [b for b in waiting if b < version]:
                del waiting[base]
            msg = waiting.pop(version, None)
            if msg is None:
                return
            self._hold(p, msg.version, downstream.resolve(values, msg.encoded, self.full_dtype))

    def apply_received(self) -> list[int]:
        """At a step boundary, mix in the held fragments that are due. Decoupled: all of them
        (`apply_at: arrival`), or those offered at least tau steps ago (`overlap`).
        Synchronous: a fragment offered at step t is applied exactly at t + tau (Streaming
        DiLoCo), which also makes the run independent of arrival timing."""
        tau = self.cfg.diloco.overlap_steps
        applied = []
        for p, (version, values) in sorted(self.inbox.items()):
            offered = self.outstanding.get(p)
            if self._hold_to_overlap and offered is not None and self.step - offered[0] < tau:
                continue
            del self.inbox[p]
            if version > self.base_version[p]:
                self._take(p, version, values)
                self.outstanding.pop(p, None)
                applied.append(p)
        return applied

    def _mix_in(self, p: int, version: int, values: Mapping[str, np.ndarray]) -> None:
        """`keep_unsent_work: false`: the new version overwrites the learner's values, keeping
        `mixing_alpha` of them (docs/algorithm.md section 4 with Streaming DiLoCo's mixing). The
        steps since its last offer on p are lost to the global model: counted."""
        self.overwritten_tokens += self.tokens_since[p] - self.offered_tokens[p]
        self._overwrite(p, version, values, alpha=self.cfg.diloco.mixing_alpha)

    def _carry_over(self, p: int, version: int, values: Mapping[str, np.ndarray]) -> None:
        """Adopt `version` of fragment p with this learner's unsent work on it carried over:
        params = G + (params - theta at the last offer since the base; the base itself when
        none), and the counters of that work only."""
        offer = self.last_offer.get(p)
        ref = offer.theta() if offer is not None else self.base_values[p]
        steps = self.steps_since[p] - (offer.meta.num_steps if offer is not None else 0)
        tokens = self.tokens_since[p] - (offer.meta.num_tokens if offer is not None else 0)
        work = {k: self.layout.difference(k, self.params[k], ref[k]) for k in ref}
        self._overwrite(p, version, values, alpha=0.0)
        for k, w in work.items():
            self.params[k] = self.layout.add(k, self.params[k], w)
        self.steps_since[p], self.tokens_since[p] = steps, tokens

    def _overwrite(
        self, p: int, version: int, values: Mapping[str, np.ndarray], alpha: float
    ) -> None:
        host = {k: np.asarray(values[k], np.float32) for k in self.plan.fragments[p]}
        for k, g in host.items():
            value = g.astype(self.tree.dtypes[k])  # the task's dtype (the wire carries float32)
            if alpha and k in self.params:
                self.params[k] = self.layout.mix(k, alpha, self.params[k], value)
            else:
                self.params[k] = self.layout.param(k, value)
        # Decision (docs/algorithm.md section 4): the inner optimizer state is kept.
        # The base is kept in the published dtype, which holds it exactly (bfloat16: half of
        # float32; version 0 is the float32 initialisation).
        exact = version == 0 or self.full_dtype == "float32"
        self.base_values[p] = host if exact else downstream.kept(host, self.full_dtype)
        self.base_version[p] = version
        self.steps_since[p] = 0
        self.tokens_since[p] = 0
        self.offered_tokens[p] = 0
        self.last_offer.pop(p, None)
        if self.waiting[p]:
            self._resolve(p)

    # -- the inner loop -----------------------------------------------------------------------

    def seek(self, cursor: int) -> None:
        """Read the whole of one endless part from token offset `cursor` on: a data-parallel
        job, which has no leases, restarting from its checkpoint."""
        self.cursor = cursor
        self.reader = LeaseReader(
            self.task.data, 1, self.batch_size, [Lease(0, cursor, ENDLESS)], 0
        )

    def next_batch(self) -> tuple[Batch, int]:
        """The next batch and its number of tokens."""
        return self.reader.next()

    def train_step(self, batch: Batch, num_tokens: int) -> float:
        return float(self.dispatch_step(batch, num_tokens))

    def dispatch_step(self, batch: Batch, num_tokens: int) -> jax.Array:
        """Start one inner step; returns its loss without waiting for it (JAX dispatches
        asynchronously), so the caller can finish the previous step's offers meanwhile."""
        self.params, self.opt_state, loss = self.step_fn(
            self.params, self.opt_state, self.layout.batch(batch)
        )
        self.step += 1
        self.cursor += num_tokens
        for p in range(self.plan.num_fragments):
            self.steps_since[p] += 1
            self.tokens_since[p] += num_tokens
        return loss

    def blocked_on(self) -> list[int]:
        """Synchronous mode: fragments offered `overlap_steps` ago whose new version has not
        arrived yet; the learner waits for them before its next step. Never in decoupled mode."""
        if self.cfg.diloco.mode != "synchronous":
            return []
        tau = self.cfg.diloco.overlap_steps
        return [p for p, (at, _) in self.outstanding.items() if self.step - at >= tau]

    def offers(self) -> list[Offer]:
        """Contributions due at the current step, ready to send: `begin_offers` and
        `collect_offers` at once (the in-process runs, whose clock is virtual)."""
        self.begin_offers()
        return self.collect_offers()

    def pull(self, fragments: Sequence[int]) -> None:
        """The synchronizer pulls `fragments` (`schedule: pull`): offered at the next step
        boundary, each from the work since its base."""
        self.requested.update(fragments)

    def begin_offers(self) -> None:
        """Start the host copies of each fragment due at the current step (its leaves only):
        due on this learner's count, or pulled (`schedule: pull`; one with no step since its
        base has nothing to offer). `collect_offers` finishes them, typically while the next
        step runs."""
        d = self.cfg.diloco
        if self._pulled:
            due = sorted(p for p in self.requested if self.steps_since[p])
            self.requested.clear()
        else:
            due = due_fragments(self.step, d.sync_every, d.num_fragments)
        for p in due:
            self._begin(p)

    def collect_offers(self) -> list[Offer]:
        """The started offers as contributions: each fragment's delta to the published value
        of its base version, in the configured wire dtype. A fragment that is not finite is
        not offered (and not waited for)."""
        d = self.cfg.diloco
        out = []
        pending, self.pending = self.pending, []
        for offer in pending:
            theta = offer.theta()
            delta = {k: theta[k] - offer.base[k] for k in offer.base}
            p = offer.meta.fragment
            if not all(np.isfinite(v).all() for v in delta.values()):
                logger.warning("learner %s: fragment %d is not finite, not offered", self.name, p)
                if self.outstanding.get(p) == (offer.meta.step, offer.meta.base_version):
                    del self.outstanding[p]
                if self.last_offer.get(p) is offer:
                    del self.last_offer[p]
                continue
            out.append((offer.meta, wire.encode_tree(delta, d.wire_dtype, d.int4_block_size)))
        return out

    def final_offers(self) -> list[Offer]:
        """Before leaving the run for good: every started offer and every fragment with work
        not offered yet, so no finished step is lost (a graceful leave)."""
        for p in range(self.plan.num_fragments):
            if self.steps_since[p] and self.outstanding.get(p, (-1, 0))[0] < self.step:
                self._begin(p)
        return self.collect_offers()

    def _begin(self, p: int) -> None:
        base = self.base_values[p]
        meta = ContributionMeta(
            learner=self.name,
            incarnation=self.incarnation,
            fragment=p,
            base_version=self.base_version[p],
            step=self.step,
            num_steps=self.steps_since[p],
            num_tokens=self.tokens_since[p],
        )
        arrays = {k: self.layout.start_copy(self.params[k]) for k in base}
        offer = PendingOffer(meta, base, arrays)
        self.pending.append(offer)
        self.outstanding[p] = (self.step, self.base_version[p])
        self.offered_tokens[p] = self.tokens_since[p]
        if self.cfg.diloco.keep_unsent_work:  # what `_carry_over` measures unsent work from
            self.last_offer[p] = offer
