"""The built-in tasks' transformer (tasks/transformer.py): parameters as a flat dict, a pure
and jittable apply, and which leaves the default predicate merges with the mean."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ray_diloco.task import is_embedding
from ray_diloco.tasks import transformer as model
from ray_diloco.tasks.transformer import ModelConfig

TINY = ModelConfig(d_model=32, num_layers=2, num_heads=2, d_ff=64, seq_len=16)
TINY_TIED = TINY.model_copy(update={"tie_embeddings": True})
# Jitted with the (frozen, hashable) config static: proves apply is jittable, and one compile per
# shape is much faster than running NNX op by op on CPU.
apply = jax.jit(model.apply, static_argnums=0)


@pytest.fixture(scope="module")
def params() -> dict[str, jax.Array]:
    return model.init_params(TINY, jax.random.key(0))


def _tokens(seed: int, batch: int = 2, t: int = TINY.seq_len) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).integers(0, 256, (batch, t)), dtype=jnp.int32)


def test_leaf_order_and_shapes(params: dict[str, jax.Array]) -> None:
    d, f, v, t = TINY.d_model, TINY.d_ff, TINY.vocab_size, TINY.seq_len
    assert len(params) == 2 + 8 * TINY.num_layers + 2
    assert params["embed/embedding"].shape == (v, d)
    assert params["pos_embed"].shape == (t, d)
    for name in ("q", "k", "v", "o"):
        assert params[f"blocks/1/attn/{name}/kernel"].shape == (d, d)
    assert params["blocks/0/mlp/up/kernel"].shape == (d, f)
    assert params["blocks/0/mlp/down/kernel"].shape == (f, d)
    assert params["unembed/kernel"].shape == (d, v)
    assert all(x.dtype == jnp.float32 for x in params.values())
    assert "unembed/kernel" not in model.init_params(TINY_TIED, jax.random.key(0))


def test_default_model_is_about_half_a_million_parameters() -> None:
    shapes = jax.eval_shape(functools.partial(model.init_params, ModelConfig()), jax.random.key(0))
    assert sum(int(np.prod(s.shape)) for s in shapes.values()) == 498_528


def test_init_deterministic_and_scaled(params: dict[str, jax.Array]) -> None:
    again = model.init_params(TINY, jax.random.key(0))
    other = model.init_params(TINY, jax.random.key(1))
    assert all(np.array_equal(params[k], again[k]) for k in params)
    assert not np.array_equal(params["blocks/0/attn/q/kernel"], other["blocks/0/attn/q/kernel"])
    assert np.all(np.asarray(params["blocks/0/ln1/scale"]) == 1.0)
    assert np.all(np.asarray(params["ln_f/scale"]) == 1.0)
    q_std = float(np.std(params["blocks/0/attn/q/kernel"]))
    o_std = float(np.std(params["blocks/0/attn/o/kernel"]))
    assert 0.015 < q_std < 0.025
    assert o_std < 0.7 * q_std  # residual-branch outputs start smaller


def test_apply_shapes_and_purity(params: dict[str, jax.Array]) -> None:
    tokens = _tokens(0)
    logits = apply(TINY, params, tokens)
    assert logits.shape == (2, TINY.seq_len, TINY.vocab_size)
    assert logits.dtype == jnp.float32
    np.testing.assert_array_equal(logits, apply(TINY, dict(params), tokens))
    # A shorter sequence uses the first rows of the position table: same logits as a prefix.
    short = apply(TINY, params, tokens[:, :5])
    np.testing.assert_allclose(short, logits[:, :5], rtol=1e-5, atol=1e-5)


def test_causal_later_token_does_not_change_earlier_logits(params: dict[str, jax.Array]) -> None:
    tokens = _tokens(1)
    changed = tokens.at[:, 10].set((tokens[:, 10] + 1) % 256)
    a = np.asarray(apply(TINY, params, tokens))
    b = np.asarray(apply(TINY, params, changed))
    np.testing.assert_allclose(a[:, :10], b[:, :10], rtol=1e-6, atol=1e-6)
    assert np.abs(a[:, 10:] - b[:, 10:]).max() > 1e-4


def test_tied_embeddings_use_the_embedding_table() -> None:
    p = model.init_params(TINY_TIED, jax.random.key(0))
    assert len(p) == 2 + 8 * TINY.num_layers + 1
    # logits = h @ embed.T: doubling byte 7's row doubles byte 7's logit and nothing else, as
    # long as byte 7 is not among the inputs.
    safe = jnp.where(_tokens(2) == 7, 8, _tokens(2))
    base = apply(TINY_TIED, p, safe)
    bumped = dict(p, **{"embed/embedding": p["embed/embedding"].at[7].multiply(2.0)})
    out = apply(TINY_TIED, bumped, safe)
    np.testing.assert_allclose(out[..., 7], 2.0 * base[..., 7], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out[..., :7], base[..., :7], rtol=1e-6, atol=1e-6)


def test_apply_rejects_bad_inputs(params: dict[str, jax.Array]) -> None:
    with pytest.raises(ValueError, match="seq_len"):
        model.apply(TINY, params, _tokens(0, t=TINY.seq_len + 1))
    broken = {k: v for k, v in params.items() if k != "ln_f/scale"}
    with pytest.raises(KeyError, match="ln_f/scale"):
        model.apply(TINY, broken, _tokens(0))


def test_default_mean_merge_predicate_flags_exactly_the_token_tables(params) -> None:
    assert {p for p in params if is_embedding(p)} == {
        "embed/embedding",
        "pos_embed",
        "unembed/kernel",
    }
    tied = model.init_params(TINY_TIED, jax.random.key(0))
    assert {p for p in tied if is_embedding(p)} == {"embed/embedding", "pos_embed"}
