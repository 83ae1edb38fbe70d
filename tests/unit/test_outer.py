"""Unit tests for algorithm/outer.py (docs/algorithm.md section 6), against hand-computed values."""

from __future__ import annotations

import doctest

import jax
import numpy as np
import pytest

from ray_diloco.algorithm import outer
from ray_diloco.algorithm.outer import init_outer_state, make_outer_optimizer, outer_step
from ray_diloco.config import OuterOptimizerConfig


def test_nesterov_two_steps_hand_computed() -> None:
    # optax.sgd(momentum=m, nesterov=True) is optax.trace: trace_t = g_t + m * trace_{t-1}, and
    # the update direction is g_t + m * trace_t (Nesterov look-ahead), scaled by -lr.
    # lr 0.7, m 0.9, g = 1 twice from x = 0:
    #   step 1: trace = 1,   update = -0.7 * (1 + 0.9 * 1)   = -1.33   -> x = -1.33
    #   step 2: trace = 1.9, update = -0.7 * (1 + 0.9 * 1.9) = -1.897  -> x = -3.227
    tx = make_outer_optimizer(OuterOptimizerConfig(lr=0.7, momentum=0.9, nesterov=True))
    values = {"w": np.zeros(3, np.float32)}
    state = init_outer_state(tx, values)
    grad = {"w": np.ones(3, np.float32)}
    values, state = outer_step(tx, values, state, grad)
    np.testing.assert_allclose(values["w"], -1.33, rtol=1e-6)
    values, state = outer_step(tx, values, state, grad)
    np.testing.assert_allclose(values["w"], -3.227, rtol=1e-6)
    assert values["w"].dtype == np.float32
    assert isinstance(values["w"], np.ndarray)
    # The momentum trace after two steps is 1.9, held as NumPy.
    (trace,) = jax.tree.leaves(state)
    assert isinstance(trace, np.ndarray)
    np.testing.assert_allclose(trace, 1.9, rtol=1e-6)


def test_plain_momentum_two_steps() -> None:
    # Without Nesterov the update is the trace itself: -0.5 * 1 then -0.5 * 1.5 -> x = -1.25.
    tx = make_outer_optimizer(OuterOptimizerConfig(lr=0.5, momentum=0.5, nesterov=False))
    values = {"w": np.zeros(1, np.float32)}
    state = init_outer_state(tx, values)
    for _ in range(2):
        values, state = outer_step(tx, values, state, {"w": np.ones(1, np.float32)})
    np.testing.assert_allclose(values["w"], [-1.25], rtol=1e-6)


def test_lr_one_no_momentum_lands_on_merged_value() -> None:
    # The outer gradient is G - theta, so G - 1 * (G - theta) = theta: plain DiLoCo with lr 1 and
    # no momentum reduces to parameter averaging.
    tx = make_outer_optimizer(OuterOptimizerConfig(lr=1.0, momentum=0.0, nesterov=False))
    g = {"a": np.array([1.0, 2.0], np.float32), "b": np.array([[3.0]], np.float32)}
    theta = {"a": np.array([0.5, -1.0], np.float32), "b": np.array([[2.0]], np.float32)}
    grad = {k: g[k] - theta[k] for k in g}
    new, _ = outer_step(tx, g, init_outer_state(tx, g), grad)
    assert list(new) == ["a", "b"]
    for k in g:
        np.testing.assert_allclose(new[k], theta[k])
        assert new[k].shape == g[k].shape


def test_inputs_are_not_modified() -> None:
    tx = make_outer_optimizer(OuterOptimizerConfig())
    values = {"w": np.zeros(2, np.float32)}
    outer_step(tx, values, init_outer_state(tx, values), {"w": np.ones(2, np.float32)})
    assert not np.any(values["w"])


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize(
    ("scale", "fraction", "accelerated"), [(None, 1.0, 1.0), (0.5, 1.0, 1.0), (None, 0.5, 0.6)]
)
def test_reusing_the_gradient_as_the_trace_changes_no_bit(
    nesterov: bool, scale: float | None, fraction: float, accelerated: float
) -> None:
    """The synchronizer's round hands its merged gradient over (`reuse_grad`): the trace is
    written over it chunk by chunk, after each chunk of it is read, over several chunks."""
    tx = outer.OuterOptimizer(0.7, 0.9, nesterov)
    rng = np.random.default_rng(3)
    n = 3 * outer.CHUNK + 17
    values = {
        "w": rng.normal(size=n).astype(np.float32),
        "b": rng.normal(size=5).astype(np.float32),
    }
    state = {"trace": {k: rng.normal(size=v.shape).astype(np.float32) for k, v in values.items()}}
    grad = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in values.items()}
    scales = None if scale is None else {k: scale for k in values}
    args = (scales, fraction, accelerated)
    want_values, want_state = outer_step(
        tx, values, state, {k: g.copy() for k, g in grad.items()}, *args
    )
    got_values, got_state = outer_step(tx, values, state, grad, *args, reuse_grad=True)
    for k in values:
        assert got_values[k].tobytes() == want_values[k].tobytes()
        assert got_state["trace"][k].tobytes() == want_state["trace"][k].tobytes()
        assert np.shares_memory(got_state["trace"][k], grad[k])  # no trace array allocated


