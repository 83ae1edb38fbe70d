"""Layer: algorithm (pure, no Ray). The outer optimizer: SGD with Nesterov momentum applied by
the synchronizer to each fragment's global value with the merged outer gradient, one optimizer
state per fragment (algorithm.md section 6), extended to *partial* rounds.

A round that merged only a share `s` (0 < s <= 1) of a full round's work (e.g. one learner of
four with K = 1) takes a fraction `s` of an outer step, so M one-learner rounds move the model
about as far as one round that merges all M (the paper's outer step), instead of M times as far:

    trace <- momentum**s * trace + s * g
    G     <- G - lr * s * (g + momentum * trace)      (Nesterov; without: G - lr * s * trace)

With s = 1 this is exactly `optax.sgd(lr, momentum, nesterov)` (a unit test pins that), and for
a steady gradient g the trace settles near g / (1 - momentum) whatever s is, so a window of
partial rounds moves G as far as one full round. `momentum_warmup_steps` ramps the momentum
linearly from 0 over the first outer steps (counted in shares).

Values and state are NumPy float32 on the host (the synchronizer checkpoints and pickles them).

Example, one full step from 0 with DiLoCo's outer optimizer (lr 0.7, Nesterov momentum 0.9, no
warm-up) and gradient 1 moves by `-0.7 * (1 + 0.9 * 1) = -1.33`:

>>> import numpy as np
>>> from ray_diloco.config import OuterOptimizerConfig
>>> opt = OuterOptimizerConfig(lr=0.7, momentum=0.9, momentum_warmup_steps=0)
>>> values = {"w": np.zeros(2, np.float32)}
>>> state = init_outer_state(opt, values)
>>> values, state = outer_step(opt, values, state, {"w": np.ones(2, np.float32)})
>>> values["w"].round(5)  # float32 rounding aside
array([-1.33, -1.33], dtype=float32)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from ray_diloco.config import OuterOptimizerConfig


def _host(values: Mapping[str, ArrayLike]) -> dict[str, np.ndarray]:
    return {path: np.asarray(v, dtype=np.float32) for path, v in values.items()}


def init_outer_state(opt: OuterOptimizerConfig, values: Mapping[str, ArrayLike]) -> dict[str, Any]:
    """Fresh state for one fragment: a zero momentum trace per leaf and the outer steps taken
    (the trace is kept even when momentum is 0, so every config has the same structure)."""
    return {
        "trace": {path: np.zeros_like(v) for path, v in _host(values).items()},
        "steps": np.zeros((), np.float32),
    }


def outer_step(
    opt: OuterOptimizerConfig,
    values: Mapping[str, ArrayLike],
    state: Mapping[str, Any],
    outer_grad: Mapping[str, ArrayLike],
    share: float = 1.0,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """One (fractional) outer step on a fragment with the merged outer gradient `G - theta`
    (a descent direction: with lr 1, no momentum and share 1 the new value is the merged
    learner value). Returns new float32 values and state; the inputs are not modified."""
    if values.keys() != outer_grad.keys():
        raise ValueError(
            f"outer_step: outer gradient leaves {sorted(outer_grad)} differ from the "
            f"fragment's {sorted(values)}"
        )
    if not 0.0 < share <= 1.0:
        raise ValueError(f"outer_step: share={share} must be in (0, 1]")
    steps = float(state["steps"])
    momentum = opt.momentum
    if opt.momentum_warmup_steps:
        momentum *= min(1.0, steps / opt.momentum_warmup_steps)
    decay = momentum**share
    new_values, trace = {}, {}
    for path, v in _host(values).items():
        g = np.asarray(outer_grad[path], np.float32)
        t = decay * np.asarray(state["trace"][path], np.float32) + share * g
        update = g + momentum * t if opt.nesterov else t
        new_values[path] = (v - opt.lr * share * update).astype(np.float32)
        trace[path] = t.astype(np.float32)
    return new_values, {"trace": trace, "steps": np.asarray(steps + share, np.float32)}
