"""Layer: runtime (Ray shell). The named, detached synchronizer actor (one per shard).

A run's synchronizer may be split into shards (`synchronizer.num_shards`,
runtime/synchronizer/shards.py): each is one of these actors, owning some fragments; shard 0 also
hands out the data and runs the held-out evaluation, reading the other shards' fragments. The
actor is a thin Ray shell around one `SynchronizerCore` (the algorithm: rounds, quorum, grace,
merge, fencing, ledger) and the collaborators it builds and wires, mirroring
`simulate._run_diloco` with real time and real transport: offers go to `core.offer`; a
`RoundThread` (`runtime/synchronizer/rounds.py`) closes due rounds (`close_due` under the lock,
`merge` outside it, `commit` under it); a `Publisher` (`runtime/synchronizer/publish.py`) sends
each merged fragment once with `ray.put` to its recipients (`diloco.publish_to`), each send
delayed by the learner's emulated downstream link, and counts a round once a learner holds it;
an `Evaluator` (`runtime/synchronizer/evaluation.py`) is shard 0's held-out evaluation; a
`CheckpointWriter` and `ShardStore` keep and restore its state. `runtime/synchronizer/launch.py`
starts the shards. Progress reports and registration run in the `control` concurrency group and
never queue behind offers (`data` group) or merges (the round thread).

Object ownership: learners push offers by value (fragments are small; Ray inlines arguments
under 100 KiB, and a larger one lives only until this method returns). `core.offer` keeps the
delta as the wire bytes Ray unpickled into this process (`bytes`: a copy of 0.5625 bytes a
parameter for int4, never a view of the learner's object) until its round merges; the
synchronizer never keeps a reference to a learner-owned object. Everything it keeps or sends
(published fragments via `ray.put`) is owned by the synchronizer, so a learner's death can
never take a global fragment with it.

A round counts (the status's rounds, `RoundClosed`, the version mark) once a learner received its
publication (`runtime/synchronizer/deliveries.py`). State is checkpointed with Orbax
(`runtime/synchronizer/checkpoint.py`: on a thread of its own, so rounds keep closing) from
`checkpoint_every_rounds / 2` rounds on, and a round closes only while the newest written checkpoint
is fewer than `checkpoint_every_rounds` rounds behind: whenever the process dies, its checkpoint
misses at most that many. Every committed round is also in the round log. A restarted shard restores
its checkpoint and recovers the rounds since from the learners, which hold the newest publications
(`runtime/synchronizer/restore.py`, `SynchronizerCore`'s recovery): values and the ledger exactly,
the outer momentum from the checkpoint. Each shard checkpoints and restores its own fragments; a
dead shard stalls only those; versions never go back.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import psutil
import ray

from ray_diloco.algorithm.wire import offered_bytes
from ray_diloco.config import RunConfig, config_digest
from ray_diloco.control.journal import Journal
from ray_diloco.control.protocol import (
    Registered,
    Registration,
    ReportReply,
    SynchronizerStatus,
)
from ray_diloco.observe.log import setup_logging
from ray_diloco.runtime.learner.compile_cache import use_compilation_cache
from ray_diloco.runtime.metrics import Metrics
from ray_diloco.runtime.resources import LOCAL_REGION
from ray_diloco.runtime.synchronizer.checkpoint import CheckpointWriter
from ray_diloco.runtime.synchronizer.evaluation import Evaluator
from ray_diloco.runtime.synchronizer.publish import Publisher
from ray_diloco.runtime.synchronizer.restore import ShardStore
from ray_diloco.runtime.synchronizer.rounds import RoundThread, record_rejection

if TYPE_CHECKING:
    from ray_diloco.algorithm.round_types import ContributionMeta
    from ray_diloco.algorithm.wire import Encoded

logger = logging.getLogger(__name__)


@ray.remote(concurrency_groups={"control": 2, "data": 1})  # type: ignore[call-overload]
class Synchronizer:
    def __init__(self, cfg: RunConfig, shard: int = 0, log_level: str = "WARNING") -> None:
        setup_logging(log_level)
        logging.getLogger("absl").setLevel(logging.WARNING)  # Orbax logs every file at INFO
        # JAX-using modules are imported here, not at module level: the driver imports this
        # module to create the actor and must not need JAX.
        from ray_diloco.algorithm import links, sync_core, variants
        from ray_diloco.algorithm.setup import Setup
        from ray_diloco.algorithm.shards import assign_fragments

        use_compilation_cache(cfg)  # Ray reconstructs it after a crash: load, don't compile

        self.cfg, self.shard = cfg, shard
        self._lock = threading.Lock()
        self._wake, self.finished = threading.Event(), threading.Event()
        self.setup = Setup.build(cfg)
        owned = assign_fragments(self.setup.plan.sizes, cfg.synchronizer.num_shards)[shard]
        self.core = sync_core.SynchronizerCore(
            cfg, self.setup.plan, self.setup.init, owned, owns_data=shard == 0
        )
        self.setup.init = {}  # the core copied its fragments; the rest would only take memory
        # `diloco.schedule`: which of this shard's fragments a learner's report makes due
        # for every live learner (pull), and what each learner has not been told yet.
        self.schedule = variants.schedule(cfg.diloco, self.core.owned)
        self.pulls: dict[str, set[int]] = {}
        self.journal = Journal()
        self.metrics = Metrics.create(cfg.metrics.export_ray_metrics, cfg.name)
        self.started_at = time.time()  # a new value tells watchers the actor was restarted
        self.store = (
            ShardStore(cfg, shard, self.core, self._now()) if cfg.checkpoint.enabled else None
        )
        self.restored: dict[str, Any] | None = self.store.restored if self.store else None
        self.checkpoints = (
            CheckpointWriter(cfg, self.store, self._lock, self.core, self._wake.set)
            if self.store is not None
            else None
        )
        # Per learner: the incarnation and versions it registered with.
        self.registered: dict[str, Registered] = {}
        regions = {lg.name: lg.region for lg in cfg.learners}
        wan = links.LinkEmulator(cfg.links)  # downstream pipes
        self.publisher = Publisher(
            self.core, self._lock, self.journal, self.metrics, wan, self.store, regions
        )
        self.evaluator = Evaluator(
            cfg,
            self.core,
            self.setup,
            self._lock,
            self.journal,
            self.metrics,
            self.publisher.rounds,
        )
        self.rounds = RoundThread(
            cfg,
            shard,
            self.core,
            self._lock,
            self._wake,
            self.finished,
            self.publisher,
            self.evaluator,
            self.checkpoints,
            self.store,
            self.journal,
            self.metrics,
        )
        if self.store is not None:
            self.store.serving()  # (__init__ returns next: Ray delivers calls from then on)
        self.rounds.start()

    def __repr__(self) -> str:  # how the Ray dashboard and log prefixes name the actor
        shard = f", shard={self.shard}" if self.cfg.synchronizer.num_shards > 1 else ""
        return f"Synchronizer(run={self.cfg.name}{shard})"

    # -- control group: membership and progress -----------------------------------------------

    @ray.method(concurrency_group="control")
    def register(
        self,
        learner: str,
        incarnation: int,
        host_handles: list[Any],
        region: str = LOCAL_REGION,
        held: tuple[Any, ...] | None = None,
        batch_size: int | None = None,
    ) -> Registration:
        """Admit `incarnation` of `learner` (fencing older ones) and return what it adopts: the
        latest published version of every fragment, its data (cursor, offset into the first
        lease, leases), the fragment plan (one source for every learner) and `wanted`: per
        fragment being recovered, the newest version found so far (a learner holding a newer
        one hands it over with `provide`).
        `held`: what a learner that kept training through this shard's restart holds (leases,
        offset, cursor, and the newest version of each fragment). `batch_size`: its examples
        per inner step, which bound the tokens its contributions may claim."""
        from ray_diloco.algorithm.leases import Lease

        with self._lock:
            kept = None if held is None else ([Lease(*x) for x in held[0]], held[1], held[2])
            per_step = None
            if batch_size is not None:
                per_step = batch_size * self.setup.task.data.tokens_per_example
            a = self.core.register(learner, incarnation, self._now(), kept, per_step)
            self._mark_leases()
            if self.store is not None:
                versions = held[3] if held is not None and len(held) > 3 else {}
                self.store.registered(learner, versions)
            self.registered[learner] = Registered(incarnation, dict(a.versions))
            self.publisher.hosts[learner] = list(host_handles)
            self.publisher.regions[learner] = region
            snapshot = self.core.snapshot()
            wanted = self.core.wanted()
            plan = self.setup.plan
        logger.info(
            "registered learner %s incarnation %d at cursor %d", learner, incarnation, a.cursor
        )
        data = (a.cursor, a.offset, [lease.as_tuple() for lease in a.leases])
        return Registration(snapshot, wanted, data, plan, finished=self.finished.is_set())

    @ray.method(concurrency_group="control")
    def leave(self, learner: str) -> int:
        """`learner` left the run for good (a graceful leave, a drained node, retired): out of
        the quorum, its unread data back to the pool. Returns the tokens given back."""
        with self._lock:
            back = self.core.leave(learner, self._now())
            self._mark_leases()
            self.publisher.hosts.pop(learner, None)
        self._wake.set()  # rounds that only waited for it may close now
        tokens = sum(lease.size for lease in back)
        logger.info("learner %s left; %d unread tokens back to the pool", learner, tokens)
        return tokens

    def _mark_leases(self) -> None:
        """Persist the pool's frontiers and holders before leases leave this process and when
        a learner leaves (under the lock)."""
        if self.store is not None:
            pool = self.core.ledger.pool
            self.store.mark.update(frontier=pool.frontier, holders=list(pool.holders))

    @ray.method(concurrency_group="control")
    def report(
        self,
        learner: str,
        incarnation: int,
        step: int,
        step_time_s: float | None,
        cursor: int,
        loss: float | None,
        dropped: int = 0,
    ) -> ReportReply:
        """A progress report (the heartbeat). `ok` False: this incarnation is fenced (or the
        synchronizer restarted and wants it to register again). `stop`: the budget is spent.
        `leases`: data added to keep the learner supplied. `dropped`: tokens of contributions the
        learner could not send before it adopted a newer version (runtime/learner/channel.py)."""
        with self._lock:
            leases = self.core.report(learner, incarnation, self._now(), step_time_s, cursor)
            if leases is not None:
                self.core.ledger.record_dropped(learner, dropped)
            ok = leases is not None
            pull: list[int] = []
            if ok:
                self.journal.progress(learner, step, cursor, loss, step_time_s)
                due = self.schedule.reported(step)
                if due:
                    for name in self.core.book.live(self._now()) | {learner}:
                        self.pulls.setdefault(name, set()).update(due)
                pull = sorted(self.pulls.pop(learner, ()))
            if leases:
                self._mark_leases()
            tokens = self.core.ledger.tokens_trained
            if not self.finished.is_set() and tokens >= self.cfg.token_budget:
                # The run ends here, as the reference run's loop does: no round closes after.
                self.finished.set()
                logger.info("token budget reached (%d tokens)", tokens)
            granted = [lease.as_tuple() for lease in leases or []]
            return ReportReply(ok, stop=self.finished.is_set(), leases=granted, pull=pull)

    @ray.method(concurrency_group="control")
    def status(self, since_event: int = 0) -> SynchronizerStatus:
        with self._lock:
            core, now = self.core, self._now()
            rounds = self.publisher.rounds()
            merged = {n: a.contributions for n, a in core.ledger.accounts.items()}
            events, seq = self.journal.events_since(since_event)
            merged_by = self.rounds.merged_by
            return SynchronizerStatus(
                run=self.cfg.name,
                shard=self.shard,
                fragments=list(self.core.owned),
                rss_mb=psutil.Process().memory_info().rss / 2**20,
                started_at=self.started_at,
                config_digest=config_digest(self.cfg),
                num_params=self.setup.num_params(),
                tokens_per_example=self.setup.task.data.tokens_per_example,
                tokens=core.ledger.tokens_trained,
                rounds=rounds,
                versions=core.book.versions(),
                live=sorted(core.book.live(now)),
                mean_contributors=sum(merged.values()) / rounds if rounds else 0.0,
                contributions_merged=merged,
                tokens_merged={
                    n: sum(a.merged.get(p, 0) for p in core.owned)
                    for n, a in core.ledger.accounts.items()
                },
                heldout_loss=self.journal.last_loss,
                evals=list(self.journal.evals),
                bytes_up=dict(core.bytes_up),
                bytes_down=dict(core.bytes_down),
                rejected=dict(core.rejected),
                ledger_violations=core.ledger.violations(),
                tokens_dropped=core.ledger.tokens_dropped,
                recovering=sorted(core.recovering),
                checkpoint_writing=self.checkpoints is not None and self.checkpoints.writing,
                learners=self.journal.learner_table(),
                finished=self.finished.is_set(),
                merge_error=self.rounds.merge_health.error,
                restored=None if self.restored is None else dict(self.restored),
                registered=dict(self.registered),
                merged_incarnations={n: inc for n, (inc, _) in merged_by.items()},
                merged_steps={n: step for n, (_, step) in merged_by.items()},
                events=events,
                event_seq=seq,
            )

    @ray.method(concurrency_group="control")
    def final_rounds(self, timeout_s: float) -> int:
        """The run's end, once every learner stopped and handed in its unsent work: one last
        round per fragment merges all of it (`RoundThread.close_final`); returns the rounds."""
        return self.rounds.close_final(timeout_s)

    @ray.method(concurrency_group="control")
    def impair_link(self, region: str, duration_s: float, factor: float | None) -> None:
        """Chaos: cut (factor None) or slow down the region's emulated downstream link."""
        now = time.monotonic()
        self.publisher.wan.impair(region, now, now + duration_s, factor)
        logger.warning(
            "link of region %s impaired for %.1fs (factor %s)", region, duration_s, factor
        )

    @ray.method(concurrency_group="control")
    def shutdown(self) -> str | None:
        """Stop the round thread and the links, write a last checkpoint; returns its path."""
        self.rounds.stop()
        self.publisher.close()
        return self._checkpoint_now()

    # -- data group: contributions, evaluation, checkpoints -----------------------------------

    @ray.method(concurrency_group="data")
    def offer(self, meta: ContributionMeta, delta: dict[str, Encoded]) -> str:
        """Take a contribution (pushed by value, decoded here); returns the Verdict value."""
        with self._lock:
            if self.rounds.closing.is_set():
                return "run_finished"
            verdict = self.core.offer(meta, delta, self._now())
            newest = self.core.catch_up(meta, verdict)
            behind: dict[str, list[Any]] = {}
            if newest is not None:  # refused for being behind: it adopts the newest version
                behind = {n: h for n, h in self.publisher.targets().items() if n == meta.learner}
                for learner in behind:
                    self.core.sent(learner, newest.nbytes)
        if newest is not None:
            self.publisher.publish([newest], behind)
        self._wake.set()
        region = self.publisher.regions.get(meta.learner, LOCAL_REGION)
        self.metrics.link_bytes(meta.learner, region, "up", offered_bytes(delta))
        if verdict.value != "accepted":
            with self._lock:
                record_rejection(self.journal, self.metrics, meta, verdict.value)
        return verdict.value

    @ray.method(concurrency_group="data")
    def evaluate(self) -> float:
        """Held-out loss of the global parameters now (recorded in the history); shard 0
        only (it reads the other shards' fragments)."""
        loss = self.evaluator.evaluate()
        if loss is None:
            raise RuntimeError("synchronizer: another shard did not hand over its fragments")
        return loss

    @ray.method(concurrency_group="control")
    def fragment_values(self) -> tuple[dict[str, Any], int]:
        """This shard's global values and its closed rounds, for shard 0's evaluation."""
        with self._lock:
            return self.core.global_params(), self.publisher.rounds()

    @ray.method(concurrency_group="data")
    def provide(
        self, learner: str, incarnation: int, fragment: int, version: int, encoded: Any
    ) -> bool:
        """A learner hands over the value of `fragment` at `version` (the publication it
        holds), which this shard, restarted, wants back. True when taken."""
        from ray_diloco.algorithm.wire import decode_tree

        values = decode_tree(encoded)
        with self._lock:
            taken = fragment in self.core.recovering and version > self.core.wanted()[fragment]
            if self.core.provide(fragment, version, values):
                self.rounds.finish_recovery(fragment)
        logger.info(
            "learner %s incarnation %d handed over fragment %d version %d (%s)",
            learner,
            incarnation,
            fragment,
            version,
            "taken" if taken else "not needed",
        )
        self._wake.set()
        return taken

    @ray.method(concurrency_group="data")
    def checkpoint(self) -> str | None:
        """Write a checkpoint now unless the newest one already holds this state."""
        return self._checkpoint_now()

    def _checkpoint_now(self) -> str | None:
        return self.checkpoints.write() if self.checkpoints is not None else None

    @ray.method(concurrency_group="control")
    def begin_checkpoint(self) -> bool:
        """Start writing a checkpoint in the background (chaos: a kill timed to land while
        one is being written). False when one is being written already."""
        return self.checkpoints.in_background() if self.checkpoints is not None else False

    def _now(self) -> float:
        return time.monotonic()