def test_mismatched_leaves_rejected() -> None:
    tx = make_outer_optimizer(OuterOptimizerConfig())
    values = {"w": np.zeros(2, np.float32)}
    with pytest.raises(ValueError, match="differ"):
        outer_step(tx, values, init_outer_state(tx, values), {"v": np.ones(2, np.float32)})


def test_docstring_example() -> None:
    result = doctest.testmod(outer, raise_on_error=False)
    assert result.attempted > 0
    assert result.failed == 0


@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_optax_sgd(nesterov: bool) -> None:
    # The NumPy step is optax.sgd operation for operation, over chunk boundaries too.
    import optax

    from ray_diloco.algorithm.chunks import CHUNK

    rng = np.random.default_rng(0)
    cfg = OuterOptimizerConfig(lr=0.7, momentum=0.9, nesterov=nesterov)
    values = {"a": rng.normal(size=(3, CHUNK)).astype(np.float32), "b": np.ones(5, np.float32)}
    ref_tx = optax.sgd(cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)
    tx = make_outer_optimizer(cfg)
    ref_values, ref_state = dict(values), ref_tx.init(values)
    state = init_outer_state(tx, values)
    for _ in range(3):
        grad = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in values.items()}
        updates, ref_state = ref_tx.update(grad, ref_state, ref_values)
        ref_values = optax.apply_updates(ref_values, updates)
        values, state = outer_step(tx, values, state, grad)
    for k in values:
        np.testing.assert_allclose(values[k], ref_values[k], rtol=1e-6, atol=1e-6)
    assert len(jax.tree.leaves(state)) == len(jax.tree.leaves(ref_state))


