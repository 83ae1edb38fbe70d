"""The task contract with Linen-style parameters: a `flax.linen` MLP whose parameters are the
nested `{"params": {"Dense_0": {"kernel", "bias"}, ...}}` dict Linen users already have,
classifying points of two interleaved spirals (generated, no download). ray_diloco fragments
that dict by key path like any other pytree, and lays each kernel out over the learner's mesh
by its `nn.with_logical_partitioning` names and the task's `logical_axis_rules`.

    task: examples.linen_params.task:make_task
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ray_diloco import Task

# Linen's logical partitioning: each kernel names its axes; `logical_axis_rules` below maps
# the names onto the learner's mesh axes (data, fsdp, tensor).
HIDDEN = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
RULES = (("embed", "fsdp"), ("mlp", "tensor"))


class Mlp(nn.Module):
    width: int
    depth: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for _ in range(self.depth):
            x = nn.gelu(nn.Dense(self.width, kernel_init=HIDDEN)(x))
        return nn.Dense(2)(x)


def spirals(n: int, seed: int, noise: float = 0.08) -> tuple[np.ndarray, np.ndarray]:
    """n points of two interleaved spirals and their labels (0 or 1)."""
    rng = np.random.default_rng(seed)
    label = rng.integers(0, 2, n)
    t = rng.uniform(0.25, 1.0, n) * 3 * np.pi
    angle = t + np.pi * label
    x = np.stack([t * np.cos(angle), t * np.sin(angle)], 1) / (3 * np.pi)
    return (x + rng.normal(0, noise, x.shape)).astype(np.float32), label.astype(np.int32)


class SpiralData:
    """A fixed pool of points; example k of part i of n is point (k * n + i) mod pool, so
    parts are disjoint and the cursor (examples read) resumes exactly."""

    tokens_per_example = 1

    def __init__(self, pool: int, seed: int) -> None:
        self.x, self.y = spirals(pool, seed)
        self.held = spirals(1024, seed + 1)

    def batches(
        self, part: int, num_parts: int, cursor: int, batch_size: int
    ) -> Iterator[tuple[dict[str, np.ndarray], int]]:
        while True:
            idx = (np.arange(cursor, cursor + batch_size) * num_parts + part) % len(self.x)
            yield {"x": self.x[idx], "y": self.y[idx]}, batch_size
            cursor += batch_size

    def heldout(self) -> list[dict[str, np.ndarray]]:
        x, y = self.held
        return [{"x": x[i : i + 256], "y": y[i : i + 256]} for i in range(0, len(x), 256)]


def make_task(width: int = 64, depth: int = 3, pool: int = 16384, seed: int = 0) -> Task:
    model = Mlp(width, depth)

    def loss(variables: dict[str, Any], batch: dict[str, Any]) -> tuple[jax.Array, dict]:
        logits = model.apply(variables, batch["x"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return ce, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}

    return Task(
        init=lambda rng: model.init(rng, jnp.zeros((1, 2))),  # {"params": {"Dense_0": ...}}
        loss=loss,
        data=SpiralData(pool, seed),
        name="linen_spirals",  # no optimizer: the config's AdamW (`inner:`) is used
        logical_axis_rules=RULES,
    )
