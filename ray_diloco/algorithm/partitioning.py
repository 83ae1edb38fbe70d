"""Layer: algorithm (pure, no Ray). The partitioning rules: which `PartitionSpec` each leaf
of a learner's parameters gets on its mesh, and what one device then holds.

Each parameter leaf gets its spec from the first of these that speaks for it:

1. the task's `sharding`: a function `(key path, shape) -> PartitionSpec | None`, or rules
   `[(regex, PartitionSpec), ...]` matched against the key path (the first match wins);
2. Flax partitioning metadata on the parameters (`nnx.with_partitioning`, Linen's
   `nn.with_partitioning` / `nn.with_logical_partitioning`);
3. the default, FSDP: a leaf of at least `min_shard_elements` is split over `fsdp` along its
   largest axis that `fsdp` divides; smaller leaves (biases, norm scales) are replicated.

Names that are not mesh axes (Linen's logical names, "embed", "mlp") go through the task's
`logical_axis_rules`, as in Flax and MaxText. The optimizer state takes its parameters' specs.
Everything here works from shapes alone: `device_bytes` is the arithmetic `ray-diloco plan`
checks against a chip's memory before any device is touched. `sharding.py` places the arrays.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec

from ray_diloco.algorithm.pytree import TreeLayout, path_string
from ray_diloco.config.mesh import MESH_AXES

if TYPE_CHECKING:
    from ray_diloco.task import Task

Sizes = Mapping[str, int]
SpecFn = Callable[[str, tuple[int, ...]], PartitionSpec | None]
SpecRules = Sequence[tuple[str, PartitionSpec]]


class ShardingError(ValueError):
    """A sharding that cannot be laid out: the message names the leaf and the fix."""


# -- which spec each leaf gets ---------------------------------------------------------------


def flax_annotations(tree: Any) -> dict[str, tuple[Any, ...]]:
    """The partitioning names Flax metadata gives the leaves of `tree` (abstract or concrete):
    NNX variables carry them as `out_sharding` (older Flax: `sharding`), Linen's
    `Partitioned` / `LogicallyPartitioned` boxes as `names`. Leaves without any are absent."""

    def names(node: Any) -> tuple[Any, ...] | None:
        if hasattr(node, "names") and hasattr(node, "unbox"):  # Linen AxisMetadata
            return tuple(node.names)
        if hasattr(node, "get_metadata") and hasattr(node, "value"):  # NNX Variable
            meta = node.get_metadata()
            found = meta.get("out_sharding") or meta.get("sharding")
            return tuple(found) if found else None
        return None

    with_paths, _ = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda node: names(node) is not None
    )
    out = {}
    for keypath, node in with_paths:
        found = names(node)
        if found is not None:
            # The box's value is its one leaf; the layout's key path drops its ".value".
            out[path_string((*keypath, jax.tree_util.GetAttrKey("value")))] = found
    return out


def default_spec(shape: tuple[int, ...], fsdp: int, min_elements: int) -> PartitionSpec:
    """FSDP: the largest axis `fsdp` divides carries it (the first of equal ones); a leaf
    below `min_elements` elements, or with no such axis, is replicated."""
    if fsdp == 1 or math.prod(shape) < min_elements:
        return PartitionSpec()
    fits = [i for i, n in enumerate(shape) if n % fsdp == 0]
    if not fits:
        return PartitionSpec()
    axis = max(fits, key=lambda i: (shape[i], -i))
    return PartitionSpec(*[("fsdp" if i == axis else None) for i in range(len(shape))])


def _from_task(task: Task, path: str, shape: tuple[int, ...]) -> PartitionSpec | None:
    rules = task.sharding
    if rules is None:
        return None
    if callable(rules):
        spec = rules(path, shape)
        if spec is not None and not isinstance(spec, PartitionSpec):
            raise ShardingError(
                f"Task.sharding returned {spec!r} for leaf {path!r}; return a "
                "jax.sharding.PartitionSpec or None"
            )
        return spec
    for pattern, spec in rules:
        if re.search(pattern, path):
            return spec if isinstance(spec, PartitionSpec) else PartitionSpec(*spec)
    return None


def _translate(
    path: str, names: Sequence[Any], logical: Sequence[tuple[str, Any]]
) -> PartitionSpec:
    """Mesh axes for a spec's names: mesh axis names stay, others go through the logical
    rules (the first rule whose axes this spec does not use yet, as Flax does)."""
    used: set[str] = set()
    out: list[Any] = []
    for entry in names:
        group = entry if isinstance(entry, tuple) else (entry,)
        axes: list[str] = []
        for name in group:
            if name is None or name == PartitionSpec.UNCONSTRAINED:
                continue
            if name in MESH_AXES:
                axes.append(name)
                continue
            targets = [t for n, t in logical if n == name]
            if not targets:
                raise ShardingError(
                    f"leaf {path!r}: axis name {name!r} is neither a mesh axis "
                    f"({', '.join(MESH_AXES)}) nor in Task.logical_axis_rules; add "
                    f"({name!r}, 'fsdp') or another mesh axis to the rules"
                )
            for target in targets:
                mapped = _axes(target)
                if not used & set(mapped) and not set(axes) & set(mapped):
                    axes.extend(mapped)
                    break
        used |= set(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*out)


def check_spec(path: str, shape: tuple[int, ...], spec: PartitionSpec, sizes: Sizes) -> None:
    """Raise ShardingError unless `spec` lays a leaf of `shape` out on a mesh of `sizes`."""
    if len(spec) > len(shape):
        raise ShardingError(
            f"leaf {path!r} of shape {shape}: PartitionSpec {spec} names {len(spec)} axes for "
            f"a {len(shape)}-d leaf; give at most {len(shape)}"
        )
    seen: list[str] = []
    for dim, entry in zip(shape, spec, strict=False):
        axes = _axes(entry)
        for axis in axes:
            if axis not in sizes:
                raise ShardingError(
                    f"leaf {path!r}: PartitionSpec {spec} names axis {axis!r}; the mesh has "
                    f"{', '.join(MESH_AXES)}"
                )
        seen.extend(axes)
        split = math.prod(sizes[a] for a in axes)
        if dim % split:
            raise ShardingError(
                f"leaf {path!r} of shape {shape}: {'x'.join(axes)} = {split} devices do not "
                f"divide its axis of {dim}; change the rule for this leaf or the mesh"
            )
    if len(set(seen)) != len(seen):
        raise ShardingError(f"leaf {path!r}: PartitionSpec {spec} uses a mesh axis twice")


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def leaf_specs(
    task: Task, tree: TreeLayout, abstract: Any, sizes: Sizes, min_shard_elements: int
) -> dict[str, PartitionSpec]:
    """Every leaf's spec on a mesh of `sizes` (see the module docstring for the order);
    `abstract` is `task.init`'s output (shapes only), for its Flax metadata. Raises
    ShardingError naming the leaf."""
    meta = flax_annotations(abstract)
    logical = tuple(task.logical_axis_rules)
    specs = {}
    for path in tree.paths:
        shape = tree.shapes[path]
        spec = _from_task(task, path, shape)
        if spec is None and path in meta:
            spec = PartitionSpec(*meta[path])
        if spec is None:
            spec = default_spec(shape, sizes["fsdp"], min_shard_elements)
        else:
            spec = _translate(path, tuple(spec), logical)
        check_spec(path, shape, spec, sizes)
        specs[path] = spec
    return specs


# -- what a device holds -----------------------------------------------------------------------


def shard_elements(shape: tuple[int, ...], spec: PartitionSpec, sizes: Sizes) -> int:
    """Elements of one device's shard of a leaf."""
    split = math.prod(sizes[a] for entry in spec for a in _axes(entry))
    return math.prod(shape) // split