@pytest.mark.parametrize("nesterov", [True, False])
def test_four_quarter_steps_add_up_to_one_whole_step(nesterov: bool) -> None:
    # diloco.round_step: fraction. Four rounds of a quarter step each with the same gradient
    # decay an existing momentum exactly as one whole step does and add the gradient to it
    # exactly once; without momentum they move G exactly as far; with it, G moves less far
    # (the quarters' momentum builds up inside the window instead of at once).
    cfg = OuterOptimizerConfig(lr=0.7, momentum=0.9, nesterov=nesterov)
    tx = make_outer_optimizer(cfg)
    g0 = {"w": np.zeros(4, np.float32)}
    grad = {"w": np.array([1.0, -2.0, 0.5, 0.0], np.float32)}
    start = {"trace": {"w": np.array([3.0, 1.0, -1.0, 2.0], np.float32)}}
    _, whole_state = outer_step(tx, g0, start, {"w": np.zeros(4, np.float32)})
    values, state = g0, start
    for _ in range(4):
        values, state = outer_step(tx, values, state, {"w": np.zeros(4, np.float32)}, None, 0.25)
    np.testing.assert_allclose(state["trace"]["w"], whole_state["trace"]["w"], rtol=1e-6)
    plain = make_outer_optimizer(OuterOptimizerConfig(lr=0.7, momentum=0.0, nesterov=nesterov))
    zero = init_outer_state(plain, g0)
    one, _ = outer_step(plain, g0, zero, grad)
    values, state = g0, zero
    for _ in range(4):
        values, state = outer_step(plain, values, state, grad, None, 0.25)
    np.testing.assert_allclose(values["w"], one["w"], rtol=1e-6)
    # with momentum, from rest: a whole step against four quarters, in the same direction
    fresh = init_outer_state(tx, g0)
    one, one_state = outer_step(tx, g0, fresh, grad)
    values, state = g0, fresh
    for _ in range(4):
        values, state = outer_step(tx, values, state, grad, None, 0.25)
    np.testing.assert_allclose(state["trace"]["w"], one_state["trace"]["w"], rtol=1e-5)
    ratio = values["w"][:3] / one["w"][:3]
    assert np.allclose(ratio, ratio[0]) and 0.6 < ratio[0] < 1, ratio


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_accelerated_share_goes_through_momentum_and_the_rest_moves_g_as_it_is(
    fraction: float,
) -> None:
    # diloco.accelerate: window. A gradient covering 4 windows: the optimizer takes a quarter
    # (its trace and its step are those of g / 4), and G moves by the other 3/4 as it is.
    from ray_diloco.algorithm.chunks import CHUNK

    rng = np.random.default_rng(1)
    tx = make_outer_optimizer(OuterOptimizerConfig(lr=0.7, momentum=0.9, nesterov=True))
    values = {"a": rng.normal(size=(2, CHUNK + 3)).astype(np.float32)}
    state = {"trace": {"a": rng.normal(size=values["a"].shape).astype(np.float32)}}
    grad = {"a": rng.normal(size=values["a"].shape).astype(np.float32)}
    scale = {"a": 2.0}
    got, got_state = outer_step(tx, values, state, grad, scale, fraction, accelerated=0.25)
    quarter = {"a": grad["a"] * np.float32(0.25)}
    want, want_state = outer_step(tx, values, state, quarter, scale, fraction)
    want_g = want["a"] - np.float32(0.75 * 2.0) * grad["a"]
    np.testing.assert_allclose(got_state["trace"]["a"], want_state["trace"]["a"], rtol=1e-5)
    np.testing.assert_allclose(got["a"], want_g, rtol=1e-5, atol=1e-5)
    # accelerated = 1 is the plain step, bit for bit
    plain, _ = outer_step(tx, values, state, grad, scale, fraction, accelerated=1.0)
    ref, _ = outer_step(tx, values, state, grad, scale, fraction)
    np.testing.assert_array_equal(plain["a"], ref["a"])


def test_accelerated_out_of_range_is_refused() -> None:
    tx = make_outer_optimizer(OuterOptimizerConfig())
    values = {"w": np.zeros(2, np.float32)}
    for accelerated in (0.0, 1.5):  # a share of the step: in (0, 1]
        with pytest.raises(ValueError, match="accelerated"):
            outer_step(tx, values, init_outer_state(tx, values), values, accelerated=accelerated)


@pytest.mark.parametrize("reuse_grad", [False, True])
def test_the_new_trace_and_values_keep_each_leafs_shape(reuse_grad: bool) -> None:
    # The step works on flat views of each leaf; what it returns has the leaves' shapes.
    tx = make_outer_optimizer(OuterOptimizerConfig())
    values = {"w": np.ones((3, 4), np.float32), "b": np.ones(5, np.float32)}
    grad = {k: np.full(v.shape, 0.1, np.float32) for k, v in values.items()}
    new, state = outer_step(tx, values, init_outer_state(tx, values), grad, reuse_grad=reuse_grad)
    for k, v in values.items():
        assert new[k].shape == state["trace"][k].shape == v.shape


def test_warmup_scales_the_learning_rate_over_the_first_rounds() -> None:
    # warmup_rounds 4: versions 1..4 take 1/4, 2/4, 3/4 and 1 of the lr, then 1. The trace is
    # the warm-up's business only through the update: from 0 with g = 1 the first step at a
    # quarter of lr 0.7 moves by -0.175 * (1 + 0.9) = -0.3325, and the trace is still 1.
    tx = make_outer_optimizer(OuterOptimizerConfig(warmup_rounds=4))
    assert [outer.warmup_lr_scale(tx, v) for v in (1, 2, 3, 4, 9)] == [0.25, 0.5, 0.75, 1, 1]
    assert outer.warmup_lr_scale(make_outer_optimizer(OuterOptimizerConfig()), 1) == 1.0
    values = {"w": np.zeros(2, np.float32)}
    state = init_outer_state(tx, values)
    grad = {"w": np.ones(2, np.float32)}
    warm, warm_state = outer_step(tx, values, state, grad, lr_scale=outer.warmup_lr_scale(tx, 1))
    np.testing.assert_allclose(warm["w"], -0.3325, rtol=1e-6)
    np.testing.assert_allclose(warm_state["trace"]["w"], 1.0)
