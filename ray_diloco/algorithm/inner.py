"""Layer: algorithm (pure, no Ray). The inner optimizer and the learner's jitted inner step
(`loss, grads = step(params, batch)` in algorithm.md section 4), plus held-out evaluation (the
quality measure of section 9).

Inner optimizer: global-norm clipping, then AdamW with linear warm-up and cosine decay to
`final_lr_fraction * lr`. Weight decay skips norm scales (decaying a scale towards 0 fights the
normalisation it exists for). The inner state is kept when a fragment is overwritten by the
synchronizer (section 4 Decision), so nothing here knows about fragments. All functions are pure
and donate no buffers: the learner keeps references to old parameters (host copies for offers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ray_diloco.config import InnerOptimizerConfig, ModelConfig
from ray_diloco.tasks import transformer as model

Params = dict[str, jax.Array]
TrainStep = Callable[[Params, Any, jax.Array, jax.Array], tuple[Params, Any, jax.Array]]
EvalFn = Callable[[Params, jax.Array, jax.Array], jax.Array]


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


def decay_mask(params: Mapping[str, Any]) -> dict[str, bool]:
    """True for leaves that get weight decay: everything except norm scales."""
    return {path: not path.endswith("/scale") for path in params}


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


def _loss(cfg: ModelConfig, params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean next-byte cross-entropy (nats) over every position of the batch."""
    logits = model.apply(cfg, params, x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_train_step(model_cfg: ModelConfig, tx: optax.GradientTransformation) -> TrainStep:
    """The jitted inner step `(params, opt_state, x, y) -> (params, opt_state, loss)`.

    Note: JAX returns dicts with sorted keys, so the returned params are not in model order;
    code that needs model order iterates `model.leaf_paths(cfg)`."""

    def step(
        params: Params, opt_state: Any, x: jax.Array, y: jax.Array
    ) -> tuple[Params, Any, jax.Array]:
        loss, grads = jax.value_and_grad(lambda p: _loss(model_cfg, p, x, y))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step)


def make_eval_fn(model_cfg: ModelConfig) -> EvalFn:
    """The jitted evaluation loss `(params, x, y) -> loss` (same loss as training)."""

    def eval_loss(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
        return _loss(model_cfg, params, x, y)

    return jax.jit(eval_loss)


def evaluate(
    eval_fn: EvalFn, params: Params, batches: Iterable[tuple[np.ndarray, np.ndarray]]
) -> float:
    """Mean loss over `batches` (all of equal size, as `data.heldout_batches` gives them).
    One host transfer at the end instead of one per batch."""
    losses = [eval_fn(params, jnp.asarray(x), jnp.asarray(y)) for x, y in batches]
    if not losses:
        raise ValueError("evaluate: no batches given")
    return float(jnp.mean(jnp.stack(losses)))
