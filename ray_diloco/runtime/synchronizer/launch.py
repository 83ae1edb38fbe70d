"""Layer: runtime (Ray shell). Starting a run's synchronizer: one named, detached, restartable
actor per shard (existing ones are returned as they are)."""

from __future__ import annotations

from typing import Any

from ray_diloco.config import RunConfig
from ray_diloco.runtime.resources import actor_runtime_env, head_pin_options
from ray_diloco.runtime.synchronizer.actor import Synchronizer
from ray_diloco.runtime.synchronizer.shards import shard_name


def synchronizer_options(cfg: RunConfig, shard: int = 0) -> dict[str, Any]:
    """Shard `shard`: named, detached and restartable, pinned to the head, or spread over the
    nodes `synchronizer.placement` selects. `synchronizer.region` names the head's region (for
    the links and `ray-diloco plan`); a region selector alone could put a shard on a TPU host of
    that region."""
    s = cfg.synchronizer
    where = s.placement
    placement: dict[str, Any]
    if where.pinned:
        placement = {"num_cpus": where.num_cpus, "scheduling_strategy": "SPREAD"}
        if where.resources:
            placement["resources"] = dict(where.resources)
        if where.labels:
            placement["label_selector"] = dict(where.labels)
    else:
        placement = {"num_cpus": 0, **head_pin_options()}
    return {
        "name": shard_name(cfg, shard),
        "namespace": s.namespace,
        "lifetime": "detached",
        "get_if_exists": True,
        "max_restarts": -1,
        "max_task_retries": -1,
        # The synchronizer does no forward/backward: never let JAX grab an accelerator.
        "runtime_env": actor_runtime_env({"JAX_PLATFORMS": "cpu"}),
        **placement,
    }


def create_synchronizer(cfg: RunConfig, log_level: str = "WARNING") -> list[Any]:
    """Every shard of the run's synchronizer (existing ones are returned as they are)."""
    return [
        Synchronizer.options(**synchronizer_options(cfg, shard)).remote(cfg, shard, log_level)  # type: ignore[attr-defined]
        for shard in range(cfg.synchronizer.num_shards)
    ]
