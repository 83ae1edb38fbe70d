"""Layer: runtime (Ray shell; this module itself only configures JAX). The persistent JAX
compilation cache of a run, shared by its learner hosts and its synchronizer.

A process restarted by the supervisor (a new incarnation) or by Ray (the synchronizer) compiles
the very programs its predecessor compiled; with the cache in `run_dir/jax_cache` it loads them
instead, which is most of the difference between a restart of seconds and one of tens of
seconds. Every entry is kept, however small or quick to compile (both thresholds 0). Call it
before the process compiles anything.

A cache named by JAX's own `JAX_COMPILATION_CACHE_DIR` in the process's environment wins: one
cache shared by many runs (a sweep, a test session) compiles each program once. Ray's workers
inherit their node's environment (an embedded local Ray's is the driver's); on a cluster, set it
in the job's `runtime_env` `env_vars`.
"""

from __future__ import annotations

import logging
import os

from ray_diloco.config import RunConfig

logger = logging.getLogger(__name__)


def use_compilation_cache(cfg: RunConfig) -> str:
    """Point JAX at the run's cache, `run_dir/jax_cache` (see `use_compilation_cache_dir`);
    returns the directory."""
    return use_compilation_cache_dir(os.path.join(cfg.run_dir, "jax_cache"))


def use_compilation_cache_dir(directory: str) -> str:
    """Point JAX at `directory`, or at `JAX_COMPILATION_CACHE_DIR` where the environment
    names one, keeping every entry; returns the directory used."""
    import jax

    directory = os.environ.get("JAX_COMPILATION_CACHE_DIR") or directory
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    logger.debug("JAX compilation cache in %s", directory)
    return directory
