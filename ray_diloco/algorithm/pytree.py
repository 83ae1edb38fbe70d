"""Layer: algorithm (pure, no Ray). Any parameter pytree as a flat dict keyed by key path.

Fragments, the wire, merges and checkpoints work leaf by leaf on `dict[str, array]`, whatever
the task's parameters are (a Flax NNX `nnx.State`, a Linen params dict, nested lists): the
keys are the leaves' `jax.tree_util` key paths joined by "/" (`blocks/0/attn/q/kernel`,
`params/Dense_0/kernel`). A `TreeLayout` remembers the tree's structure, so the learner can
hand the task its own pytree back inside the jitted step at no cost.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np


def path_string(keypath: tuple[Any, ...]) -> str:
    """ "/"-joined key path. A trailing `.value` is dropped: it is the Flax NNX Variable
    wrapper, not part of the leaf's name (and a leaf has no children, so no two paths can
    collide by dropping it)."""
    parts: list[str] = []
    for key in keypath:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, jax.tree_util.FlattenedIndexKey):
            parts.append(str(key.key))
        else:
            parts.append(str(key))
    if (
        len(parts) > 1
        and isinstance(keypath[-1], jax.tree_util.GetAttrKey)
        and parts[-1] == "value"
    ):
        parts.pop()
    return "/".join(parts)


@dataclass(frozen=True, eq=False)
class TreeLayout:
    """The structure of a parameter pytree: its treedef, and per leaf (in treedef order) the
    path, shape and dtype."""

    treedef: Any
    paths: tuple[str, ...]
    shapes: Mapping[str, tuple[int, ...]]
    dtypes: Mapping[str, np.dtype]

    @classmethod
    def of(cls, tree: Any) -> TreeLayout:
        """The layout of `tree` (concrete arrays or `jax.ShapeDtypeStruct`s). Raises
        ValueError when two leaves share a path string, or a leaf is not floating point (the
        synchronizer averages parameters: integer state cannot be merged)."""
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
        paths = tuple(path_string(kp) for kp, _ in with_paths)
        if len(set(paths)) != len(paths):
            dup = sorted({p for p in paths if paths.count(p) > 1})
            raise ValueError(f"parameter leaves share the key paths {dup}; rename them")
        shapes, dtypes = {}, {}
        for path, (_, leaf) in zip(paths, with_paths, strict=True):
            dtype = np.dtype(leaf.dtype)
            if not np.issubdtype(dtype, np.floating) and dtype.name != "bfloat16":
                raise ValueError(
                    f"parameter leaf {path!r} has dtype {dtype}; only floating-point "
                    "parameters can be merged (keep integer state out of the parameters)"
                )
            shapes[path], dtypes[path] = tuple(leaf.shape), dtype
        return cls(treedef, paths, shapes, dtypes)

    def flatten(self, tree: Any) -> dict[str, Any]:
        leaves = self.treedef.flatten_up_to(tree)
        return dict(zip(self.paths, leaves, strict=True))

    def unflatten(self, flat: Mapping[str, Any]) -> Any:
        return self.treedef.unflatten([flat[p] for p in self.paths])

    def sizes(self) -> dict[str, int]:
        """Elements per leaf, in treedef order."""
        return {p: math.prod(self.shapes[p]) for p in self.paths}

    def num_params(self) -> int:
        return sum(self.sizes().values())
