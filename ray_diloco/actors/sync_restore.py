"""Layer: actors (Ray shell). Where the synchronizer's checkpoints live, and its restore.

`restore` opens the Orbax checkpointer in `run_dir/checkpoints/synchronizer` (a clear error
when it cannot be created) and loads the newest checkpoint into the core when its state digest
matches this run; `was_current_actor_reconstructed` tells a restart (the actor died and Ray
brought it back) from a driver resuming an interrupted run dir. JAX-free at import: the driver
imports `checkpoint_dir`.
"""

from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path
from typing import Any

import ray

from ray_diloco.algorithm.shards import shard_directory
from ray_diloco.config import RunConfig

logger = logging.getLogger(__name__)


def checkpoint_dir(cfg: RunConfig, shard: int = 0) -> Path:
    return shard_directory(cfg.run_dir, shard)


def restore(
    cfg: RunConfig, core: Any, now: float, shard: int = 0
) -> tuple[Any, dict[str, Any] | None]:
    """(the checkpointer, what was restored or None) for shard `shard`'s `SynchronizerCore`."""
    from ray_diloco.algorithm import checkpoint

    directory = checkpoint_dir(cfg, shard)
    try:
        checkpointer = checkpoint.Checkpointer(directory, cfg.checkpoint.keep)
    except OSError as err:
        raise RuntimeError(
            f"synchronizer: cannot create its checkpoint directory {directory} ({err}); "
            "set run_dir to a writable path on the synchronizer's node or "
            "checkpoint.enabled=false"
        ) from err
    with warnings.catch_warnings():  # Ray 2.60 trips over its own deprecated actor_id
        warnings.simplefilter("ignore", DeprecationWarning)
        restart = bool(ray.get_runtime_context().was_current_actor_reconstructed)
    loaded = checkpointer.restore()
    if loaded is None:
        if restart:
            logger.warning("synchronizer restarted with no checkpoint in %s", directory)
        return checkpointer, None
    arrays, meta = loaded
    digest = checkpoint.state_digest(cfg)
    if meta.get("digest") != digest:
        logger.warning(
            "checkpoint in %s is for state digest %s, this run has %s: not restored",
            directory,
            meta.get("digest"),
            digest,
        )
        return checkpointer, None
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
    restored = {"versions": versions, "rounds": rounds, "restart": restart, "time": time.time()}
    return checkpointer, restored
