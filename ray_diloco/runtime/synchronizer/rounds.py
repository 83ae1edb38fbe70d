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
from typing import TYPE_CHECKING, Any

from ray_diloco.algorithm.round_log import LoggedRound
from ray_diloco.config import RunConfig
from ray_diloco.control.events import RoundClosed
from ray_diloco.control.merge_health import MergeHealth

if TYPE_CHECKING:  # JAX-using: imported inside the actor, never at module level
    from ray_diloco.algorithm.round_types import RoundClose
    from ray_diloco.algorithm.sync_core import SynchronizerCore
    from ray_diloco.runtime.synchronizer.checkpoint import CheckpointWriter
    from ray_diloco.runtime.synchronizer.restore import ShardStore

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.1  # longest sleep of the round thread: heartbeats can close rounds too


class RoundDuty:
    # What the synchronizer provides (synchronizer.py, runtime/synchronizer/publish.py,
    # runtime/synchronizer/evaluation.py).
    cfg: RunConfig
    shard: int
    core: SynchronizerCore
    store: ShardStore | None
    checkpoints: CheckpointWriter | None
    restored: dict[str, Any] | None
    finished_at: float | None
    delivered: dict[int, int]
    merged_by: dict[str, tuple[int, int]]
    merge_health: MergeHealth
    metrics: Any
    deliveries: Any
    _closing: dict[tuple[int, int], RoundClosed]
    _lock: threading.Lock
    _wake: threading.Event
    _stop: threading.Event
    rounds: Any  # () -> rounds delivered
    _now: Any  # () -> the round book's clock
    _evaluate: Any
    _evaluate_in_background: Any
    _targets: Any
    _publish: Any
    _round_metrics: Any
    _record_rejection: Any  # (meta, reason) -> None, under the lock

    def _loop(self) -> None:
        restarted = self.restored is not None and self.restored.get("restart")
        if self.shard == 0 and not restarted:
            # The starting point of the loss curve (compiles the eval function). Not after a
            # restart: it would hold the recovery up and score values about to be replaced.
            self._evaluate()
        last_eval, last_eval_rounds = time.monotonic(), 0
        while not self._stop.is_set():
            self._wake.wait(timeout=self._idle_s())
            self._wake.clear()
            try:
                self._recover()
                if self.merge_health.retry_due(time.monotonic()):
                    self._close_rounds()
                rounds = self.rounds()
                if self.checkpoints is not None:
                    self.checkpoints.when_due()
                due = time.monotonic() - last_eval >= self.cfg.metrics.eval_every_s
                if self.shard == 0 and due and rounds != last_eval_rounds:  # not when idle
                    self._evaluate_in_background()
                    last_eval, last_eval_rounds = time.monotonic(), rounds
            except Exception:  # the thread must survive anything a round throws
                logger.exception("synchronizer round thread")

    def _idle_s(self) -> float:
        if self.merge_health.in_a_row:  # within a streak of failed merges: wake for the retry
            return self.merge_health.retry_s
        deadline = self.core.book.next_deadline()
        if deadline is None:
            return IDLE_POLL_S
        return min(IDLE_POLL_S, max(0.0, deadline - self._now()))

    def _recover(self) -> None:
        """End the recoveries that can end (a restarted shard's fragments)."""
        if self.store is None or not self.core.recovering:
            return
        with self._lock:
            for p in self.store.due():
                self._finish_recovery(p)

    def _finish_recovery(self, fragment: int) -> None:
        """Adopt the fragment's newest value found (under the lock)."""
        assert self.store is not None
        self.store.finish(fragment)
        adopted = self.store.restored["adopted"][fragment]  # type: ignore[index]
        self.delivered[fragment] = adopted
        # Every number the fragment may carry anywhere (the new one included) is in the mark.
        self.store.mark.update({fragment: self.core.book.versions()[fragment]})

    def _close_rounds(self) -> None:
        with self._lock:
            if self.finished_at is not None:
                return
            room = self.checkpoints.room() if self.checkpoints is not None else None
            if self.checkpoints is not None and room is not None and room <= 0:
                self.checkpoints.in_background()  # rounds wait for it (it wakes this thread)
                return
            closes = self.core.close_due(self._now(), room)
        for close in closes:
            try:
                started = time.perf_counter()
                pub = self.core.merge(close)  # outside the lock: offers and reports go on
                self.metrics.merge_time(time.perf_counter() - started)
            except Exception as err:
                if not self.merge_health.in_a_row:  # the first of a streak: its traceback
                    logger.exception("merge of fragment %d failed; round put back", close.fragment)
                with self._lock:
                    self.core.book.abort(close, self._now())
                    self.merge_health.failed(close.fragment, err, time.monotonic())
                continue
            with self._lock:
                self.merge_health.succeeded()
                for meta in self.core.commit(pub, self._now()):  # dropped as late
                    self._record_rejection(meta, "late")
                for c in close.contributions:
                    self.merged_by[c.meta.learner] = (c.meta.incarnation, c.meta.step)
                if self.store is not None:  # before the version leaves this process
                    cursors = {
                        n: self.core.ledger.account(n).cursor for n in self._contributors(close)
                    }
                    self.store.log.append(LoggedRound.of(close, cursors))
                active = self._targets()
                groups = self.core.messages(pub, self.core.recipients(pub, active))
                live = len(self.core.book.live(self._now()))
                self._closing[(pub.fragment, pub.version)] = RoundClosed(
                    time.time(),
                    pub.fragment,
                    pub.version,
                    len(close.contributions),
                    close.num_tokens,
                    close.grace_s,
                    close.closed_s - close.quorum_s,
                    self.shard,
                )
            sends = sum(len(active[n]) for names, _ in groups for n in names)
            self.deliveries.expect(pub.fragment, pub.version, sends)
            for names, msgs in groups:
                self._publish(msgs, {n: active[n] for n in names}, track=True)
            self._round_metrics(pub, live)

    @staticmethod
    def _contributors(close: RoundClose) -> list[str]:
        return [c.meta.learner for c in close.contributions]
