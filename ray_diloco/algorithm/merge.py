"""Layer: algorithm (pure, no Ray). Turns the contributions of a round into one outer gradient
per leaf: token weights, weighted mean and Radial-Directional Averaging (RDA), plus the
numerical checks the synchronizer's guards use. Implements algorithm.md section 6.

Everything runs in NumPy on host arrays (the synchronizer holds fragments on the host). Sums are
taken in float64 so the result does not depend on contribution order beyond rounding, and
results come back as float32, the dtype of the parameters.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike

MergeMethod = Literal["rda", "mean"]

# The averaged direction is a mean of unit vectors, so its natural scale is 1; below this it is
# cancellation noise (e.g. two opposite deltas), and unit() of noise would be a random direction
# of full norm. Treat it as the zero vector, as the spec's unit(0) = 0 intends.
_DIRECTION_EPS = 1e-12


def token_weight(
    num_tokens: int, num_steps: int, staleness: int = 0, staleness_penalty: float = 0.0
) -> float:
    """`tokens * (tokens / steps) / (1 + staleness_penalty * staleness)`: quantity (tokens since
    the learner last received the fragment) times quality (tokens per step), with an optional
    discount for contributions based on an old version."""
    if num_steps <= 0:
        raise ValueError(f"token_weight: num_steps={num_steps} must be > 0")
    if num_tokens < 0:
        raise ValueError(f"token_weight: num_tokens={num_tokens} must be >= 0")
    if staleness < 0:
        raise ValueError(f"token_weight: staleness={staleness} must be >= 0")
    if staleness_penalty < 0:
        raise ValueError(f"token_weight: staleness_penalty={staleness_penalty} must be >= 0")
    return num_tokens * (num_tokens / num_steps) / (1.0 + staleness_penalty * staleness)


def _normalized_weights(num_deltas: int, weights: Sequence[float]) -> np.ndarray:
    if num_deltas == 0:
        raise ValueError("merge: no deltas to merge")
    if len(weights) != num_deltas:
        raise ValueError(f"merge: {num_deltas} deltas but {len(weights)} weights")
    w = np.asarray(weights, dtype=np.float64)
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError(f"merge: weights must be finite and >= 0, got {list(weights)}")
    total = float(w.sum())
    if total <= 0:
        raise ValueError("merge: weights sum to zero; at least one contribution needs tokens")
    return w / total


def _stack(deltas: Sequence[ArrayLike]) -> np.ndarray:
    arrays = [np.asarray(d, dtype=np.float64) for d in deltas]
    shapes = {a.shape for a in arrays}
    if len(shapes) != 1:
        raise ValueError(f"merge: deltas have different shapes {sorted(shapes)}")
    return np.stack(arrays)


def weighted_mean(deltas: Sequence[ArrayLike], weights: Sequence[float]) -> np.ndarray:
    """`sum w_c delta_c / sum w_c`, float32 (used for embedding leaves and `merge: mean`)."""
    w = _normalized_weights(len(deltas), weights)
    stacked = _stack(deltas)
    return np.tensordot(w, stacked, axes=1).astype(np.float32)


def rda(deltas: Sequence[ArrayLike], weights: Sequence[float]) -> np.ndarray:
    """Radial-Directional Averaging of one leaf:
    `(sum w|d| / sum w) * unit(sum w unit(d) / sum w)`, norms L2 over the whole leaf,
    unit(0) = 0. Unlike the mean, M nearly orthogonal deltas of norm R give a result of norm R,
    not R/sqrt(M), so the outer step does not shrink as learners are added."""
    w = _normalized_weights(len(deltas), weights)
    stacked = _stack(deltas)
    flat = stacked.reshape(len(deltas), -1)
    norms = np.sqrt(np.einsum("ij,ij->i", flat, flat))
    # unit(0) = 0: a zero delta contributes to the mean norm but not to the direction.
    safe = np.where(norms > 0, norms, 1.0)
    units = np.where((norms > 0)[:, None], flat / safe[:, None], 0.0)
    radius = float(w @ norms)
    direction = w @ units
    direction_norm = float(np.linalg.norm(direction))
    if direction_norm <= _DIRECTION_EPS:
        return np.zeros(stacked.shape[1:], dtype=np.float32)
    merged = (radius / direction_norm) * direction
    return merged.reshape(stacked.shape[1:]).astype(np.float32)


def outer_gradient(
    global_values: Mapping[str, ArrayLike],
    contributions: Sequence[tuple[Mapping[str, ArrayLike], float]],
    embedding_paths: Collection[str] = (),
    method: MergeMethod = "rda",
) -> dict[str, np.ndarray]:
    """The merged outer gradient of one fragment, per leaf of `global_values`.

    Each contribution is `(theta_c, w_c)`; its outer gradient is `delta_c = G - theta_c`, anchored
    at the synchronizer's current value G. Embedding leaves always use the weighted mean; the
    others use RDA, or the weighted mean when `method == "mean"`. Returns float32 arrays.
    """
    if method not in ("rda", "mean"):
        raise ValueError(f"diloco.merge={method!r}: expected 'rda' or 'mean'")
    if not contributions:
        raise ValueError("outer_gradient: a round needs at least one contribution")
    weights = [weight for _, weight in contributions]
    result: dict[str, np.ndarray] = {}
    for path, global_value in global_values.items():
        g = np.asarray(global_value, dtype=np.float64)
        deltas = []
        for i, (values, _) in enumerate(contributions):
            if path not in values:
                raise KeyError(f"outer_gradient: contribution {i} lacks leaf {path!r}")
            theta = np.asarray(values[path], dtype=np.float64)
            if theta.shape != g.shape:
                raise ValueError(
                    f"outer_gradient: leaf {path!r} of contribution {i} has shape "
                    f"{theta.shape}, the global value {g.shape}"
                )
            deltas.append(g - theta)
        use_mean = method == "mean" or path in embedding_paths
        result[path] = weighted_mean(deltas, weights) if use_mean else rda(deltas, weights)
    return result


def outer_grad_norm(
    global_values: Mapping[str, ArrayLike], values: Mapping[str, ArrayLike]
) -> float:
    """L2 norm of `G - theta` over the whole fragment (all leaves of `global_values`): the
    quantity the norm guard compares with its running median (section 7)."""
    total = 0.0
    for path, global_value in global_values.items():
        diff = np.asarray(global_value, dtype=np.float64) - np.asarray(values[path], np.float64)
        total += float(np.vdot(diff, diff))
    return math.sqrt(total)


def all_finite(values: Mapping[str, ArrayLike]) -> bool:
    """True when no leaf holds a NaN or an infinity (the synchronizer's first guard)."""
    return all(bool(np.all(np.isfinite(np.asarray(v)))) for v in values.values())
