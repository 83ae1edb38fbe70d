"""Layer: algorithm (pure, no Ray). The inner optimizer and the learner's jitted inner step
(`loss, grads = step(params, batch)` in docs/algorithm.md section 4), plus held-out evaluation (the
quality measure of section 9), for any task (ray_diloco/task.py).

The learner keeps its parameters as a flat dict keyed by key path (algorithm/pytree.py); the
jitted step hands the task's loss and optimizer the task's own pytree back, so a task's optax
chain (masks, per-leaf rules) sees the structure it was written for. Default inner optimizer:
global-norm clipping, then AdamW with linear warm-up and cosine decay to
`final_lr_fraction * lr`; weight decay skips leaves of fewer than 2 dimensions (biases, norm
scales: decaying a scale towards 0 fights the normalisation it exists for). The inner state is
kept when a fragment is overwritten by the synchronizer (section 4 Decision), so nothing here
knows about fragments. All functions are pure; a learner jits the step with its mesh's
shardings, donating the parameters and optimizer state (algorithm/sharding.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from ray_diloco.algorithm.pytree import TreeLayout
from ray_diloco.config import InnerOptimizerConfig
from ray_diloco.task import Batch, Task

Flat = dict[str, jax.Array]
TrainStep = Callable[[Flat, Any, Batch], tuple[Flat, Any, jax.Array]]
EvalFn = Callable[[Flat, Batch], jax.Array]


def make_lr_schedule(cfg: InnerOptimizerConfig, total_steps: int) -> optax.Schedule:
    """0 at step 0, `lr` at `warmup_steps`, cosine down to `lr * final_lr_fraction` at
    `total_steps` (held there afterwards). The decay horizon is at least one step past warm-up so
    a tiny run still has a valid schedule."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        decay_steps=max(total_steps, cfg.warmup_steps + 1),
        end_value=cfg.lr * cfg.final_lr_fraction,
    )


def decay_mask(params: Any) -> Any:
    """True for leaves that get weight decay: matrices and larger, not biases or norm scales."""
    return jax.tree.map(lambda leaf: leaf.ndim >= 2, params)


def make_inner_optimizer(
    cfg: InnerOptimizerConfig, total_steps: int
) -> optax.GradientTransformation:
    """clip_by_global_norm(grad_clip_norm) then AdamW on the schedule of `make_lr_schedule`."""
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip_norm),
        optax.adamw(
            learning_rate=make_lr_schedule(cfg, total_steps),
            b1=cfg.b1,
            b2=cfg.b2,
            weight_decay=cfg.weight_decay,
            mask=decay_mask,
        ),
    )


def inner_optimizer(
    task: Task, cfg: InnerOptimizerConfig, total_steps: int
) -> optax.GradientTransformation:
    """The task's own optimizer if it brings one, else the config's AdamW."""
    if task.optimizer is not None:
        return task.optimizer(total_steps)
    return make_inner_optimizer(cfg, total_steps)


def train_step_fn(task: Task, layout: TreeLayout, tx: optax.GradientTransformation) -> TrainStep:
    """The inner step `(flat params, opt_state, batch) -> (flat params, opt_state, loss)`, not
    jitted (a learner jits it with its mesh's shardings, algorithm/sharding.py); `opt_state`
    has the structure of the task's pytree (`init_opt_state`)."""

    def step(flat: Flat, opt_state: Any, batch: Batch) -> tuple[Flat, Any, jax.Array]:
        params = layout.unflatten(flat)
        (loss, _), grads = jax.value_and_grad(task.loss, has_aux=True)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return layout.flatten(optax.apply_updates(params, updates)), opt_state, loss

    return step


def make_train_step(task: Task, layout: TreeLayout, tx: optax.GradientTransformation) -> TrainStep:
    """`train_step_fn` jitted on the default device."""
    return jax.jit(train_step_fn(task, layout, tx))


def init_opt_state(tx: optax.GradientTransformation, layout: TreeLayout, flat: Flat) -> Any:
    return tx.init(layout.unflatten(flat))


@functools.lru_cache(maxsize=16)
def make_eval_fn(task: Task, layout: TreeLayout) -> EvalFn:
    """The jitted evaluation loss `(flat params, batch) -> loss` (the task's training loss).
    One per task and layout in a process (both compared by identity): every in-process run of
    the same task evaluates with the program the first one traced."""

    def eval_loss(flat: Flat, batch: Batch) -> jax.Array:
        return task.loss(layout.unflatten(flat), batch)[0]

    return jax.jit(eval_loss)


def evaluate(eval_fn: EvalFn, params: Flat, batches: Iterable[Batch]) -> float:
    """Mean loss over `batches` (all of equal size, as held-out sources give them). One host
    transfer at the end instead of one per batch."""
    losses = [eval_fn(params, jax.tree.map(jnp.asarray, b)) for b in batches]
    if not losses:
        raise ValueError("evaluate: no held-out batches given")
    return float(jnp.mean(jnp.stack(losses)))
