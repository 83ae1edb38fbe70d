"""Layer: algorithm (pure, no Ray). Turns the contributions of a round into one outer gradient
per leaf: token weights, weighted mean and Radial-Directional Averaging (RDA), plus the
numerical checks the synchronizer's guards use. Implements docs/algorithm.md section 6.

Everything runs in NumPy on host arrays (the synchronizer holds fragments on the host), in
float32, the parameters' dtype, one cache-sized chunk at a time (`chunks.py`): no array of the
contributions' size is ever stacked or widened, and a merge needs one fragment-sized output
plus one chunk of scratch beyond its inputs (the synchronizer's memory stays a small multiple
of one fragment). Squared norms sum each chunk in float32 and the chunks in float64. This is
the synchronizer's hot path: `benchmarks/synchronizer.py` measures it against a memcpy.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike

from ray_diloco.algorithm.chunks import CHUNK, F32, flat32, sq_distance

MergeMethod = Literal["rda", "mean"]

# The averaged direction is a mean of unit vectors, so its natural scale is 1; below this it is
# cancellation noise (e.g. two opposite deltas; float32 leaves ~1e-7 of it), and unit() of
# noise would be a random direction of full norm. Treat it as the zero vector, as the spec's
# unit(0) = 0 intends.
_DIRECTION_EPS = 1e-6


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


def _combine(
    g: np.ndarray | None, xs: Sequence[np.ndarray], coefs: Sequence[float]
) -> tuple[np.ndarray, float]:
    """`sum_c coefs[c] * d_c` with `d_c = g - x_c` (`x_c` when `g` is None), float32, and
    the squared norm of the result."""
    n = xs[0].size
    out = np.zeros(n, F32)
    tmp = np.empty(min(CHUNK, n), F32)
    total = 0.0
    for s in range(0, n, CHUNK):
        e = min(s + CHUNK, n)
        acc, t = out[s:e], tmp[: e - s]
        for x, coef in zip(xs, coefs, strict=True):
            if coef == 0.0:
                continue
            if g is None:
                np.multiply(x[s:e], F32(coef), out=t)
            else:
                np.subtract(g[s:e], x[s:e], out=t)
                t *= F32(coef)
            acc += t
        total += float(np.dot(acc, acc))
    return out, total


def _leaf_inputs(
    g: ArrayLike | None, xs: Sequence[ArrayLike]
) -> tuple[np.ndarray | None, list[np.ndarray], tuple[int, ...]]:
    arrays = [np.asarray(x) for x in xs]
    shapes = {a.shape for a in arrays} | (set() if g is None else {np.shape(g)})
    if len(shapes) != 1:
        raise ValueError(f"merge: deltas have different shapes {sorted(shapes)}")
    flat_g = None if g is None else flat32(g)
    return flat_g, [flat32(a) for a in arrays], arrays[0].shape


Scaled = tuple[np.ndarray, float]  # a leaf's outer gradient as (array, scale): array * scale


def _mean_leaf(g: ArrayLike | None, xs: Sequence[ArrayLike], weights: Sequence[float]) -> Scaled:
    w = _normalized_weights(len(xs), weights)
    gf, flat, shape = _leaf_inputs(g, xs)
    out, _ = _combine(gf, flat, list(w))
    return out.reshape(shape), 1.0


def _rda_leaf(
    g: ArrayLike | None,
    xs: Sequence[ArrayLike],
    weights: Sequence[float],
    sq_norms: Sequence[float] | None = None,
) -> Scaled:
    w = _normalized_weights(len(xs), weights)
    gf, flat, shape = _leaf_inputs(g, xs)
    if sq_norms is None:
        sq_norms = [sq_distance(gf, x) for x in flat]
    norms = np.sqrt(np.asarray(sq_norms, np.float64))
    # unit(0) = 0: a zero delta contributes to the mean norm but not to the direction.
    coefs = [wc / nc if nc > 0 else 0.0 for wc, nc in zip(w, norms, strict=True)]
    radius = float(w @ norms)
    direction, direction_sq = _combine(gf, flat, coefs)
    direction_norm = math.sqrt(direction_sq)
    if direction_norm <= _DIRECTION_EPS:
        return np.zeros(shape, F32), 0.0
    return direction.reshape(shape), radius / direction_norm


def _scaled(leaf: Scaled) -> np.ndarray:
    array, scale = leaf
    if scale != 1.0:
        array *= F32(scale)
    return array


def weighted_mean(deltas: Sequence[ArrayLike], weights: Sequence[float]) -> np.ndarray:
    """`sum w_c delta_c / sum w_c`, float32 (used for embedding leaves and `merge: mean`)."""
    return _scaled(_mean_leaf(None, deltas, weights))


def rda(deltas: Sequence[ArrayLike], weights: Sequence[float]) -> np.ndarray:
    """Radial-Directional Averaging of one leaf:
    `(sum w|d| / sum w) * unit(sum w unit(d) / sum w)`, norms L2 over the whole leaf,
    unit(0) = 0. Unlike the mean, M nearly orthogonal deltas of norm R give a result of norm R,
    not R/sqrt(M), so the outer step does not shrink as learners are added."""
    return _scaled(_rda_leaf(None, deltas, weights))


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
    parts = scaled_outer_gradient(global_values, contributions, embedding_paths, method)
    return {path: _scaled(leaf) for path, leaf in parts.items()}


def check_round(method: str, contributions: Sequence[tuple[Any, float]]) -> list[float]:
    """A round's merge rule and contributions checked; returns their weights."""
    if method not in ("rda", "mean"):
        raise ValueError(f"diloco.merge={method!r}: expected 'rda' or 'mean'")
    if not contributions:
        raise ValueError("outer_gradient: a round needs at least one contribution")
    return [weight for _, weight in contributions]


