"""Your own model and data with ray_diloco: a Flax NNX character-level language model on your
own text files, defined outside the package. The config names the factory:

    task: examples.custom_flax_model.task:make_task

Everything ray_diloco needs is in `make_task`: how to build the parameters (an `nnx.State`,
any pytree works), the loss, the data, and (optionally) the inner optimizer.
"""

from __future__ import annotations

import glob
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ray_diloco import Task

VOCAB = 128  # ASCII; anything else becomes "?"
KERNEL = nnx.initializers.lecun_normal()


class CharMLP(nnx.Module):
    """Predicts the next character from the `context` previous ones: embed, concatenate, MLP."""

    def __init__(self, context: int, width: int, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(VOCAB, 32, rngs=rngs)
        # Sharding annotations name the learner's mesh axes (data, fsdp, tensor): the hidden
        # kernel is split over fsdp on its input axis and tensor on its output axis; leaves
        # without one get the default (FSDP on the largest axis, or replicated when small).
        self.hidden = nnx.Linear(
            context * 32,
            width,
            kernel_init=nnx.with_partitioning(KERNEL, ("fsdp", "tensor")),
            rngs=rngs,
        )
        self.out = nnx.Linear(
            width, VOCAB, kernel_init=nnx.with_partitioning(KERNEL, ("tensor", None)), rngs=rngs
        )

    def __call__(self, chars: jax.Array) -> jax.Array:
        h = self.embed(chars).reshape(chars.shape[0], -1)
        return self.out(jax.nn.gelu(self.hidden(h)))


class TextWindows:
    """Your data as a ray_diloco `DataSource`: every position of the text is one example
    (`context` characters and the next one). Example k of part i of n is position
    (k * n + i) * stride mod length, so parts are disjoint, and a cursor (examples read so
    far: one "token" per example) resumes exactly where a restarted learner stopped."""

    tokens_per_example = 1

    def __init__(self, pattern: str, context: int) -> None:
        paths = sorted(glob.glob(pattern, recursive=True))
        if len(paths) < 2:
            raise ValueError(f"task_args.files={pattern!r} matches {len(paths)} file(s); need 2+")
        texts = [Path(p).read_text(encoding="utf-8", errors="replace") for p in paths]
        codes = [np.frombuffer(t.encode("ascii", "replace"), np.uint8) % VOCAB for t in texts]
        self.context = context
        self.train = np.concatenate([c for i, c in enumerate(codes) if i % 10])
        self.heldout_text = np.concatenate(codes[::10])  # every tenth file is held out
        self.stride = 7919  # a prime: consecutive examples come from far-apart positions

    def _examples(self, text: np.ndarray, positions: np.ndarray) -> dict[str, np.ndarray]:
        pos = positions % (len(text) - self.context - 1)
        window = text[pos[:, None] + np.arange(self.context + 1)]
        return {"x": window[:, :-1].astype(np.int32), "y": window[:, -1].astype(np.int32)}

    def batches(
        self, part: int, num_parts: int, cursor: int, batch_size: int
    ) -> Iterator[tuple[dict[str, np.ndarray], int]]:
        while True:
            k = np.arange(cursor, cursor + batch_size, dtype=np.int64)
            yield self._examples(self.train, (k * num_parts + part) * self.stride), batch_size
            cursor += batch_size

    def heldout(self) -> list[dict[str, np.ndarray]]:
        positions = np.arange(4 * 256, dtype=np.int64) * 13  # 4 fixed batches of 256
        return [self._examples(self.heldout_text, p) for p in np.split(positions, 4)]


def make_task(files: str = "**/*.py", context: int = 8, width: int = 256, lr: float = 3e-3) -> Task:
    """The factory ray_diloco calls (with `task_args` as keyword arguments) in every process."""
    # ray_diloco lays the annotated leaves out itself, so variables are not sharded as they
    # are created (Flax >= 0.12 would want a mesh in context for that).
    with nnx.use_eager_sharding(False):
        graphdef, _ = nnx.split(nnx.eval_shape(lambda: CharMLP(context, width, nnx.Rngs(0))))

    def init(rng: jax.Array) -> nnx.State:
        return nnx.state(CharMLP(context, width, nnx.Rngs(rng)))

    def loss(params: nnx.State, batch: dict[str, Any]) -> tuple[jax.Array, dict[str, Any]]:
        logits = nnx.merge(graphdef, params)(batch["x"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return ce, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}

    def optimizer(total_steps: int) -> optax.GradientTransformation:
        schedule = optax.warmup_cosine_decay_schedule(0.0, lr, 20, max(total_steps, 21))
        return optax.adamw(schedule, weight_decay=0.01)

    return Task(
        init=init,
        loss=loss,
        data=TextWindows(files, context),
        optimizer=optimizer,
        name="char_mlp",
    )
