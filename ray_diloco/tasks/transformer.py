"""Layer: tasks (pure, no Ray). The decoder-only transformer language model of the built-in
tasks (`byte_lm`: bytes; `token_lm`: tokens from a tokenizer).

Pre-norm blocks (LayerNorm without bias, causal multi-head self-attention, GELU MLP), learned
position table, no biases anywhere. The module is built with Flax NNX, but its parameters are
handed out as a flat dict `{"blocks/0/attn/q/kernel": array, ...}` (a pytree like any other
for the task contract). `apply` rebuilds the NNX module from that dict with `nnx.merge` and a
cached graph definition, which keeps it a pure, jittable function of `(params, tokens)`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ray_diloco.algorithm.pytree import path_string

_INIT_STD = 0.02


class ModelConfig(BaseModel):
    """The transformer's shape (`task_args.model` of the built-in language-model tasks)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    vocab_size: int = Field(256, ge=2)
    d_model: int = Field(96, ge=8)
    num_layers: int = Field(4, ge=1)
    num_heads: int = Field(4, ge=1)
    d_ff: int = Field(384, ge=8)
    seq_len: int = Field(64, ge=4)
    tie_embeddings: bool = False
    remat: bool = Field(
        False,
        description="recompute each block in the backward pass: activations of its input only",
    )

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.d_model % self.num_heads:
            raise ValueError(
                f"model.d_model={self.d_model} is not divisible by model.num_heads="
                f"{self.num_heads}; pick a head count that divides d_model"
            )
        return self


class _Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, out_std: float, rngs: nnx.Rngs) -> None:
        d = cfg.d_model
        init = nnx.initializers.normal(_INIT_STD)
        self.num_heads = cfg.num_heads
        self.q = nnx.Linear(d, d, use_bias=False, kernel_init=init, rngs=rngs)
        self.k = nnx.Linear(d, d, use_bias=False, kernel_init=init, rngs=rngs)
        self.v = nnx.Linear(d, d, use_bias=False, kernel_init=init, rngs=rngs)
        self.o = nnx.Linear(
            d, d, use_bias=False, kernel_init=nnx.initializers.normal(out_std), rngs=rngs
        )

    def __call__(self, h: jax.Array) -> jax.Array:
        b, t, d = h.shape
        hd = d // self.num_heads
        q = self.q(h).reshape(b, t, self.num_heads, hd)
        k = self.k(h).reshape(b, t, self.num_heads, hd)
        v = self.v(h).reshape(b, t, self.num_heads, hd)
        scores = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(hd)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        # A large finite negative instead of -inf keeps the softmax NaN-free even if a row were
        # fully masked; with a causal mask the diagonal is always visible anyway.
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        weights = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bhts,bshd->bthd", weights, v).reshape(b, t, d)
        return self.o(out)


class _Mlp(nnx.Module):
    def __init__(self, cfg: ModelConfig, out_std: float, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(
            cfg.d_model,
            cfg.d_ff,
            use_bias=False,
            kernel_init=nnx.initializers.normal(_INIT_STD),
            rngs=rngs,
        )
        self.down = nnx.Linear(
            cfg.d_ff,
            cfg.d_model,
            use_bias=False,
            kernel_init=nnx.initializers.normal(out_std),
            rngs=rngs,
        )

    def __call__(self, h: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(self.up(h)))


class _Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
        # GPT-2 style: residual-branch output projections start smaller so the residual stream's
        # variance does not grow with depth at initialisation.
        out_std = _INIT_STD / math.sqrt(2 * cfg.num_layers)
        self.ln1 = nnx.LayerNorm(cfg.d_model, use_bias=False, rngs=rngs)
        self.attn = _Attention(cfg, out_std, rngs)
        self.ln2 = nnx.LayerNorm(cfg.d_model, use_bias=False, rngs=rngs)
        self.mlp = _Mlp(cfg, out_std, rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        h = h + self.attn(self.ln1(h))
        return h + self.mlp(self.ln2(h))


class _Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
        init = nnx.initializers.normal(_INIT_STD)
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, embedding_init=init, rngs=rngs)
        self.pos_embed = nnx.Param(init(rngs.params(), (cfg.seq_len, cfg.d_model), jnp.float32))
        self.blocks = nnx.List([_Block(cfg, rngs) for _ in range(cfg.num_layers)])
        self.ln_f = nnx.LayerNorm(cfg.d_model, use_bias=False, rngs=rngs)
        # Static flag (not a data attribute): NNX forbids flipping an attribute between a module
        # and None, and the graph structure must be fixed per config anyway.
        self.tie_embeddings = cfg.tie_embeddings
        self.remat = cfg.remat
        if not cfg.tie_embeddings:
            self.unembed = nnx.Linear(
                cfg.d_model, cfg.vocab_size, use_bias=False, kernel_init=init, rngs=rngs
            )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        t = tokens.shape[1]
        h = self.embed(tokens) + self.pos_embed[...][:t]
        run = nnx.remat(_Block.__call__) if self.remat else _Block.__call__
        for block in self.blocks:
            h = run(block, h)
        h = self.ln_f(h)
        if self.tie_embeddings:
            return self.embed.attend(h)  # tied: logits = h @ embed.T
        return self.unembed(h)


@functools.lru_cache(maxsize=16)
def _structure(cfg: ModelConfig) -> tuple[nnx.GraphDef[Any], Any, tuple[str, ...]]:
    """Graph definition, state treedef and the path of each state leaf in treedef order, for one
    config. Built from an abstract (shape-only) module, so no parameters are allocated; cached
    because the config is frozen and hashable, and every `apply` trace needs it."""
    abstract = nnx.eval_shape(lambda: _Transformer(cfg, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(state)
    return graphdef, treedef, tuple(path_string(kp) for kp, _ in with_paths)


def init_params(cfg: ModelConfig, rng: jax.Array) -> dict[str, jax.Array]:
    """Fresh float32 parameters as a flat dict; deterministic in `rng`. Eager on purpose:
    jitting the constructor compiles for longer than the eager ops take."""
    _, state = nnx.split(_Transformer(cfg, nnx.Rngs(rng)))
    return {
        path_string(kp): jnp.asarray(leaf, dtype=jnp.float32)
        for kp, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
    }


def apply(cfg: ModelConfig, params: Mapping[str, jax.Array], tokens: jax.Array) -> jax.Array:
    """Logits float32[B, T, V] for int32 tokens [B, T] with T <= cfg.seq_len. Pure and
    jittable in (params, tokens): the flat dict is put back into the cached NNX structure."""
    if tokens.ndim != 2 or tokens.shape[1] > cfg.seq_len:
        raise ValueError(
            f"model.apply: tokens must be [batch, time] with time <= model.seq_len="
            f"{cfg.seq_len}; got shape {tuple(tokens.shape)}"
        )
    graphdef, treedef, paths = _structure(cfg)
    missing = [p for p in paths if p not in params]
    if missing:
        raise KeyError(f"model.apply: params lack leaves {missing}; build them with init_params")
    state = jax.tree_util.tree_unflatten(treedef, [params[p] for p in paths])
    model = nnx.merge(graphdef, state)
    return model(tokens)


def next_token_loss(
    cfg: ModelConfig,
) -> Callable[[Mapping[str, jax.Array], Any], tuple[jax.Array, dict[str, jax.Array]]]:
    """`(params, (x, y)) -> (mean next-token cross-entropy in nats, {})` for the model of `cfg`:
    the loss of both built-in language-model tasks."""

    def loss(params: Mapping[str, jax.Array], batch: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
        x, y = batch
        logits = apply(cfg, params, jnp.asarray(x)).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), {}

    return loss
