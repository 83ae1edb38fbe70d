"""The task contract: everything ray_diloco needs from a training job, and nothing more.

A task is what a user brings: parameters (any JAX pytree: a Flax NNX `nnx.State`, a Linen
params dict, plain nested dicts and lists), a loss, data and optionally an optax optimizer.
The orchestration (fragments, wire, merge, checkpoints) sees the parameters only through
`jax.tree_util` key paths, so no model's shape or leaf count is written anywhere else.

    from ray_diloco import Task

    def make_task(width: int = 64) -> Task:              # named in YAML: task: my_pkg.mod:make_task
        return Task(
            init=lambda rng: {"w": jax.random.normal(rng, (width, width))},
            loss=lambda params, batch: (jnp.mean((batch["x"] @ params["w"]) ** 2), {}),
            data=MyData(),                                # a DataSource (below)
        )

Data is a `DataSource`: `batches(part, num_parts, cursor, batch_size)` yields `(batch,
num_tokens)` pairs from one of `num_parts` disjoint, identically distributed parts of the
training data, starting at token offset `cursor` of that part, so a restarted learner resumes
exactly where the token ledger says it stopped; `heldout()` gives the fixed evaluation batches
the synchronizer scores the global parameters on. Pure: this module never imports Ray.
"""

from __future__ import annotations

import base64
import functools
import importlib
import inspect
import json
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import jax
import optax
import pydantic
from jax.sharding import PartitionSpec

from ray_diloco.config import ConfigError, format_validation_error

Params = Any  # any JAX pytree of arrays
Batch = Any  # any pytree of arrays whose leading axis is the batch
LossFn = Callable[[Params, Batch], tuple[jax.Array, Mapping[str, jax.Array]]]
ShardingRules = (
    Callable[[str, tuple[int, ...]], PartitionSpec | None] | Sequence[tuple[str, PartitionSpec]]
)

# Leaves whose rows are updated sparsely (token/position embeddings, output projections) merge
# with a plain weighted mean instead of RDA (docs/algorithm.md sections 3 and 6).
_EMBEDDING = re.compile(r"embed|wte|wpe|lm_head", re.IGNORECASE)


def is_embedding(path: str) -> bool:
    """The default `Task.merge_with_mean`: key paths that name an embedding or the output head
    (`embed/embedding`, `pos_embed`, `unembed/kernel`, `wte`, `lm_head/kernel`, ...)."""
    return bool(_EMBEDDING.search(path))


@runtime_checkable
class DataSource(Protocol):
    """Training and held-out data of a task.

    `tokens_per_example`: tokens in one example (the sequence length for a language model, 1
    where "tokens" are examples); with a learner's `batch_size` it sizes the learning-rate
    schedule and the data-parallel bandwidth baseline before any batch is read.
    """

    tokens_per_example: int

    def batches(
        self, part: int, num_parts: int, cursor: int, batch_size: int
    ) -> Iterator[tuple[Batch, int]]:
        """Batches of `batch_size` examples from part `part` of `num_parts` disjoint parts,
        from token offset `cursor` of that part on, each with its number of tokens. A pure
        function of its arguments: the same cursor gives the same batches."""
        ...

    def heldout(self) -> Iterable[Batch]:
        """The held-out batches, the same in every process and every run."""
        ...


@dataclass(frozen=True, eq=False)  # compared and hashed by identity (caches key on it)
class Task:
    """A training job as ray_diloco sees it.

    init: `rng -> params`, deterministic in the key (every process builds the same start).
    loss: `(params, batch) -> (scalar loss, metrics dict)`, pure and jittable.
    data: the `DataSource`.
    optimizer: `total_inner_steps -> optax.GradientTransformation` for the inner loop; None
        takes the config's AdamW (`inner:` section).
    merge_with_mean: key path -> True for leaves merged with the weighted mean instead of RDA
        (default: embeddings and output heads, `is_embedding`).
    sharding: how each leaf is laid out over the learner's mesh (axes "data", "fsdp",
        "tensor"): `(key path, shape) -> PartitionSpec | None`, or `[(regex, PartitionSpec)]`
        rules matched against the key path; None (the leaf, or the whole field) falls back to
        the leaf's Flax partitioning metadata, then to FSDP (algorithm/partitioning.py).
    logical_axis_rules: `[(logical name, mesh axis or None)]` for names in the specs or
        metadata that are not mesh axes (Flax/MaxText style: `("embed", "fsdp")`).
    """

    init: Callable[[jax.Array], Params]
    loss: LossFn
    data: DataSource
    optimizer: Callable[[int], optax.GradientTransformation] | None = None
    merge_with_mean: Callable[[str], bool] = is_embedding
    name: str = "task"
    sharding: ShardingRules | None = None
    logical_axis_rules: Sequence[tuple[str, str | tuple[str, ...] | None]] = ()


