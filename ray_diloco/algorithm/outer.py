"""Layer: algorithm (pure, no Ray). The outer optimizer: SGD with Nesterov momentum applied by
the synchronizer to each fragment's global value with the merged outer gradient, one optimizer
state per fragment. Implements docs/algorithm.md section 6.

The arithmetic is optax's `sgd(lr, momentum, nesterov)` (`optax.trace` then a scale by -lr,
in float32, operation for operation; `tests/unit/test_outer.py` pins it to optax), written in
NumPy over cache-sized chunks: the synchronizer keeps values and state on the host, and one
fused pass per chunk is several times faster than dispatching optax's array operations (the
outer step runs once per round on a whole fragment, see `benchmarks/synchronizer.py`). The
state is `{"trace": {leaf: float32 array}}`, the leaves optax's state holds, in the same order.

Example, one step from 0 with the defaults (lr 0.7, momentum 0.9, Nesterov) and gradient 1:
the Nesterov update is `g + momentum * trace` with `trace = g + momentum * trace_prev`, so
the first step moves by `-0.7 * (1 + 0.9 * 1) = -1.33`.

>>> import numpy as np
>>> from ray_diloco.config import OuterOptimizerConfig
>>> tx = make_outer_optimizer(OuterOptimizerConfig())
>>> values = {"w": np.zeros(2, np.float32)}
>>> state = init_outer_state(tx, values)
>>> values, state = outer_step(tx, values, state, {"w": np.ones(2, np.float32)})
>>> values["w"].round(5)  # float32 rounding aside
array([-1.33, -1.33], dtype=float32)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from ray_diloco.algorithm.buffers import Buffers
from ray_diloco.algorithm.chunks import CHUNK, F32
from ray_diloco.config import OuterOptimizerConfig


@dataclass(frozen=True)
class OuterOptimizer:
    """SGD with (Nesterov) momentum. The momentum trace is kept even when momentum is 0 so the
    state has the same structure for every config (checkpoints stay comparable)."""

    lr: float
    momentum: float
    nesterov: bool
    warmup_rounds: int = 0


def make_outer_optimizer(cfg: OuterOptimizerConfig) -> OuterOptimizer:
    return OuterOptimizer(cfg.lr, cfg.momentum, cfg.nesterov, cfg.warmup_rounds)


def warmup_lr_scale(tx: OuterOptimizer, version: int) -> float:
    """The outer learning rate's share at the round that makes `version` of a fragment
    (1, 2, ...): linear from 1/warmup_rounds to 1 over the fragment's first `warmup_rounds`
    rounds, then 1. Early outer gradients are the largest of a run, and Nesterov momentum
    0.9 carries each about lr / (1 - momentum) = 7 times its size over the next rounds."""
    if tx.warmup_rounds <= 0:
        return 1.0
    return min(1.0, version / tx.warmup_rounds)


def _host(values: Mapping[str, ArrayLike]) -> dict[str, np.ndarray]:
    return {path: np.asarray(v, dtype=F32) for path, v in values.items()}


def init_outer_state(tx: OuterOptimizer, values: Mapping[str, ArrayLike]) -> dict[str, Any]:
    """Fresh outer optimizer state for one fragment (zero momentum), with NumPy leaves."""
    return {"trace": {path: np.zeros(np.shape(v), F32) for path, v in values.items()}}


def outer_step(
    tx: OuterOptimizer,
    values: Mapping[str, ArrayLike],
    opt_state: Mapping[str, Any],
    outer_grad: Mapping[str, ArrayLike],
    grad_scale: Mapping[str, float] | None = None,
    fraction: float = 1.0,
    accelerated: float = 1.0,
    lr_scale: float = 1.0,
    reuse_grad: bool = False,
    buffers: Buffers | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """One outer step on a fragment: `trace <- g + momentum * trace`, `G <- G - lr * u` with
    `u = g + momentum * trace` (Nesterov) or `u = trace`.

    `outer_grad` is the merged `G - theta` (merge.outer_gradient), a descent direction, so with
    lr 1 and no momentum the new value is the merged learner value; `grad_scale[leaf]`, when
    given, multiplies it first (merge.scaled_outer_gradient leaves that to this pass).

    `fraction` f < 1 takes that fraction of a step (`diloco.round_step: fraction` or `sqrt`), with
    b = momentum: `trace <- b^f * trace + c g` where c = (1 - b^f) / (1 - b), and `u = f (g +
    b * trace)` (Nesterov) or `f * trace`. Then 1/f rounds of gradient g decay the trace as one
    whole step does and add exactly g to it, and, without momentum, move G exactly as far; at
    f = 1 it is the step above, operation for operation.

    `accelerated` a < 1 gives the optimizer only a g (`diloco.accelerate: window`, for a
    gradient that covers 1/a sync windows of learner work) and moves G by the rest, (1 - a) g,
    as it is: lr 1, no momentum, no trace. `lr_scale` multiplies the learning rate (the
    warm-up, `warmup_lr_scale`). Returns float32 NumPy values and a new state; the
    inputs are not modified (a checkpoint may be reading the old state), except with
    `reuse_grad`: the gradient's float32 arrays, which the caller no longer reads, become the
    new trace (the synchronizer's round then allocates one fragment-sized array less, and
    a fresh array's first touch faults in every page of it). `buffers`: where the new
    values' arrays come from (`buffers.py`; fresh ones without)."""
    if values.keys() != outer_grad.keys():
        raise ValueError(
            f"outer_step: outer gradient leaves {sorted(outer_grad)} differ from the "
            f"fragment's {sorted(values)}"
        )
    params, grads = _host(values), _host(outer_grad)
    traces: dict[str, np.ndarray] = {}
    new_values: dict[str, np.ndarray] = {}
    if not 0.0 < accelerated <= 1.0:
        raise ValueError(f"outer_step: accelerated={accelerated} must be in (0, 1]")
    b, whole, plain = tx.momentum, fraction == 1.0, F32(1.0 - accelerated)
    mu, neg_lr = F32(b), F32(-tx.lr * lr_scale)
    # A fraction f of a step: the trace decays by b^f and takes c g, u is f times the whole
    # step's (the whole step skips these, operation for operation optax's).
    f, decay, c = F32(fraction), F32(b**fraction), F32((1 - b**fraction) / (1 - b))
    if not whole:
        mu, neg_lr = (mu * f, neg_lr) if tx.nesterov else (mu, neg_lr * f)
    for path, g_value in params.items():
        shape = g_value.shape
        g_flat, grad = g_value.reshape(-1), grads[path].reshape(-1)
        old = np.asarray(opt_state["trace"][path], F32).reshape(-1)
        trace = grad if reuse_grad else np.empty_like(old)
        new = np.empty_like(g_flat) if buffers is None else buffers.empty(g_flat.size)
        tmp, scaled, part = np.empty((3, min(CHUNK, g_flat.size)), F32)
        given = F32(1.0 if grad_scale is None else grad_scale[path])
        if plain:
            given, plain_scale = given * F32(accelerated), given * plain
        scale = None if given == 1.0 else given
        for s in range(0, g_flat.size, CHUNK):
            e = min(s + CHUNK, g_flat.size)
            t, u, gc = trace[s:e], tmp[: e - s], grad[s:e]
            if plain:  # the part taken as it is: G - (1 - a) g, before g is scaled for the trace
                np.multiply(gc, plain_scale, out=part[: e - s])
                np.subtract(g_flat[s:e], part[: e - s], out=new[s:e])
            if scale is not None:
                gc = np.multiply(gc, scale, out=scaled[: e - s])
            elif reuse_grad:  # the trace is written over the gradient's chunk below
                scaled[: e - s] = gc
                gc = scaled[: e - s]
            if whole:
                np.multiply(old[s:e], mu, out=t)
                t += gc
            else:
                np.multiply(old[s:e], decay, out=t)
                t += np.multiply(gc, c, out=part[: e - s])
                gc = np.multiply(gc, f, out=scaled[: e - s])
            if tx.nesterov:
                np.multiply(t, mu, out=u)
                u += gc
                u *= neg_lr
            else:
                np.multiply(t, neg_lr, out=u)
            if plain:
                new[s:e] += u
            else:
                np.add(g_flat[s:e], u, out=new[s:e])
        traces[path], new_values[path] = trace.reshape(shape), new.reshape(shape)
    return new_values, {"trace": traces}
