"""Layer: algorithm (pure, no Ray). How a learner lays its arrays over every chip of its slice.

A learner builds one `jax.sharding.Mesh` over every device of every host it has, with the axes
of its config (`mesh: {data, fsdp, tensor}`, config/schema.py). Each parameter leaf gets a
`PartitionSpec` from the first of these that speaks for it:

1. the task's `sharding`: a function `(key path, shape) -> PartitionSpec | None`, or rules
   `[(regex, PartitionSpec), ...]` matched against the key path (the first match wins);
2. Flax partitioning metadata on the parameters (`nnx.with_partitioning`, Linen's
   `nn.with_partitioning` / `nn.with_logical_partitioning`);
3. the default, FSDP: a leaf of at least `min_shard_elements` is split over `fsdp` along its
   largest axis that `fsdp` divides; smaller leaves (biases, norm scales) are replicated.

Names that are not mesh axes (Linen's logical names, "embed", "mlp") go through the task's
`logical_axis_rules`, as in Flax and MaxText. The optimizer state takes its parameters'
shardings, the batch is split over `data` x `fsdp` on its leading axis, and the loss comes back
replicated. `ShardedLayout` does the placing; `device_bytes` is the arithmetic `ray-diloco
plan` checks against a chip's memory, from shapes alone.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ray_diloco.algorithm.pytree import TreeLayout, path_string
from ray_diloco.config.mesh import MESH_AXES

if TYPE_CHECKING:
    from ray_diloco.task import Task

Sizes = Mapping[str, int]
BATCH_AXES = ("data", "fsdp")
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


# -- placing arrays on the mesh ---------------------------------------------------------------


def make_mesh(sizes: Sizes, devices: Sequence[Any]) -> Mesh:
    """The learner's mesh, axes outermost first (data across hosts, tensor innermost)."""
    from jax.experimental import mesh_utils

    shape = tuple(sizes[a] for a in MESH_AXES)
    try:
        grid = mesh_utils.create_device_mesh(shape, devices=list(devices))
    except (ValueError, NotImplementedError, AssertionError):  # no topology to follow (CPU)
        grid = np.array(list(devices)).reshape(shape)
    return Mesh(grid, MESH_AXES)


class ShardedLayout:
    """Where a learner's arrays live: parameters by `specs` on `mesh`, the optimizer state by
    its parameters', batches split over data x fsdp. Every process of a multi-host learner
    builds its own shards from the same host values (`make_array_from_callback` asks only for
    what it addresses), so no host ever sends another a parameter."""

    def __init__(self, mesh: Mesh, specs: Mapping[str, PartitionSpec], tree: TreeLayout) -> None:
        self.mesh, self.tree = mesh, tree
        self.specs = dict(specs)
        self.shardings = {p: NamedSharding(mesh, spec) for p, spec in self.specs.items()}
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.batch_sharding = NamedSharding(mesh, PartitionSpec(BATCH_AXES))
        self._gather = jax.jit(lambda x: x, out_shardings=self.replicated)

    @property
    def num_devices(self) -> int:
        return int(self.mesh.devices.size)

    def param(self, path: str, host: np.ndarray) -> jax.Array:
        """A host value of leaf `path` (any float dtype) on the mesh, in the task's dtype."""
        value = np.asarray(host).astype(self.tree.dtypes[path], copy=False)
        return jax.make_array_from_callback(value.shape, self.shardings[path], value.__getitem__)

    def batch(self, batch: Any) -> Any:
        """Every host holds the same global batch (a pure function of the cursor) and gives
        the mesh its rows: the learner's batch is that of a one-device learner."""

        def place(leaf: Any) -> jax.Array:
            leaf = np.asarray(leaf)
            sharding = self.batch_sharding if leaf.ndim else self.replicated
            return jax.make_array_from_callback(leaf.shape, sharding, leaf.__getitem__)

        return jax.tree.map(place, batch)

    def mix(self, path: str, alpha: float, current: jax.Array, host: np.ndarray) -> jax.Array:
        """alpha * current + (1 - alpha) * host, laid out as the leaf."""
        return _axpby(self.shardings[path])(alpha, current, 1 - alpha, self.param(path, host))

    def difference(self, path: str, current: jax.Array, host: np.ndarray) -> jax.Array:
        """current - host computed in float32, in the leaf's dtype and layout."""
        ref = jax.make_array_from_callback(
            host.shape, self.shardings[path], np.asarray(host, np.float32).__getitem__
        )
        return _difference(self.shardings[path], np.dtype(self.tree.dtypes[path]))(current, ref)

    def add(self, path: str, current: jax.Array, other: jax.Array) -> jax.Array:
        return _axpby(self.shardings[path])(1.0, current, 1.0, other)

    def start_copy(self, array: jax.Array) -> jax.Array:
        """Start bringing `array` to this host without waiting: a copy a later `host` call
        finds done. A leaf this process does not address whole (sharded over several hosts)
        is first gathered to every device (one collective every host of the learner runs at
        the same step: fragments fall due by step count)."""
        if array.is_fully_addressable:
            array = _copy(array)  # the step donates the parameters: the offer keeps its own
        else:
            array = self._gather(array).addressable_data(0)
        array.copy_to_host_async()
        return array

    @staticmethod
    def host(array: jax.Array) -> np.ndarray:
        return np.asarray(array)

    # -- the optimizer state and the step, both with explicit shardings ----------------------

    def state_shardings(self, tx: optax.GradientTransformation) -> Any:
        specs, _ = opt_state_specs(tx, self.tree, self.specs)
        return jax.tree.map(
            lambda s: NamedSharding(self.mesh, s),
            specs,
            is_leaf=lambda x: isinstance(x, PartitionSpec),
        )

    def init_opt_state(
        self, tx: optax.GradientTransformation, params: Mapping[str, jax.Array], step: int
    ) -> Any:
        """The optimizer state born sharded (never materialised replicated), every step count
        moved to `step` (a restarted learner continues its schedule)."""
        return _init_fn(self, tx, step > 0)(dict(params), jnp.asarray(step, jnp.int32))

    def jit_step(self, step: Callable[..., Any], tx: optax.GradientTransformation) -> Any:
        """`step(flat params, opt_state, batch)` jitted with this layout's shardings in and
        out (the same input layouts on every call, so it compiles once), donating the
        parameters and the optimizer state: a chip holds one copy of them, not two. (JAX
        keeps a buffer that a host view still reads, and copies it instead.)"""
        params, state = self.shardings, self.state_shardings(tx)
        return jax.jit(
            step,
            in_shardings=(params, state, self.batch_sharding),
            out_shardings=(params, state, self.replicated),
            donate_argnums=(0, 1),
        )


    def compile_ahead(self, step: Any, tx: optax.GradientTransformation, batch: Any) -> None:
        """Compile `jit_step`'s `step` and the fresh optimizer state's init from shapes alone,
        before any value exists (a learner host does it while the synchronizer it registers
        with is still starting): its first real step then finds both compiled."""
        params = {
            p: jax.ShapeDtypeStruct(self.tree.shapes[p], self.tree.dtypes[p], sharding=s)
            for p, s in self.shardings.items()
        }
        _, state = opt_state_specs(tx, self.tree, self.specs)
        state = jax.tree.map(
            lambda leaf, s: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s),
            state,
            self.state_shardings(tx),
        )
        batch = jax.tree.map(
            lambda leaf: jax.ShapeDtypeStruct(
                np.shape(leaf),
                np.asarray(leaf).dtype,
                sharding=self.batch_sharding if np.ndim(leaf) else self.replicated,
            ),
            batch,
        )
        step.lower(params, state, batch).compile()
        _init_fn(self, tx, False).lower(params, jax.ShapeDtypeStruct((), jnp.int32)).compile()


