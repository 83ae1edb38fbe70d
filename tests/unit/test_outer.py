"""Unit tests for algorithm/outer.py (algorithm.md section 6), pinned to hand-computed values."""

from __future__ import annotations

import doctest

import numpy as np
import optax
import pytest

from ray_diloco.algorithm import outer
from ray_diloco.algorithm.outer import init_outer_state, outer_step
from ray_diloco.config import OuterOptimizerConfig


def test_nesterov_two_steps_hand_computed() -> None:
    # trace_t = g_t + m * trace_{t-1}, and the update direction is g_t + m * trace_t (Nesterov
    # look-ahead), scaled by -lr. lr 0.7, m 0.9, g = 1 twice from x = 0:
    #   step 1: trace = 1,   update = -0.7 * (1 + 0.9 * 1)   = -1.33   -> x = -1.33
    #   step 2: trace = 1.9, update = -0.7 * (1 + 0.9 * 1.9) = -1.897  -> x = -3.227
    opt = OuterOptimizerConfig(lr=0.7, momentum=0.9, nesterov=True, momentum_warmup_steps=0)
    values = {"w": np.zeros(3, np.float32)}
    state = init_outer_state(opt, values)
    grad = {"w": np.ones(3, np.float32)}
    values, state = outer_step(opt, values, state, grad)
    np.testing.assert_allclose(values["w"], -1.33, rtol=1e-6)
    values, state = outer_step(opt, values, state, grad)
    np.testing.assert_allclose(values["w"], -3.227, rtol=1e-6)
    assert values["w"].dtype == np.float32
    assert isinstance(values["w"], np.ndarray)
    assert isinstance(state["trace"]["w"], np.ndarray)
    np.testing.assert_allclose(state["trace"]["w"], 1.9, rtol=1e-6)
    assert float(state["steps"]) == 2.0


@pytest.mark.parametrize("nesterov", [True, False])
def test_full_steps_match_optax_sgd(nesterov: bool) -> None:
    opt = OuterOptimizerConfig(lr=0.3, momentum=0.8, nesterov=nesterov, momentum_warmup_steps=0)
    tx = optax.sgd(opt.lr, momentum=opt.momentum, nesterov=nesterov)
    rng = np.random.default_rng(0)
    ours = {"w": rng.normal(size=5).astype(np.float32)}
    theirs, tx_state = dict(ours), tx.init(ours)
    state = init_outer_state(opt, ours)
    for _ in range(4):
        grad = {"w": rng.normal(size=5).astype(np.float32)}
        ours, state = outer_step(opt, ours, state, grad)
        updates, tx_state = tx.update(grad, tx_state, theirs)
        theirs = optax.apply_updates(theirs, updates)
    np.testing.assert_allclose(ours["w"], np.asarray(theirs["w"]), rtol=1e-5, atol=1e-6)


def test_plain_momentum_two_steps() -> None:
    # Without Nesterov the update is the trace itself: -0.5 * 1 then -0.5 * 1.5 -> x = -1.25.
    opt = OuterOptimizerConfig(lr=0.5, momentum=0.5, nesterov=False, momentum_warmup_steps=0)
    values = {"w": np.zeros(1, np.float32)}
    state = init_outer_state(opt, values)
    for _ in range(2):
        values, state = outer_step(opt, values, state, {"w": np.ones(1, np.float32)})
    np.testing.assert_allclose(values["w"], [-1.25], rtol=1e-6)


def test_partial_step_hand_computed() -> None:
    # share 0.25, lr 0.7, m 0.81 (so m**0.25 = 0.9**0.5), g = 1 from a trace of 2:
    #   trace = 0.9**0.5 * 2 + 0.25 * 1 = 2.147366;  update = 0.25 * (1 + 0.81 * 2.147366)
    opt = OuterOptimizerConfig(lr=0.7, momentum=0.81, momentum_warmup_steps=0)
    state = {"trace": {"w": np.full(1, 2.0, np.float32)}, "steps": np.float32(3)}
    values, state = outer_step(opt, {"w": np.zeros(1, np.float32)}, state, {"w": np.ones(1)}, 0.25)
    trace = 0.9**0.5 * 2 + 0.25
    np.testing.assert_allclose(state["trace"]["w"], [trace], rtol=1e-6)
    np.testing.assert_allclose(values["w"], [-0.7 * 0.25 * (1 + 0.81 * trace)], rtol=1e-6)
    assert float(state["steps"]) == 3.25