TaskFactory = Callable[..., Task]
_BY_VALUE = "cloudpickle:"  # a factory carried inside the config (see `task_spec`)


def task_spec(factory: str | TaskFactory) -> str:
    """The config's `task` string for a factory: "module:qualname" when other processes can
    import it by that name, else the factory itself serialised by value (a factory defined in
    a script's `__main__` or a notebook cell, as Ray ships remote functions)."""
    if isinstance(factory, str):
        return factory
    module, qualname = getattr(factory, "__module__", ""), getattr(factory, "__qualname__", "")
    if module and module != "__main__" and "<" not in qualname:
        try:
            found: Any = importlib.import_module(module)
            for part in qualname.split("."):
                found = getattr(found, part)
        except (ImportError, AttributeError):
            found = None
        if found is factory:
            return f"{module}:{qualname}"
    import cloudpickle  # only for factories that cannot be named

    return _BY_VALUE + base64.b64encode(cloudpickle.dumps(factory)).decode()


def load_task(spec: str | TaskFactory, args: Mapping[str, Any]) -> Task:
    """Build the task named by `spec` ("package.module:factory", or the factory itself) with
    `args` as keyword arguments. The module must be importable where the learners run:
    installed, or under the current directory (a `ray job submit --working-dir`, which Ray
    makes every worker's current directory). Every problem becomes one ConfigError naming
    `task` or `task_args`."""
    factory = _resolve(spec) if isinstance(spec, str) else spec
    return _build(factory, json.dumps(dict(args), sort_keys=True, default=str))


@functools.lru_cache(maxsize=8)
def _build(factory: TaskFactory, args_json: str) -> Task:
    # Cached: the reference run and the benchmarks build the same task for every variant, and
    # one Task object means one compiled inner step per process instead of one per variant.
    args = json.loads(args_json)
    name = getattr(factory, "__qualname__", repr(factory))
    try:
        inspect.signature(factory).bind(**args)
    except TypeError as err:
        raise ConfigError(f"task_args: {err} (the arguments of {name}); fix task_args") from None
    except ValueError:  # no signature (a builtin): let the call say what is wrong
        pass
    try:
        task = factory(**args)
    except pydantic.ValidationError as err:
        raise ConfigError(
            format_validation_error(err, f"task_args of {name}", "task_args.")
        ) from None
    except ConfigError:
        raise
    except (ValueError, TypeError, OSError) as err:
        raise ConfigError(f"task: {name}(**task_args) failed: {err}") from None
    if not isinstance(task, Task):
        raise ConfigError(
            f"task: {name} returned {type(task).__name__}, not a ray_diloco.Task; return "
            "Task(init=..., loss=..., data=...)"
        )
    if not isinstance(task.data, DataSource):
        raise ConfigError(
            f"task: {name} returned a Task whose data ({type(task.data).__name__}) lacks "
            "tokens_per_example, batches() or heldout() (see ray_diloco.task.DataSource)"
        )
    if not isinstance(task.data.tokens_per_example, int) or task.data.tokens_per_example < 1:
        raise ConfigError(
            f"task: {name}'s data.tokens_per_example={task.data.tokens_per_example!r} must be "
            "an int >= 1 (the sequence length of a language model)"
        )
    return task


def _resolve(spec: str) -> TaskFactory:
    if spec.startswith(_BY_VALUE):
        import cloudpickle

        try:
            factory: TaskFactory = cloudpickle.loads(base64.b64decode(spec[len(_BY_VALUE) :]))
        except Exception as err:
            raise ConfigError(
                f"task: the factory carried by value cannot be loaded here ({err}); name it "
                "by import path instead ('package.module:factory')"
            ) from None
        return factory
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(
            f"task={spec!r}: expected 'package.module:factory', e.g. "
            "'ray_diloco.tasks.byte_lm:make_task'"
        )
    cwd = str(Path.cwd())
    if cwd not in sys.path and "" not in sys.path:
        # A console script's sys.path lacks the current directory (Ray workers and `python -m`
        # have it); appended, it never shadows an installed package.
        sys.path.append(cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):
            raise ConfigError(
                f"task={spec!r}: no module {err.name!r} under the current directory "
                f"({cwd}) or on sys.path; fix the module path, run from the directory that "
                "holds the package, or install it"
            ) from None
        raise ConfigError(f"task={spec!r}: importing {module_name} failed: {err}") from None
    except Exception as err:  # the user's module raised while importing
        raise ConfigError(
            f"task={spec!r}: importing {module_name} raised {type(err).__name__}: {err}"
        ) from None
    found = getattr(module, attr, None)
    if not callable(found):
        raise ConfigError(f"task={spec!r}: {module_name} has no callable {attr!r}")
    return found
