"""A task for the synchronizer's load benchmark (benchmarks/synchronizer.py): `num_params`
float32 parameters in `num_leaves` equal leaves, initialised to zeros (nothing random to
compute at any size), with a trivial loss and a one-example held-out set. Nothing trains on it:
fake learners send random deltas; the synchronizer only needs its shapes and a loss to
evaluate. Named by import path: `task: benchmarks.load_task:make_task`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np

from ray_diloco import Task


class _NoData:
    tokens_per_example = 1

    def batches(
        self, part: int, num_parts: int, cursor: int, batch_size: int
    ) -> Iterator[tuple[dict[str, np.ndarray], int]]:
        while True:
            yield {"x": np.zeros((batch_size, 1), np.float32)}, batch_size

    def heldout(self) -> list[dict[str, np.ndarray]]:
        return [{"x": np.zeros((1, 1), np.float32)}]


def _loss(params: dict[str, Any], batch: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    first = next(iter(params.values()))
    loss = jnp.mean(batch["x"]) + first[0] ** 2
    return loss, {}


def make_task(num_params: int = 10**6, num_leaves: int = 8) -> Task:
    size = num_params // num_leaves
    return Task(
        init=lambda rng: {f"leaf_{i:03d}": jnp.zeros(size, jnp.float32) for i in range(num_leaves)},
        loss=_loss,
        data=_NoData(),
        name="synchronizer_load",
    )