def test_partial_rounds_move_as_far_as_full_ones() -> None:
    # A steady gradient: four rounds of share 1/4 end up moving the model about as far as one
    # full round does in the steady state (the trace settles near g / (1 - momentum) for any s).
    opt = OuterOptimizerConfig()
    runs = {}
    for share, rounds in ((1.0, 50), (0.25, 200)):
        values = {"w": np.zeros(1, np.float32)}
        state = init_outer_state(opt, values)
        trail = []
        for _ in range(rounds):
            values, state = outer_step(opt, values, state, {"w": np.ones(1)}, share)
            trail.append(float(values["w"][0]))
        runs[share] = trail[-1] - trail[-1 - int(1 / share)]  # movement over one full round
    assert runs[0.25] == pytest.approx(runs[1.0], rel=0.05)


def test_momentum_warmup_ramps_from_zero() -> None:
    # Warm-up over 2 outer steps: momentum 0 at step 0 (the update is g), 0.45 at step 1.
    opt = OuterOptimizerConfig(lr=1.0, momentum=0.9, momentum_warmup_steps=2)
    values = {"w": np.zeros(1, np.float32)}
    state = init_outer_state(opt, values)
    values, state = outer_step(opt, values, state, {"w": np.ones(1)})
    np.testing.assert_allclose(values["w"], [-1.0])
    values, state = outer_step(opt, values, state, {"w": np.ones(1)})
    # trace = 0.45 * 1 + 1 = 1.45; update = 1 + 0.45 * 1.45
    np.testing.assert_allclose(values["w"], [-1.0 - (1 + 0.45 * 1.45)], rtol=1e-6)


def test_lr_one_no_momentum_lands_on_merged_value() -> None:
    # The outer gradient is G - theta, so G - 1 * (G - theta) = theta: plain DiLoCo with lr 1 and
    # no momentum reduces to parameter averaging.
    opt = OuterOptimizerConfig(lr=1.0, momentum=0.0, nesterov=False)
    g = {"a": np.array([1.0, 2.0], np.float32), "b": np.array([[3.0]], np.float32)}
    theta = {"a": np.array([0.5, -1.0], np.float32), "b": np.array([[2.0]], np.float32)}
    grad = {k: g[k] - theta[k] for k in g}
    new, _ = outer_step(opt, g, init_outer_state(opt, g), grad)
    assert list(new) == ["a", "b"]
    for k in g:
        np.testing.assert_allclose(new[k], theta[k])
        assert new[k].shape == g[k].shape


def test_inputs_are_not_modified() -> None:
    opt = OuterOptimizerConfig()
    values = {"w": np.zeros(2, np.float32)}
    state = init_outer_state(opt, values)
    outer_step(opt, values, state, {"w": np.ones(2, np.float32)}, 0.5)
    assert not np.any(values["w"]) and not np.any(state["trace"]["w"])


def test_mismatched_leaves_and_bad_shares_rejected() -> None:
    opt = OuterOptimizerConfig()
    values = {"w": np.zeros(2, np.float32)}
    with pytest.raises(ValueError, match="differ"):
        outer_step(opt, values, init_outer_state(opt, values), {"v": np.ones(2, np.float32)})
    for share in (0.0, 1.5):
        with pytest.raises(ValueError, match="share"):
            outer_step(opt, values, init_outer_state(opt, values), {"w": np.ones(2)}, share)


def test_docstring_example() -> None:
    result = doctest.testmod(outer, raise_on_error=False)
    assert result.attempted > 0
    assert result.failed == 0
