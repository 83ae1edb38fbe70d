"""Layer: runtime (Ray shell). A synchronizer shard's checkpoint writer.

The state is written with Orbax on a thread of its own: writing takes seconds on a busy host, and
rounds must keep closing meanwhile (the global model never stops advancing). The state is copied
under the shard's lock and written outside it; a checkpoint that already holds this many committed
rounds is not written again, and a written one lets the round log drop the lines it covers. Writing
starts once the newest checkpoint is half of `checkpoint_every_rounds` behind, and `room()` tells
the round thread how many more rounds may close before it is a whole interval behind (they then wait
for the write): whenever the process dies, its checkpoint misses at most that many rounds, which the
round log and the learners give back (`runtime/synchronizer/restore.py`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from ray_diloco.config import RunConfig

logger = logging.getLogger(__name__)


def committed_rounds(core: Any) -> int:
    """Rounds the `SynchronizerCore` committed, delivered or not: the sum of its versions."""
    return sum(core.book.versions().values())


class CheckpointWriter:
    def __init__(
        self,
        cfg: RunConfig,
        store: Any,
        lock: threading.Lock,
        core: Any,
        written: Callable[[], None],
    ) -> None:
        """`store`: the shard's `ShardStore` (checkpointer and round log); `lock`: the shard's
        state lock; `written()` is called after each write (rounds held back may close)."""
        self.cfg, self.store, self._lock, self._core = cfg, store, lock, core
        self._written = written
        self._write_lock = threading.Lock()
        self._saved = committed_rounds(core)  # rounds in the newest written checkpoint
        self._thread: threading.Thread | None = None

    @property
    def checkpointer(self) -> Any:
        return self.store.checkpointer

    def room(self) -> int:
        """Rounds that may still close before the newest written checkpoint falls
        `checkpoint_every_rounds` behind."""
        interval = self.cfg.synchronizer.checkpoint_every_rounds
        return interval - (committed_rounds(self._core) - self._saved)

    def when_due(self) -> None:
        """Start writing in the background once the newest checkpoint is half an interval
        behind."""
        behind = committed_rounds(self._core) - self._saved
        if 2 * behind >= self.cfg.synchronizer.checkpoint_every_rounds:
            self.in_background()

    @property
    def writing(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def in_background(self) -> bool:
        """Start a write on its own thread; False when one is being written already."""
        if self.writing:
            return False
        self._thread = threading.Thread(target=self._write_logged, name="checkpoint", daemon=True)
        self._thread.start()
        return True

    def _write_logged(self) -> None:
        try:
            self.write()
        except Exception:
            logger.exception("synchronizer checkpoint failed")

    def write(self) -> str:
        """Write the state at the committed rounds (the step number) unless the newest
        checkpoint already holds it; the round log then keeps only the rounds past it.
        Returns the checkpoint's path."""
        from ray_diloco.algorithm import checkpoint

        with self._write_lock:
            with self._lock:
                rounds = committed_rounds(self._core)
                path = str(self.checkpointer.directory / str(rounds))
                if rounds == self._saved and self.checkpointer.latest_step() == rounds:
                    return path
                arrays, meta = checkpoint.sync_state_to_tree(self._core.state_dict())
                versions = self._core.book.versions()
            meta = {**meta, "digest": checkpoint.state_digest(self.cfg), "run": self.cfg.name}
            self.checkpointer.save(rounds, arrays, meta)  # outside the lock: reports go on
            self.store.log.compact(versions)
            self._saved = rounds
        self._written()
        logger.info("checkpoint of %d rounds written to %s", rounds, path)
        return path
