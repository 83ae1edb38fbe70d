"""Layer: runtime (Ray shell). A synchronizer shard's round thread.

One background thread per shard: it ends the recoveries that can end (a restarted shard's fragments,
`runtime/synchronizer/restore.py`), closes due rounds (`close_due` under the lock, `merge` outside
it so offers and reports go on, `commit` under it), appends each to the round log before its
publication leaves the process, publishes it (`runtime/synchronizer/publish.py`), and starts
checkpoints and shard 0's periodic evaluation when due. It sleeps until woken (an offer, a report)
or the round book's next deadline, at most `IDLE_POLL_S`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from ray_diloco.algorithm.round_log import LoggedRound
from ray_diloco.config import RunConfig
from ray_diloco.control.events import ContributionRejected, RoundClosed
from ray_diloco.control.journal import Journal
from ray_diloco.control.merge_health import MergeHealth
from ray_diloco.runtime.metrics import Metrics
from ray_diloco.runtime.synchronizer.evaluation import Evaluator
from ray_diloco.runtime.synchronizer.publish import Publisher, StagedRound

if TYPE_CHECKING:  # JAX-using: imported inside the actor, never at module level
    from ray_diloco.algorithm.round_types import ContributionMeta, RoundClose
    from ray_diloco.algorithm.sync_core import Publication, SynchronizerCore
    from ray_diloco.runtime.synchronizer.checkpoint import CheckpointWriter
    from ray_diloco.runtime.synchronizer.restore import ShardStore

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.1  # longest sleep of the round thread: heartbeats can close rounds too


def record_rejection(
    journal: Journal, metrics: Metrics, meta: ContributionMeta, reason: str
) -> None:
    """A refused contribution, on the event tape and in the metrics (under the lock)."""
    metrics.contribution_rejected(meta.learner, reason)
    journal.record(
        ContributionRejected(time.time(), meta.learner, meta.incarnation, meta.fragment, reason)
    )
    logger.info("rejected fragment %d from %s: %s", meta.fragment, meta.learner, reason)


class RoundThread:
    def __init__(
        self,
        cfg: RunConfig,
        shard: int,
        core: SynchronizerCore,
        lock: threading.Lock,
        wake: threading.Event,
        finished: threading.Event,
        publisher: Publisher,
        evaluator: Evaluator,
        checkpoints: CheckpointWriter | None,
        store: ShardStore | None,
        journal: Journal,
        metrics: Metrics,
    ) -> None:
        """`wake`: set by anyone who may have made a round due (an offer, a report, a
        checkpoint written); `finished`: the token budget is spent (no round closes after)."""
        self.cfg, self.shard, self.core, self._lock = cfg, shard, core, lock
        self._wake, self._finished, self._stop = wake, finished, threading.Event()
        self.publisher, self.evaluator, self.checkpoints = publisher, evaluator, checkpoints
        self.store, self.journal, self.metrics = store, journal, metrics
        self.merge_health = MergeHealth()
        # Per learner: the incarnation and step of its last merged contribution (the
        # supervisor detects rejoins from them).
        self.merged_by: dict[str, tuple[int, int]] = {}
        # Set at the run's end, once the learners stopped: every held work merges now.
        self.closing = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rounds", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close_final(self, timeout_s: float) -> int:
        """Merge every fragment's held work in one last round each (the learners stopped and
        handed in their unsent work); returns the rounds merged, once none is open and each
        one's publication was answered (its `RoundClosed` is on the journal by then)."""
        with self._lock:
            before = self.publisher.rounds()
        self.closing.set()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._wake.set()
            with self._lock:
                if not self.core.book.open_work() and self.publisher.settled():
                    return self.publisher.rounds() - before
            time.sleep(0.05)
        logger.warning("the final rounds did not all merge within %.0f s", timeout_s)
        with self._lock:
            return self.publisher.rounds() - before

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        restored = self.store.restored if self.store is not None else None
        restarted = restored is not None and bool(restored.get("restart"))
        if self.shard == 0 and not restarted:
            # The starting point of the loss curve (compiles the eval function). Not after a
            # restart: it would hold the recovery up and score values about to be replaced.
            self.evaluator.evaluate()
        last_eval, last_eval_rounds = time.monotonic(), 0
        while not self._stop.is_set():
            self._wake.wait(timeout=self._idle_s())
            self._wake.clear()
            try:
                self._recover()
                if self.merge_health.retry_due(time.monotonic()):
                    self._close_rounds()
                rounds = self.publisher.rounds()
                if self.checkpoints is not None:
                    self.checkpoints.when_due()
                due = time.monotonic() - last_eval >= self.cfg.metrics.eval_every_s
                if self.shard == 0 and due and rounds != last_eval_rounds:  # not when idle
                    self.evaluator.in_background()
                    last_eval, last_eval_rounds = time.monotonic(), rounds
            except Exception:  # the thread must survive anything a round throws
                logger.exception("synchronizer round thread")

    def _idle_s(self) -> float:
        if self.merge_health.in_a_row:  # within a streak of failed merges: wake for the retry
            return self.merge_health.retry_s
        deadline = self.core.book.next_deadline()
        if deadline is None:
            return IDLE_POLL_S
        return min(IDLE_POLL_S, max(0.0, deadline - time.monotonic()))

    def _recover(self) -> None:
        """End the recoveries that can end (a restarted shard's fragments)."""
        if self.store is None or not self.core.recovering:
            return
        with self._lock:
            for p in self.store.due():
                self.finish_recovery(p)

    def finish_recovery(self, fragment: int) -> None:
        """Adopt the fragment's newest value found (under the lock)."""
        assert self.store is not None and self.store.restored is not None
        self.store.finish(fragment)
        self.publisher.adopt(fragment, self.store.restored["adopted"][fragment])
        # Every number the fragment may carry anywhere (the new one included) is in the mark.
        self.store.mark.update({fragment: self.core.book.versions()[fragment]})

    def _close_rounds(self) -> None:
        with self._lock:
            final = self.closing.is_set()
            if self._finished.is_set() and not final:
                return  # past the budget, rounds wait for the learners' last work
            room = self.checkpoints.room() if self.checkpoints is not None else None
            if self.checkpoints is not None and room is not None and room <= 0:
                self.checkpoints.in_background()  # rounds wait for it (it wakes this thread)
                return
            now = time.monotonic()
            closes = self.core.close_final(now) if final else self.core.close_due(now, room)
        for close in closes:
            try:
                started = time.perf_counter()
                pub = self.core.merge(close)  # outside the lock: offers and reports go on
                self.metrics.merge_time(time.perf_counter() - started)
            except Exception as err:
                if not self.merge_health.in_a_row:  # the first of a streak: its traceback
                    logger.exception("merge of fragment %d failed; round put back", close.fragment)
                with self._lock:
                    self.core.book.abort(close, time.monotonic())
                    self.merge_health.failed(close.fragment, err, time.monotonic())
                continue
            with self._lock:
                staged = self._commit(close, pub)
            self.publisher.send(staged)

    def _commit(self, close: RoundClose, pub: Publication) -> StagedRound:
        """Commit a merged round, log it, and stage its publication (under the lock)."""
        now = time.monotonic()
        self.merge_health.succeeded()
        for meta in self.core.commit(pub, now):  # dropped as late
            record_rejection(self.journal, self.metrics, meta, "late")
        for c in close.contributions:
            self.merged_by[c.meta.learner] = (c.meta.incarnation, c.meta.step)
        for learner, share in self.core.merged_shares().items():
            self.metrics.merged_share(learner, self.shard, share)
        if self.store is not None:  # before the version leaves this process
            contributors = [c.meta.learner for c in close.contributions]
            cursors = {n: self.core.ledger.account(n).cursor for n in contributors}
            self.store.log.append(LoggedRound.of(close, cursors))
        closed = RoundClosed(
            time.time(),
            pub.fragment,
            pub.version,
            len(close.contributions),
            close.num_tokens,
            close.grace_s,
            close.closed_s - close.quorum_s,
            self.shard,
        )
        return self.publisher.stage(pub, closed, now)
