"""Layer: algorithm (pure, no Ray). What one chip of each learner holds while it trains: the
figures `ray-diloco plan` checks against a chip's HBM (cluster/plan.py) before anyone pays for
TPUs. From shapes alone: nothing is computed or placed on a device.

Parameters, gradients and the inner optimizer's state come from the learner's own layout
(`partitioning.device_bytes` on its mesh, with the task's sharding rules or FSDP).
Activations are an estimate, stated in `example_activation_bytes`. The plan imports none of
this (it must run without JAX): the command computes the figures here and hands the plan the
numbers.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ray_diloco.algorithm import inner, partitioning
from ray_diloco.algorithm.pytree import TreeLayout
from ray_diloco.algorithm.setup import layout_of, learner_specs, task_of, total_inner_steps
from ray_diloco.config import ConfigError, RunConfig
from ray_diloco.task import Task


@dataclass(frozen=True)
class ChipMemory:
    """Bytes one chip of a learner holds: its shards of the parameters, of one step's
    gradients and of the optimizer state, and the activation estimate for the `examples` of
    the batch it computes. `activations` is None where the task's data could not be read
    (`unread` says why): the other figures stand, and their sum is a lower bound."""

    params: int
    grads: int
    opt_state: int
    activations: int | None
    examples: int  # per chip: batch_size / (data x fsdp)
    unread: str = ""

    @property
    def held(self) -> int:
        """Parameters, gradients and optimizer state: what the mesh's sharding divides."""
        return self.params + self.grads + self.opt_state

    @property
    def total(self) -> int:
        return self.held + (self.activations or 0)


def one_example(task: Task) -> Any:
    """Shapes and dtypes of a batch of one example: the first batch of the task's data."""
    batch, _ = next(task.data.batches(0, 1, 0, 1))
    return jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(jnp.shape(leaf), jnp.result_type(leaf)), batch
    )


def example_activation_bytes(task: Task, tree: TreeLayout, example: Any) -> int:
    """The activation estimate of one example: the bytes of the residuals reverse-mode
    differentiation of the task's loss keeps for the backward pass (JAX's `saved_residuals`
    on abstract parameters and a batch of one `example`), the parameters and the batch
    themselves left out. That is what a step holds between its forward and backward pass per
    example; a rematerialised block (`jax.checkpoint`, `nnx.remat`) keeps only its inputs. Not
    counted: the transient of recomputing one rematerialised block, XLA's own temporaries,
    and a tensor-parallel rule's split of the activations it touches (each chip is counted
    the whole of them)."""
    from jax._src.ad_checkpoint import saved_residuals  # print_saved_residuals' data

    params = tree.unflatten(
        {p: jax.ShapeDtypeStruct(tree.shapes[p], tree.dtypes[p]) for p in tree.paths}
    )
    try:
        residuals = saved_residuals(lambda p, b: task.loss(p, b)[0], params, example)
    except Exception as err:
        raise ConfigError(
            f"task: {task.name}: its loss on one example cannot be traced: "
            f"{type(err).__name__}: {err}"
        ) from None
    kept: list[Any] = [a for a, source in residuals if not source.startswith("from the argument")]
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in kept)


def learner_memory(cfg: RunConfig, task: Task | None = None) -> dict[str, ChipMemory]:
    """Each learner's bytes per chip (by name), on the mesh of its config with the task's
    inner optimizer. ConfigError when a learner's mesh cannot lay the parameters out, or the
    loss cannot be traced on one example of the task's data."""
    task = task or task_of(cfg)
    tree = layout_of(cfg, task)
    tx = inner.inner_optimizer(task, cfg.inner, total_inner_steps(cfg, task))
    per_example, unread = _per_example(task, tree)
    out = {}
    for lg in cfg.learners:
        sizes = lg.mesh_sizes
        held = partitioning.device_bytes(tx, tree, learner_specs(cfg, task, lg, sizes, tree), sizes)
        examples = lg.batch_size // (sizes["data"] * sizes["fsdp"])
        activations = None if per_example is None else per_example * examples
        out[lg.name] = ChipMemory(
            held["params"], held["grads"], held["opt_state"], activations, examples, unread
        )
    return out


@functools.lru_cache(maxsize=8)
def _per_example(task: Task, tree: TreeLayout) -> tuple[int | None, str]:
    """`example_activation_bytes` of one example of the task's data, and "" (or None and why
    the data could not be read). Cached per task and layout (both compared by identity): the
    trace of a large model's loss is most of a plan's time, and one process may plan the same
    task on several meshes."""
    try:
        example = one_example(task)
    except Exception as err:  # a plan runs where the data may not be (a corpus on the pods)
        return None, " ".join(f"{type(err).__name__}: {err}".split())  # one line of the plan
    return example_activation_bytes(task, tree, example), ""
