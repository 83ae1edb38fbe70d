"""ray_diloco: Decoupled DiLoCo on Ray for any JAX model.

    import ray_diloco
    result = ray_diloco.train("my_pkg.tasks:make_task", "jobs/local.yaml")

Exports are loaded on first use, so `import ray_diloco.task` (or any pure layer) never pulls
in Ray.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray_diloco.api import Result, Trainer, simulate, train
    from ray_diloco.config import ConfigError, RunConfig, load_config
    from ray_diloco.task import DataSource, Task, load_task

_EXPORTS = {
    "Task": "ray_diloco.task",
    "DataSource": "ray_diloco.task",
    "load_task": "ray_diloco.task",
    "Trainer": "ray_diloco.api",
    "Result": "ray_diloco.api",
    "train": "ray_diloco.api",
    "simulate": "ray_diloco.api",
    "RunConfig": "ray_diloco.config",
    "load_config": "ray_diloco.config",
    "ConfigError": "ray_diloco.config",
}
__all__ = [
    "ConfigError",
    "DataSource",
    "Result",
    "RunConfig",
    "Task",
    "Trainer",
    "load_config",
    "load_task",
    "simulate",
    "train",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ray_diloco' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
