"""Inner optimizer, jitted inner step and evaluation (algorithm/inner.py)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ray_diloco.algorithm import inner
from ray_diloco.algorithm.pytree import TreeLayout
from ray_diloco.config import InnerOptimizerConfig
from ray_diloco.tasks import byte_lm

TINY = {"d_model": 32, "num_layers": 2, "num_heads": 2, "d_ff": 64, "seq_len": 16}
SYNTH = {"source": "synthetic", "eval_batches": 2, "eval_batch_size": 16}


def test_schedule_warms_up_from_zero_to_peak_then_decays() -> None:
    cfg = InnerOptimizerConfig(lr=1e-2, warmup_steps=10, final_lr_fraction=0.1)
    sched = inner.make_lr_schedule(cfg, total_steps=100)
    assert float(sched(0)) == 0.0
    assert float(sched(5)) == pytest.approx(5e-3)
    assert float(sched(10)) == pytest.approx(1e-2)
    assert float(sched(55)) < 1e-2
    assert float(sched(100)) == pytest.approx(1e-3)
    assert float(sched(1000)) == pytest.approx(1e-3)
    no_warmup = inner.make_lr_schedule(cfg.model_copy(update={"warmup_steps": 0}), 100)
    assert float(no_warmup(0)) == pytest.approx(1e-2)
    # A run shorter than its warm-up still gets a valid schedule reaching the peak.
    assert float(inner.make_lr_schedule(cfg, total_steps=3)(10)) == pytest.approx(1e-2)


def test_weight_decay_skips_vectors() -> None:
    cfg = InnerOptimizerConfig(lr=0.1, weight_decay=0.5, warmup_steps=0)
    tx = inner.make_inner_optimizer(cfg, total_steps=10)
    # Norm scales and biases are vectors; kernels and embeddings are matrices (any pytree).
    params = {"ln": {"scale": jnp.ones(4), "bias": jnp.ones(4)}, "dense": [jnp.ones((2, 2))]}
    zeros = jax.tree.map(jnp.zeros_like, params)
    # Zero gradients: Adam's own update is 0, so any change is weight decay (lr * wd = 0.05).
    updates, _ = tx.update(zeros, tx.init(params), params)
    np.testing.assert_allclose(updates["ln"]["scale"], 0.0, atol=1e-7)
    np.testing.assert_allclose(updates["ln"]["bias"], 0.0, atol=1e-7)
    np.testing.assert_allclose(updates["dense"][0], -0.05, atol=1e-7)


def test_gradients_are_clipped_before_adam() -> None:
    cfg = InnerOptimizerConfig(lr=1.0, weight_decay=0.0, warmup_steps=0, grad_clip_norm=1.0)
    tx = inner.make_inner_optimizer(cfg, total_steps=10)
    params = {"w/kernel": jnp.zeros(4)}
    state = tx.init(params)
    _, state = tx.update({"w/kernel": jnp.full(4, 100.0)}, state, params)
    mu = state[1][0].mu["w/kernel"]  # adam's first moment saw the clipped gradient
    np.testing.assert_allclose(mu, (1 - cfg.b1) * 0.5, rtol=1e-5)


@pytest.fixture(scope="module")
def trained() -> dict[str, object]:
    task = byte_lm.make_task(model=TINY, data=SYNTH)
    params = task.init(jax.random.key(0))
    layout = TreeLayout.of(params)
    tx = inner.make_inner_optimizer(InnerOptimizerConfig(lr=1e-2, warmup_steps=5), 30)
    step = inner.make_train_step(task, layout, tx)
    eval_fn = inner.make_eval_fn(task, layout)
    heldout = list(task.data.heldout())
    initial = dict(params)
    first_params, opt_state = params, inner.init_opt_state(tx, layout, params)
    before = inner.evaluate(eval_fn, params, heldout)
    losses, batches = [], []
    for batch, _ in itertools.islice(task.data.batches(0, 1, 0, 16), 30):
        batches.append(batch)
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    return {
        "losses": losses,
        "before": before,
        "after": inner.evaluate(eval_fn, params, heldout),
        "initial": initial,
        "first_params": first_params,
        "params": params,
        "eval_fn": eval_fn,
        "step": step,
        "tx": tx,
        "layout": layout,
        "batch0": batches[0],
        "heldout": heldout,
    }


def test_loss_decreases_on_synthetic_data(trained: dict) -> None:
    losses = trained["losses"]
    assert losses[0] == pytest.approx(np.log(256), abs=0.2)  # near-uniform at init
    assert np.mean(losses[-5:]) < losses[0] - 1.5
    assert trained["after"] < trained["before"] - 1.5


def test_train_step_donates_nothing(trained: dict) -> None:
    # The caller's original arrays are still alive and unchanged after 30 steps.
    for k, v in trained["first_params"].items():
        np.testing.assert_array_equal(np.asarray(v), np.asarray(trained["initial"][k]))
    assert set(trained["params"]) == set(trained["initial"])


def test_train_step_is_deterministic(trained: dict) -> None:
    # Replaying the first step from the same start gives bit-identical results.
    step, tx, batch, p = trained["step"], trained["tx"], trained["batch0"], trained["initial"]
    layout = trained["layout"]
    a = step(p, inner.init_opt_state(tx, layout, p), batch)
    b = step(p, inner.init_opt_state(tx, layout, p), batch)
    assert float(a[2]) == float(b[2]) == trained["losses"][0]
    assert all(np.array_equal(a[0][k], b[0][k]) for k in p)


def test_evaluate_is_the_mean_over_batches(trained: dict) -> None:
    eval_fn, params, heldout = trained["eval_fn"], trained["params"], trained["heldout"]
    per_batch = [float(eval_fn(params, batch)) for batch in heldout]
    assert inner.evaluate(eval_fn, params, heldout) == pytest.approx(np.mean(per_batch), rel=1e-6)
    with pytest.raises(ValueError):
        inner.evaluate(eval_fn, params, [])
