"""Layer: actors (Ray shell). The synchronizer's checkpoint writer.

Every `synchronizer.checkpoint_every_rounds` rounds the state is written with Orbax on a thread
of its own: writing takes seconds on a busy host, and rounds must keep closing meanwhile (the
global model never stops advancing). The state is copied under the synchronizer's lock and
written outside it; a checkpoint that already holds this many rounds is not written again.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ray_diloco.config import RunConfig

logger = logging.getLogger(__name__)


def published_rounds(core: Any) -> int:
    """Rounds the `SynchronizerCore` has published: the sum of its fragments' versions."""
    return sum(core.book.versions().values())


class CheckpointWriter:
    def __init__(self, cfg: RunConfig, checkpointer: Any, lock: threading.Lock, core: Any) -> None:
        self.cfg, self.checkpointer, self._lock, self._core = cfg, checkpointer, lock, core
        self._write_lock = threading.Lock()
        self._saved_rounds = published_rounds(core)
        self._thread: threading.Thread | None = None

    def when_due(self, rounds: int) -> None:
        """A periodic checkpoint in the background, once `rounds` passed the interval."""
        if rounds - self._saved_rounds < self.cfg.synchronizer.checkpoint_every_rounds:
            return
        if self._thread is not None and self._thread.is_alive():
            return
        self._thread = threading.Thread(target=self._write_logged, name="checkpoint", daemon=True)
        self._thread.start()

    def _write_logged(self) -> None:
        try:
            self.write()
        except Exception:
            logger.exception("synchronizer checkpoint failed")

    def write(self) -> str:
        """Write a checkpoint now unless the newest one already holds this state; its path."""
        from ray_diloco.algorithm import checkpoint

        with self._write_lock:
            with self._lock:
                rounds = published_rounds(self._core)
                path = str(self.checkpointer.directory / str(rounds))
                if rounds == self._saved_rounds and self.checkpointer.latest_step() == rounds:
                    return path
                arrays, meta = checkpoint.sync_state_to_tree(self._core.state_dict())
            meta = {**meta, "digest": checkpoint.state_digest(self.cfg), "run": self.cfg.name}
            self.checkpointer.save(rounds, arrays, meta)  # outside the lock: reports go on
            self._saved_rounds = rounds
        logger.info("checkpoint of %d rounds written to %s", rounds, path)
        return path
