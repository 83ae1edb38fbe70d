"""Layer: actors (Ray shell; this module itself only configures JAX). The persistent JAX
compilation cache of a run, shared by its learner hosts and its synchronizer.

A process restarted by the supervisor (a new incarnation) or by Ray (the synchronizer) compiles
the very programs its predecessor compiled; with the cache in `run_dir/jax_cache` it loads them
instead, which is most of the difference between a restart of seconds and one of tens of
seconds. Every entry is kept, however small or quick to compile (both thresholds 0). Call it
before the process compiles anything.
"""

from __future__ import annotations

import logging
import os

from ray_diloco.config import RunConfig

logger = logging.getLogger(__name__)


def use_compilation_cache(cfg: RunConfig) -> str:
    """Point JAX at `run_dir/jax_cache`; returns the directory."""
    return use_compilation_cache_dir(os.path.join(cfg.run_dir, "jax_cache"))


def use_compilation_cache_dir(directory: str) -> str:
    """Point JAX at `directory`, keeping every entry; returns the directory."""
    import jax

    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    logger.debug("JAX compilation cache in %s", directory)
    return directory
