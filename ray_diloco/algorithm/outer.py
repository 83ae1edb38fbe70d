"""Layer: algorithm (pure, no Ray). The outer optimizer: SGD with Nesterov momentum applied by
the synchronizer to each fragment's global value with the merged outer gradient, one optimizer
state per fragment. Implements algorithm.md section 6.

The synchronizer keeps values and optimizer state on the host, so `outer_step` takes and returns
NumPy float32 arrays (state leaves too) whatever optax computes with internally.

Example, one step from 0 with the defaults (lr 0.7, momentum 0.9, Nesterov) and gradient 1:
optax's Nesterov update is `g + momentum * trace` with `trace = g + momentum * trace_prev`, so
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
from typing import Any

import jax
import numpy as np
import optax
from numpy.typing import ArrayLike

from ray_diloco.config import OuterOptimizerConfig


def make_outer_optimizer(cfg: OuterOptimizerConfig) -> optax.GradientTransformation:
    """`optax.sgd(lr, momentum, nesterov)`. The momentum trace is kept even when momentum is 0
    so the state has the same structure for every config (checkpoints stay comparable)."""
    return optax.sgd(cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)


def _host(values: Mapping[str, ArrayLike]) -> dict[str, np.ndarray]:
    return {path: np.asarray(v, dtype=np.float32) for path, v in values.items()}


def _host_state(state: Any) -> Any:
    # optax builds its state with jnp; the synchronizer pickles and checkpoints it, so keep it as
    # plain NumPy (the same bytes, no device buffers).
    return jax.tree.map(np.asarray, state)


def init_outer_state(tx: optax.GradientTransformation, values: Mapping[str, ArrayLike]) -> Any:
    """Fresh outer optimizer state for one fragment (zero momentum), with NumPy leaves."""
    return _host_state(tx.init(_host(values)))


def outer_step(
    tx: optax.GradientTransformation,
    values: Mapping[str, ArrayLike],
    opt_state: Any,
    outer_grad: Mapping[str, ArrayLike],
) -> tuple[dict[str, np.ndarray], Any]:
    """One outer step on a fragment: `G <- G + tx.update(outer_grad)`.

    `outer_grad` is the merged `G - theta` (merge.outer_gradient), a descent direction, so with
    lr 1 and no momentum the new value is the merged learner value. Returns float32 NumPy values
    and NumPy state; the inputs are not modified.
    """
    if values.keys() != outer_grad.keys():
        raise ValueError(
            f"outer_step: outer gradient leaves {sorted(outer_grad)} differ from the "
            f"fragment's {sorted(values)}"
        )
    params = _host(values)
    grads = _host({path: outer_grad[path] for path in params})
    updates, new_state = tx.update(grads, opt_state, params)
    new_values = optax.apply_updates(params, updates)
    return _host(new_values), _host_state(new_state)