_copy = jax.jit(jnp.copy)


@functools.lru_cache(maxsize=64)
def _axpby(sharding: NamedSharding) -> Any:
    return jax.jit(lambda a, x, b, y: a * x + b * y, out_shardings=sharding)


@functools.lru_cache(maxsize=64)
def _difference(sharding: NamedSharding, dtype: np.dtype) -> Any:
    return jax.jit(lambda x, y: (x.astype(jnp.float32) - y).astype(dtype), out_shardings=sharding)


@functools.lru_cache(maxsize=16)
def _init_fn(layout: ShardedLayout, tx: optax.GradientTransformation, moved: bool) -> Any:
    def init(flat: dict[str, jax.Array], step: jax.Array) -> Any:
        state = tx.init(layout.tree.unflatten(flat))
        # Adam's count too: with its moments at zero and no bias correction, a restart's first
        # steps are ~0.45 of a corrected one (b1 0.9, b2 0.95), which measured better than
        # correcting them (goodput benchmark, decoupled, aggressive: 2.538 against 2.570).
        return optax.tree_utils.tree_set(state, count=step) if moved else state

    return jax.jit(init, out_shardings=layout.state_shardings(tx))


@dataclass(frozen=True)
class LayoutReport:
    """How a learner's arrays sit on its mesh, measured on the live arrays of one host:
    what one device holds of each leaf (`shards`: 0.25 is a quarter) and of the optimizer
    state of each leaf (`state_shards`: the largest fraction over that leaf's moments)."""

    mesh: dict[str, int]
    num_devices: int
    host_devices: int
    param_bytes_per_device: int
    state_bytes_per_device: int
    shards: dict[str, float]
    state_shards: dict[str, float]


def layout_report(
    layout: ShardedLayout,
    tx: optax.GradientTransformation,
    params: Mapping[str, jax.Array],
    opt_state: Any,
) -> LayoutReport:
    def held(array: jax.Array) -> tuple[int, float]:
        shard = array.addressable_shards[0].data
        return shard.nbytes, shard.size / max(array.size, 1)

    shards = {p: held(params[p]) for p in layout.tree.paths}
    paths = layout.tree.unflatten({p: p for p in layout.tree.paths})
    per_leaf = optax.tree_utils.tree_map_params(
        tx,
        lambda leaf, path: (path, held(leaf)),
        opt_state,
        paths,
        transform_non_params=lambda leaf: ("", held(leaf)),
    )
    state_shards: dict[str, float] = {}
    state_bytes = 0
    for path, (nbytes, fraction) in jax.tree.leaves(
        per_leaf, is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str)
    ):
        state_bytes += nbytes
        if path:
            state_shards[path] = max(state_shards.get(path, 0.0), fraction)
    return LayoutReport(
        mesh=dict(zip(layout.mesh.axis_names, layout.mesh.devices.shape, strict=True)),
        num_devices=layout.num_devices,
        host_devices=len(layout.mesh.local_devices),
        param_bytes_per_device=sum(nbytes for nbytes, _ in shards.values()),
        state_bytes_per_device=state_bytes,
        shards={p: fraction for p, (_, fraction) in shards.items()},
        state_shards=state_shards,
    )