def scaled_outer_gradient(
    global_values: Mapping[str, ArrayLike],
    contributions: Sequence[tuple[Mapping[str, ArrayLike], float]],
    embedding_paths: Collection[str] = (),
    method: MergeMethod = "rda",
    sq_norms: Sequence[Mapping[str, float]] | None = None,
) -> dict[str, Scaled]:
    """`outer_gradient` with each leaf as `(array, scale)`, the scale not yet applied: the
    outer step applies it in its own pass (`outer.outer_step(grad_scale=...)`), which saves
    the merge a pass over the fragment. `sq_norms[c]`, when given, holds `||G - theta_c||^2`
    per leaf, already measured against this G (the norm guard does that as the contribution
    arrives), which saves RDA another."""
    weights = check_round(method, contributions)
    result: dict[str, Scaled] = {}
    for path, global_value in global_values.items():
        thetas = []
        for i, (values, _) in enumerate(contributions):
            if path not in values:
                raise KeyError(f"outer_gradient: contribution {i} lacks leaf {path!r}")
            theta = values[path]
            if np.shape(theta) != np.shape(global_value):
                raise ValueError(
                    f"outer_gradient: leaf {path!r} of contribution {i} has shape "
                    f"{np.shape(theta)}, the global value {np.shape(global_value)}"
                )
            thetas.append(theta)
        if method == "mean" or path in embedding_paths:
            result[path] = _mean_leaf(global_value, thetas, weights)
        else:
            known = None if sq_norms is None else [sq[path] for sq in sq_norms]
            result[path] = _rda_leaf(global_value, thetas, weights, known)
    return result


def leaf_sq_distances(
    global_values: Mapping[str, ArrayLike], values: Mapping[str, ArrayLike]
) -> dict[str, float]:
    """`||G - theta||^2` per leaf of `global_values` (NaN or inf where theta is not finite)."""
    return {path: sq_distance(g, values[path]) for path, g in global_values.items()}


def outer_grad_norm(
    global_values: Mapping[str, ArrayLike], values: Mapping[str, ArrayLike]
) -> float:
    """L2 norm of `G - theta` over the whole fragment (all leaves of `global_values`): the
    quantity the norm guard compares with its running median (section 7)."""
    return math.sqrt(sum(leaf_sq_distances(global_values, values).values()))


def all_finite(values: Mapping[str, ArrayLike]) -> bool:
    """True when no leaf holds a NaN or an infinity (the synchronizer's first guard)."""
    return all(_finite(v) for v in values.values())


def _finite(v: ArrayLike) -> bool:
    # A finite squared norm proves it in one pass; it can also overflow for finite values
    # above ~1.8e19, so only then look element by element.
    return math.isfinite(sq_distance(None, v)) or bool(np.all(np.isfinite(np.asarray(v))))
