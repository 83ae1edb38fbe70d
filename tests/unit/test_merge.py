"""Unit tests for algorithm/merge.py (docs/algorithm.md section 6), against hand-computed values."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest

from ray_diloco.algorithm.merge import (
    all_finite,
    outer_grad_norm,
    outer_gradient,
    rda,
    token_weight,
    weighted_mean,
)

ORTHO = [np.array([3.0, 0.0]), np.array([0.0, 4.0])]


def test_token_weight_hand_values() -> None:
    # 1000 tokens in 10 steps: quantity 1000 x quality 100 tokens/step = 100_000.
    assert token_weight(1000, 10) == 100_000.0
    # Staleness 2 with penalty 0.5 divides by 1 + 0.5 * 2 = 2.
    assert token_weight(1000, 10, staleness=2, staleness_penalty=0.5) == 50_000.0
    # Default penalty 0: staleness has no effect.
    assert token_weight(1000, 10, staleness=3) == 100_000.0
    assert token_weight(0, 1) == 0.0


@pytest.mark.parametrize(
    ("tokens", "steps", "staleness", "penalty"),
    [(10, 0, 0, 0.0), (10, -1, 0, 0.0), (-1, 1, 0, 0.0), (1, 1, -1, 0.0), (1, 1, 0, -0.1)],
)
def test_token_weight_rejects_bad_input(
    tokens: int, steps: int, staleness: int, penalty: float
) -> None:
    with pytest.raises(ValueError, match="token_weight"):
        token_weight(tokens, steps, staleness, penalty)


def test_weighted_mean_hand_values() -> None:
    # Equal weights: ([3,0] + [0,4]) / 2 = [1.5, 2].
    np.testing.assert_allclose(weighted_mean(ORTHO, [1.0, 1.0]), [1.5, 2.0])
    # Weights 1:3: (1*[3,0] + 3*[0,4]) / 4 = [0.75, 3].
    np.testing.assert_allclose(weighted_mean(ORTHO, [1.0, 3.0]), [0.75, 3.0])
    assert weighted_mean(ORTHO, [1.0, 1.0]).dtype == np.float32


def test_rda_orthogonal_equal_weights() -> None:
    # Norms 3 and 4 -> mean norm 3.5. Units [1,0] and [0,1] -> mean direction [0.5, 0.5],
    # unit([0.5, 0.5]) = [1, 1]/sqrt(2). RDA = 3.5/sqrt(2) * [1, 1] = [2.4748737, 2.4748737],
    # norm 3.5, whereas the mean [1.5, 2] has norm 2.5.
    out = rda(ORTHO, [1.0, 1.0])
    np.testing.assert_allclose(out, [3.5 / math.sqrt(2)] * 2, rtol=1e-6)
    assert np.linalg.norm(out) == pytest.approx(3.5, rel=1e-6)
    assert out.dtype == np.float32


def test_rda_orthogonal_unequal_weights() -> None:
    # Weights 1:3 -> mean norm (1*3 + 3*4)/4 = 3.75; mean direction [0.25, 0.75],
    # unit = [1, 3]/sqrt(10). RDA = 3.75/sqrt(10) * [1, 3] = [1.1858541, 3.5575624].
    out = rda(ORTHO, [1.0, 3.0])
    np.testing.assert_allclose(out, [3.75 / math.sqrt(10), 3 * 3.75 / math.sqrt(10)], rtol=1e-6)


def test_rda_with_one_zero_delta() -> None:
    # unit(0) = 0: the zero delta halves the mean norm ((0 + 5)/2 = 2.5) and the direction
    # [0.3, 0.4] normalises to [0.6, 0.8]; RDA = 2.5 * [0.6, 0.8] = [1.5, 2.0].
    out = rda([np.zeros(2), np.array([3.0, 4.0])], [1.0, 1.0])
    np.testing.assert_allclose(out, [1.5, 2.0], rtol=1e-6)


def test_rda_zero_and_cancelling_deltas_give_zero() -> None:
    assert not np.any(rda([np.zeros((2, 3))] * 3, [1.0, 2.0, 3.0]))
    # Opposite directions cancel exactly: unit(0) = 0 even though the mean norm is 1.
    assert not np.any(rda([np.array([1.0, 0.0]), np.array([-1.0, 0.0])], [1.0, 1.0]))


def test_rda_of_identical_deltas_is_that_delta() -> None:
    d = np.random.default_rng(0).normal(size=(4, 5)).astype(np.float32)
    np.testing.assert_allclose(rda([d, d, d], [1.0, 5.0, 0.5]), d, rtol=1e-5, atol=1e-7)


def test_rda_keeps_norm_where_mean_shrinks() -> None:
    # M = 16 random vectors in 4096 dimensions are nearly orthogonal. Scaled to norm R = 2, their
    # mean has norm about R/sqrt(M) = 0.5, while RDA keeps R (exactly, by construction).
    rng = np.random.default_rng(42)
    m, dim, radius = 16, 4096, 2.0
    deltas = [radius * v / np.linalg.norm(v) for v in rng.normal(size=(m, dim))]
    weights = [1.0] * m
    assert np.linalg.norm(rda(deltas, weights)) == pytest.approx(radius, rel=1e-5)
    mean_norm = float(np.linalg.norm(weighted_mean(deltas, weights)))
    assert mean_norm == pytest.approx(radius / math.sqrt(m), rel=0.1)


def test_weights_are_scale_invariant() -> None:
    rng = np.random.default_rng(1)
    deltas = list(rng.normal(size=(3, 7)))
    w = [1.0, 2.5, 4.0]
    w_scaled = [1e6 * x for x in w]
    np.testing.assert_allclose(rda(deltas, w), rda(deltas, w_scaled), rtol=1e-6)
    np.testing.assert_allclose(weighted_mean(deltas, w), weighted_mean(deltas, w_scaled), rtol=1e-6)


def test_zero_weight_contribution_is_ignored() -> None:
    np.testing.assert_allclose(rda(ORTHO, [1.0, 0.0]), ORTHO[0], rtol=1e-6)


@pytest.mark.parametrize("fn", [rda, weighted_mean])
def test_merge_rejects_bad_input(fn: Callable[..., np.ndarray]) -> None:
    with pytest.raises(ValueError, match="no deltas"):
        fn([], [])
    with pytest.raises(ValueError, match="weights"):
        fn(ORTHO, [1.0])
    with pytest.raises(ValueError, match="sum to zero"):
        fn(ORTHO, [0.0, 0.0])
    with pytest.raises(ValueError, match=">= 0"):
        fn(ORTHO, [1.0, -1.0])
    with pytest.raises(ValueError, match="shapes"):
        fn([np.zeros(2), np.zeros(3)], [1.0, 1.0])


def _round() -> tuple[dict[str, np.ndarray], list[tuple[dict[str, np.ndarray], float]]]:
    # G = [1, 1] for both leaves; theta_1 = [-2, 1] gives delta [3, 0], theta_2 = [1, -3] gives
    # delta [0, 4]: the orthogonal pair above. Equal token weights (1000 tokens in 10 steps).
    g = {"blocks/0/w": np.ones(2, np.float32), "embed/token": np.ones(2, np.float32)}
    t1 = {k: np.array([-2.0, 1.0], np.float32) for k in g}
    t2 = {k: np.array([1.0, -3.0], np.float32) for k in g}
    w = token_weight(1000, 10)
    return g, [(t1, w), (t2, w)]


def test_outer_gradient_rda_except_embeddings() -> None:
    g, contributions = _round()
    out = outer_gradient(g, contributions, {"embed/token"}, "rda")
    assert list(out) == list(g)
    np.testing.assert_allclose(out["blocks/0/w"], [3.5 / math.sqrt(2)] * 2, rtol=1e-6)
    np.testing.assert_allclose(out["embed/token"], [1.5, 2.0], rtol=1e-6)  # plain mean
    assert all(v.dtype == np.float32 for v in out.values())


def test_outer_gradient_mean_method() -> None:
    g, contributions = _round()
    out = outer_gradient(g, contributions, (), "mean")
    for v in out.values():
        np.testing.assert_allclose(v, [1.5, 2.0], rtol=1e-6)


def test_outer_gradient_rejects_bad_input() -> None:
    g, contributions = _round()
    with pytest.raises(ValueError, match=r"diloco\.merge"):
        outer_gradient(g, contributions, (), "median")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one"):
        outer_gradient(g, [], ())
    with pytest.raises(KeyError, match="lacks leaf"):
        outer_gradient(g, [({"blocks/0/w": g["blocks/0/w"]}, 1.0)], ())
    bad = {k: np.zeros(3, np.float32) for k in g}
    with pytest.raises(ValueError, match="shape"):
        outer_gradient(g, [(bad, 1.0)], ())


def test_outer_grad_norm_hand_value() -> None:
    # Differences [0, 3] and [-4]: sqrt(0 + 9 + 16) = 5 over the whole fragment.
    g = {"a": np.array([1.0, 1.0]), "b": np.array([0.0])}
    theta = {"a": np.array([1.0, -2.0]), "b": np.array([4.0])}
    assert outer_grad_norm(g, theta) == pytest.approx(5.0)
    assert outer_grad_norm(g, g) == 0.0


def test_all_finite() -> None:
    assert all_finite({"a": np.ones(3), "b": np.zeros((2, 2), np.float32)})
    assert all_finite({})
    assert not all_finite({"a": np.ones(3), "b": np.array([0.0, np.nan])})
    assert not all_finite({"a": np.array([np.inf])})


def test_known_norms_and_deferred_scale_give_the_same_gradient() -> None:
    # The synchronizer hands RDA the norms its guard measured and lets the outer step apply the
    # scale; across chunk boundaries and with a mean leaf, the result is outer_gradient's.
    from ray_diloco.algorithm.chunks import CHUNK
    from ray_diloco.algorithm.merge import leaf_sq_distances, scaled_outer_gradient

    rng = np.random.default_rng(3)
    g = {"w": rng.normal(size=CHUNK + 7).astype(np.float32), "embed": np.ones(4, np.float32)}
    contributions = [
        ({k: v + rng.normal(0, 0.1, v.shape).astype(np.float32) for k, v in g.items()}, w)
        for w in (1.0, 2.0, 0.5)
    ]
    sq = [leaf_sq_distances(g, theta) for theta, _ in contributions]
    expected = outer_gradient(g, contributions, {"embed"}, "rda")
    parts = scaled_outer_gradient(g, contributions, {"embed"}, "rda", sq)
    for k, (array, scale) in parts.items():
        np.testing.assert_allclose(array * scale, expected[k], rtol=1e-5, atol=1e-7)
    assert parts["embed"][1] == 1.0  # a mean is not rescaled


def test_rda_keeps_a_small_but_real_direction() -> None:
    # Nearly opposite deltas: the mean of their unit vectors is 1e-3 long, far above float32
    # cancellation noise (~1e-7), so RDA keeps its direction at the mean norm (1), not zero.
    d1 = np.array([1.0, 0.0], np.float32)
    d2 = np.array([-1.0, 0.002], np.float32)
    out = rda([d1, d2], [1.0, 1.0])
    np.testing.assert_allclose(out, [0.0, 1.0], atol=2e-3)


def test_finite_values_whose_squared_norm_overflows_are_finite() -> None:
    # 1e20 squared overflows float64's sum of squares; element by element it is finite.
    assert all_finite({"a": np.array([1e20, -1e20])})
    assert not all_finite({"a": np.array([1e20, np.inf])})


def test_an_rda_scale_of_exactly_two_is_applied() -> None:
    # One delta of norm 2: RDA's mean norm is 2 and its direction a unit vector, so the leaf's
    # scale is exactly 2.0, which must still multiply the direction.
    out = rda([np.array([0.0, 2.0])], [1.0])
    np.testing.assert_allclose(out, [0.0, 2.0])
    assert out.dtype == np.float32


def test_leaves_keep_their_shape_and_float32() -> None:
    deltas = [np.ones((2, 3)), np.full((2, 3), 3.0)]
    mean = weighted_mean(deltas, [1.0, 1.0])
    assert mean.shape == (2, 3) and mean.dtype == np.float32
    np.testing.assert_allclose(mean, np.full((2, 3), 2.0))
    # cancelling deltas: the zero leaf, float32 like every other
    zero = rda([np.array([[1.0, 0.0]]), np.array([[-1.0, 0.0]])], [1.0, 1.0])
    assert zero.shape == (1, 2) and zero.dtype == np.float32 and not zero.any()


def test_rda_uses_the_norms_it_is_given() -> None:
    # The synchronizer hands RDA the squared norms its guard measured: they set the mean norm
    # (here 4x the true squared norms, so the result is twice as long), and a list that does
    # not match the contributions is refused.
    from ray_diloco.algorithm.merge import leaf_sq_distances, scaled_outer_gradient

    g = {"w": np.zeros(2, np.float32)}
    contributions = [({"w": np.array([-3.0, 0.0], np.float32)}, 1.0)]
    true = [leaf_sq_distances(g, theta) for theta, _ in contributions]
    ((array, scale),) = scaled_outer_gradient(g, contributions, (), "rda", true).values()
    np.testing.assert_allclose(array * scale, [3.0, 0.0])
    given = [{"w": 4 * sq["w"]} for sq in true]
    ((array, scale),) = scaled_outer_gradient(g, contributions, (), "rda", given).values()
    np.testing.assert_allclose(array * scale, [6.0, 0.0])
    with pytest.raises(ValueError):
        scaled_outer_gradient(g, contributions, (), "rda", true * 2)
