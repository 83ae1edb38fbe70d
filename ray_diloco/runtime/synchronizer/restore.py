"""Layer: runtime (Ray shell). What a synchronizer shard keeps on disk, and its restore.

Each shard keeps, in `run_dir/checkpoints/synchronizer[-shard<s>]` (`checkpoint_dir`):
- Orbax checkpoints of its whole state (values, outer momentum, books, ledger), every
  `checkpoint_every_rounds` rounds, on `shutdown()` and when asked;
- the round log (`algorithm/round_log.py`): one line per round committed since, written
  before the round's publication leaves the process;
- the version mark (`algorithm/version_mark.py`): the newest version of each fragment delivered to a
  learner, and the data pool's frontiers and lease holders (ranges leased since the checkpoint
  stay in doubt until those holders registered again or left: `DataPool.restore_mark`).

`ShardStore` opens them and restores: the newest checkpoint of the same state digest goes into
the core, the frontiers into its pool, and the fragments with rounds past the checkpoint go
into recovery (`SynchronizerCore.start_recovery`). After a restart (Ray reconstructed the
actor: `was_current_actor_reconstructed`) the live learners hold those rounds' values: each
registers again stating the newest version it holds, hands over the values the shard wants
(`provide`), and a fragment is adopted once nothing newer can come: the newest logged round
was handed over, or every learner of the roster registered again, or `heartbeat_timeout_s`
passed since the shard began to answer calls (a learner silent that long is dead). A resumed
run's learners are new processes that hold nothing: its fragments are adopted from the
checkpoint at once. JAX-free at import.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from pathlib import Path
from typing import Any

import ray

from ray_diloco.algorithm.round_log import RoundLog
from ray_diloco.algorithm.shards import shard_directory
from ray_diloco.algorithm.version_mark import VersionMark
from ray_diloco.config import RunConfig

logger = logging.getLogger(__name__)


def checkpoint_dir(cfg: RunConfig, shard: int = 0) -> Path:
    return shard_directory(cfg.run_dir, shard)


def reconstructed() -> bool:
    """Whether Ray restarted this actor after it died (not a driver resuming a run)."""
    with warnings.catch_warnings():  # Ray 2.60 trips over its own deprecated actor_id
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)


class ShardStore:
    """A shard's checkpoints, round log and version mark, and the recovery they start."""

    def __init__(self, cfg: RunConfig, shard: int, core: Any, now: float) -> None:
        from ray_diloco.algorithm import checkpoint

        directory = checkpoint_dir(cfg, shard)
        try:
            self.checkpointer = checkpoint.Checkpointer(directory, cfg.checkpoint.keep)
        except OSError as err:
            raise RuntimeError(
                f"synchronizer: cannot create its checkpoint directory {directory} ({err}); "
                "set run_dir to a writable path on the synchronizer's node or "
                "checkpoint.enabled=false"
            ) from err
        self.core, self.shard = core, shard
        restart = reconstructed()
        self.restored = _load(cfg, self.checkpointer, core, now, restart)
        self.mark = VersionMark(directory)
        seen = self.mark.load()
        core.ledger.pool.restore_mark(seen.frontier, seen.holders)
        self.log = RoundLog(directory)
        core.start_recovery(self.log.entries(), seen.versions)
        self.awaiting = set(core.book.roster or ()) if restart else set()
        self.announced: dict[int, int] = {}  # the newest version a registered learner holds
        # A resumed run's learners hold nothing newer: nothing to wait for.
        self.wait_s = cfg.synchronizer.heartbeat_timeout_s if restart else 0.0
        self.deadline = math.inf  # until `serving`
        if core.recovering:
            self.restored = self.restored or {"versions": {}, "rounds": 0, "restart": restart}
            self.restored.update(recovering=True, time=time.time())

    def serving(self) -> None:
        """The actor answers calls from now on. The live learners have `heartbeat_timeout_s`
        from here to register again, not from the restore: the rest of the actor's start is
        no time they could have called in."""
        self.deadline = time.monotonic() + self.wait_s

    def registered(self, learner: str, versions: dict[int, int]) -> None:
        """`learner` registered (again), holding these versions."""
        self.awaiting.discard(learner)
        for p, v in versions.items():
            self.announced[int(p)] = max(self.announced.get(int(p), 0), int(v))

    def due(self) -> list[int]:
        """Fragments whose recovery can end: nothing newer can still come."""
        now = time.monotonic()
        out = []
        for p, r in self.core.recovering.items():
            # The newest logged round some registered learner holds (only those can be taken).
            held = self.announced.get(p, 0)
            want = max((e.version for e in r.logged if e.version <= held), default=r.restored)
            asked = not self.awaiting and r.best >= want
            if r.best >= r.newest or asked or now >= self.deadline:
                out.append(p)
        return out

    def finish(self, fragment: int) -> None:
        """End the recovery of `fragment` (under the synchronizer's lock)."""
        adopted, lost = self.core.finish_recovery(fragment)
        self.log.discard(fragment, adopted)  # rounds past it are gone: never replay them
        assert self.restored is not None
        self.restored["rounds_lost"] = self.restored.get("rounds_lost", 0) + lost
        self.restored.setdefault("adopted", {})[fragment] = adopted
        logger.warning(
            "shard %d fragment %d recovered at version %d (%d rounds lost)",
            self.shard,
            fragment,
            adopted,
            lost,
        )
        if not self.core.recovering:
            versions = {
                p: self.restored["adopted"].get(p, v) for p, v in self.core.book.versions().items()
            }
            self.restored.update(
                recovering=False,
                versions=versions,
                rounds=sum(versions.values()),
                recovered_at=time.time(),
            )

    def close(self) -> None:
        self.log.close()


def _load(
    cfg: RunConfig, checkpointer: Any, core: Any, now: float, restart: bool
) -> dict[str, Any] | None:
    """Load the newest checkpoint into the core when its state digest matches this run;
    returns what was restored, or None."""
    from ray_diloco.algorithm import checkpoint

    directory = checkpointer.directory
    loaded = checkpointer.restore()
    if loaded is None:
        if restart:
            logger.warning("synchronizer restarted with no checkpoint in %s", directory)
        return None
    arrays, meta = loaded
    digest = checkpoint.state_digest(cfg)
    if meta.get("digest") != digest:
        logger.warning(
            "checkpoint in %s is for state digest %s, this run has %s: not restored",
            directory,
            meta.get("digest"),
            digest,
        )
        return None
    core.load_state_dict(checkpoint.sync_state_from_tree(arrays, meta, core.outer_states), now)
    versions = core.book.versions()
    rounds = sum(versions.values())
    logger.warning(
        "synchronizer %s from %s: %d rounds, versions %s",
        "restarted and restored" if restart else "resumed",
        directory,
        rounds,
        versions,
    )
    return {"versions": versions, "rounds": rounds, "restart": restart, "time": time.time()}
