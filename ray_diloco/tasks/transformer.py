"""Layer: algorithm (pure, no Ray). The decoder-only byte-level transformer language model that
every learner trains (the `step(params, batch)` of algorithm.md section 4).

Pre-norm blocks (LayerNorm without bias, causal multi-head self-attention, GELU MLP), learned
position table, no biases anywhere. The module is built with Flax NNX, but everything outside this
file sees only a flat dict `{"blocks/0/attn/q/kernel": array, ...}` (docs/contracts.md): fragments,
merge and the wire work leaf by leaf on that dict, so NNX never leaks out of here. `apply` rebuilds
the NNX module from the flat dict with `nnx.merge` and a cached graph definition, which keeps it a
pure, jittable function of `(params, tokens)`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ray_diloco.config import ModelConfig

_INIT_STD = 0.02

# Leaves that map bytes to vectors or vectors to bytes. They merge with a plain weighted mean,
# not RDA (algorithm.md sections 3 and 6): their rows are updated sparsely (only the bytes seen),
# so the direction/norm split of RDA does not describe them well.
_EMBEDDING_PATHS = frozenset({"embed/embedding", "pos_embed", "unembed/kernel"})


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
        if not cfg.tie_embeddings:
            self.unembed = nnx.Linear(
                cfg.d_model, cfg.vocab_size, use_bias=False, kernel_init=init, rngs=rngs
            )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        t = tokens.shape[1]
        h = self.embed(tokens) + self.pos_embed[...][:t]
        for block in self.blocks:
            h = block(h)
        h = self.ln_f(h)
        if self.tie_embeddings:
            return self.embed.attend(h)  # tied: logits = h @ embed.T
        return self.unembed(h)


def leaf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter leaf and its shape, in model order (the order of `leaf_paths`).

    Written out by hand rather than read from NNX so the flat layout is a visible contract;
    a unit test pins it against the real module."""
    d, f, v = cfg.d_model, cfg.d_ff, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {
        "embed/embedding": (v, d),
        "pos_embed": (cfg.seq_len, d),
    }
    for i in range(cfg.num_layers):
        p = f"blocks/{i}"
        shapes[f"{p}/ln1/scale"] = (d,)
        for name in ("q", "k", "v", "o"):
            shapes[f"{p}/attn/{name}/kernel"] = (d, d)
        shapes[f"{p}/ln2/scale"] = (d,)
        shapes[f"{p}/mlp/up/kernel"] = (d, f)
        shapes[f"{p}/mlp/down/kernel"] = (f, d)
    shapes["ln_f/scale"] = (d,)
    if not cfg.tie_embeddings:
        shapes["unembed/kernel"] = (d, v)
    return shapes


def leaf_paths(cfg: ModelConfig) -> tuple[str, ...]:
    """The flat parameter paths in model order; `len(...) == cfg.num_leaves`."""
    return tuple(leaf_shapes(cfg))


def _path_str(keypath: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for key in keypath:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        # GetAttrKey("value") is the NNX Variable wrapper, not part of the leaf's name.
    return "/".join(parts)


@functools.lru_cache(maxsize=16)
def _structure(cfg: ModelConfig) -> tuple[nnx.GraphDef[Any], Any, tuple[str, ...]]:
    """Graph definition, state treedef and the path of each state leaf in treedef order, for one
    config. Built from an abstract (shape-only) module, so no parameters are allocated; cached
    because the config is frozen and hashable, and every `apply` trace needs it."""
    abstract = nnx.eval_shape(lambda: _Transformer(cfg, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(state)
    paths = tuple(_path_str(kp) for kp, _ in with_paths)
    if set(paths) != set(leaf_shapes(cfg)):
        raise AssertionError(
            f"model.py: NNX state paths {sorted(paths)} differ from leaf_shapes(); "
            "update leaf_shapes() together with the module"
        )
    return graphdef, treedef, paths


def init_params(cfg: ModelConfig, seed: int) -> dict[str, jax.Array]:
    """Fresh float32 parameters as a flat dict in model order; deterministic in `seed`.
    Eager on purpose: jitting the constructor compiles for longer than the eager ops take."""
    _, state = nnx.split(_Transformer(cfg, nnx.Rngs(seed)))
    flat = {_path_str(kp): leaf for kp, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}
    return {path: jnp.asarray(flat[path], dtype=jnp.float32) for path in leaf_paths(cfg)}


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every leaf of `init_params`, in model order, by abstract evaluation: no
    parameter is computed (a host that receives its parameters needs only the layout)."""
    abstract = jax.eval_shape(functools.partial(init_params, cfg, 0))
    return {path: tuple(leaf.shape) for path, leaf in abstract.items()}


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


def is_embedding(path: str) -> bool:
    """True for the token and position embeddings and the output projection (section 3)."""
    return path in _EMBEDDING_PATHS


def num_params(params: Mapping[str, Any]) -> int:
    """Total number of scalar parameters in a flat dict."""
    return sum(math.prod(v.shape) for v in params.values())