def opt_state_specs(
    tx: optax.GradientTransformation, tree: TreeLayout, specs: Mapping[str, PartitionSpec]
) -> Any:
    """The optimizer state's specs: each parameter-shaped leaf (Adam's moments) takes its
    parameter's spec, everything else (step counts) is replicated. Shapes only."""
    abstract = tree.unflatten(
        {p: jax.ShapeDtypeStruct(tree.shapes[p], tree.dtypes[p]) for p in tree.paths}
    )
    state = jax.eval_shape(tx.init, abstract)
    return optax.tree_utils.tree_map_params(
        tx,
        lambda _, spec: spec,
        state,
        tree.unflatten(dict(specs)),
        transform_non_params=lambda _: PartitionSpec(),
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    ), state


def device_bytes(
    tx: optax.GradientTransformation,
    tree: TreeLayout,
    specs: Mapping[str, PartitionSpec],
    sizes: Sizes,
) -> dict[str, int]:
    """Bytes one device holds for the parameters, their gradients (one step's, the same
    layout) and the optimizer state."""
    params = sum(
        shard_elements(tree.shapes[p], specs[p], sizes) * np.dtype(tree.dtypes[p]).itemsize
        for p in tree.paths
    )
    state_specs, state = opt_state_specs(tx, tree, specs)
    leaves = jax.tree.leaves(state)
    leaf_specs_ = jax.tree.leaves(state_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    opt = sum(
        shard_elements(tuple(leaf.shape), spec, sizes) * np.dtype(leaf.dtype).itemsize
        for leaf, spec in zip(leaves, leaf_specs_, strict=True)
    )
    return {"params": params, "grads": params, "opt_state": opt}
