"""Layer: runtime (Ray shell). The held-out evaluation of a synchronizer shard (shard 0 runs it).

Shard 0 gathers the other shards' fragments (`fragment_values`) and evaluates the whole global
model, periodically on a thread of its own: gathering from a shard that is slow or down must not
hold this shard's rounds up. The loss goes to the journal (`HeldoutEvaluated`) and the metrics.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray

from ray_diloco.config import RunConfig
from ray_diloco.control.events import HeldoutEvaluated
from ray_diloco.control.journal import Journal
from ray_diloco.runtime.metrics import Metrics
from ray_diloco.runtime.synchronizer.shards import shard_name

if TYPE_CHECKING:  # JAX-using: imported inside the actor, never at module level
    from ray_diloco.algorithm.setup import Setup
    from ray_diloco.algorithm.sync_core import SynchronizerCore

logger = logging.getLogger(__name__)

GATHER_TIMEOUT_S = 60.0  # the other shards' fragments for an evaluation (a dead one: skipped)


class Evaluator:
    def __init__(
        self,
        cfg: RunConfig,
        core: SynchronizerCore,
        setup: Setup,
        lock: threading.Lock,
        journal: Journal,
        metrics: Metrics,
        rounds: Callable[[], int],
    ) -> None:
        """`rounds()`: this shard's delivered rounds (read under `lock`)."""
        self.cfg, self.core, self.setup, self._lock = cfg, core, setup, lock
        self.journal, self.metrics, self._rounds = journal, metrics, rounds
        self._eval_lock = threading.Lock()
        self._eval_thread: threading.Thread | None = None
        self._others: list[Any] | None = None  # the other shards (shard 0 evaluates)

    def in_background(self) -> None:
        """A periodic evaluation on its own thread: gathering the other shards' fragments
        (or one that is down) must not hold this shard's rounds up."""
        if self._eval_thread is not None and self._eval_thread.is_alive():
            return
        self._eval_thread = threading.Thread(target=self.evaluate, name="evaluate", daemon=True)
        self._eval_thread.start()

    def evaluate(self) -> float | None:
        """Evaluate and record the global parameters (None: a shard did not answer)."""
        with self._eval_lock:
            with self._lock:
                tokens, rounds = self.core.ledger.tokens_trained, self._rounds()
            params = self.core.global_params()
            try:
                for values, shard_rounds in self._gather():
                    params.update(values)
                    rounds += shard_rounds
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as err:
                logger.warning("evaluation skipped: a shard's fragments are missing (%s)", err)
                return None
            loss = self.setup.evaluate(params)
            with self._lock:
                self.journal.eval_point(tokens, rounds, loss)
                self.journal.record(HeldoutEvaluated(time.time(), tokens, rounds, loss))
        self.metrics.heldout_loss(loss)
        return loss

    def _gather(self) -> list[tuple[dict[str, Any], int]]:
        """The other shards' fragments and rounds (none with one shard)."""
        if self._others is None:
            ns = self.cfg.synchronizer.namespace
            self._others = [
                ray.get_actor(shard_name(self.cfg, s), namespace=ns)
                for s in range(1, self.cfg.synchronizer.num_shards)
            ]
        refs = [h.fragment_values.remote() for h in self._others]
        return list(ray.get(refs, timeout=GATHER_TIMEOUT_S)) if refs else []
