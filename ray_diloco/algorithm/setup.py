"""Layer: algorithm (pure, no Ray). What every process of a run builds from its config: the
task (ray_diloco/task.py), its initial parameters as a flat dict, their fragments, and the
held-out evaluation. The synchronizer actor, the learners and the in-process reference run all
start here, so they agree on the parameters, the fragments and the data by construction.

`check_task` is what the driver runs before any actor starts: it builds the task, fragments its
parameters, computes one training loss, evaluates the held-out set and reads a few examples
twice, so a bad import path, a factory returning the wrong thing, a pytree that cannot be cut
into `num_fragments`, a held-out set that is not a list of batches, a data source whose examples
move with the batching or a non-finite first loss ends the run with one error line (naming
what failed) instead of a crashed actor. `fitted_config` gives a task with fewer parameter
leaves than the default fragment count one fragment per leaf.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec

from ray_diloco.algorithm import inner, partitioning, sharding
from ray_diloco.algorithm.fragments import FragmentPlan, plan_fragments
from ray_diloco.algorithm.pytree import TreeLayout
from ray_diloco.config import ConfigError, InnerOptimizerConfig, LearnerGroupConfig, RunConfig
from ray_diloco.task import Batch, Task, load_task


def task_of(cfg: RunConfig) -> Task:
    return load_task(cfg.task, cfg.task_args)


def init_key(cfg: RunConfig) -> jax.Array:
    """The key every process initialises the parameters from (the same start everywhere)."""
    return jax.random.key(cfg.seed)


@contextlib.contextmanager
def annotations_only() -> Iterator[None]:
    """Flax >= 0.12 shards an annotated NNX variable as it is created, which needs a mesh in
    context; ray_diloco reads the annotations and lays the leaves out itself
    (algorithm/partitioning.py), so `task.init` runs with that off."""
    try:
        from flax import nnx
    except ImportError:  # a task without Flax
        yield
        return
    with nnx.use_eager_sharding(False):
        yield


def init_params(cfg: RunConfig, task: Task) -> Any:
    """`task.init` at the run's key: the parameters every process starts from."""
    with annotations_only():
        return task.init(init_key(cfg))


def abstract_params(cfg: RunConfig, task: Task) -> Any:
    """`task.init`'s output by abstract evaluation (shapes, dtypes and Flax metadata): no
    parameter is computed. ConfigError when init fails."""
    return _abstract_params(task, cfg.task, cfg.seed)


# Cached per Task object (compared by identity; `load_task` gives the same one for the same
# factory and arguments) and seed: one TreeLayout object per task means one compiled step and
# evaluation per process (`learner_core._compiled_step`, `_layout`, `inner.make_eval_fn` key
# on it), where a new layout per run traced and lowered them again for every in-process run.
@functools.lru_cache(maxsize=16)
def _abstract_params(task: Task, spec: str, seed: int) -> Any:
    try:
        with annotations_only():
            return jax.eval_shape(task.init, jax.random.key(seed))
    except Exception as err:
        raise ConfigError(f"task: {spec} init(rng) failed: {type(err).__name__}: {err}") from None


def layout_of(cfg: RunConfig, task: Task | None = None) -> TreeLayout:
    """The parameters' structure by abstract evaluation of `task.init` (a host that receives
    its parameters needs only the layout)."""
    return _tree_layout(task or task_of(cfg), cfg.task, cfg.seed)


@functools.lru_cache(maxsize=16)
def _tree_layout(task: Task, spec: str, seed: int) -> TreeLayout:
    try:
        return TreeLayout.of(_abstract_params(task, spec, seed))
    except ValueError as err:
        raise ConfigError(f"task: {spec}: {err}") from None


def fragment_plan(cfg: RunConfig, task: Task | None = None) -> FragmentPlan:
    """The run's fragments (docs/algorithm.md section 3), from the parameters' shapes alone."""
    task = task or task_of(cfg)
    return _plan(cfg, task, layout_of(cfg, task))


def _plan(cfg: RunConfig, task: Task, layout: TreeLayout) -> FragmentPlan:
    mean_leaves = [p for p in layout.paths if task.merge_with_mean(p)]
    try:
        return plan_fragments(layout.sizes(), cfg.diloco.num_fragments, mean_leaves)
    except ValueError as err:  # it names diloco.num_fragments where the count is at fault
        raise ConfigError(f"{err} (task {cfg.task})") from None


def fitted_config(cfg: RunConfig, task: Task | None = None) -> RunConfig:
    """`cfg` with the default `diloco.num_fragments` lowered to the task's parameter leaves
    where it has fewer (a leaf is never split); a count the config sets is kept as it is (and
    refused by `fragment_plan` if it does not fit). Every process of a run gets the fitted
    config from its driver, so they agree on it."""
    if "num_fragments" in cfg.diloco.model_fields_set:
        return cfg
    leaves = len(layout_of(cfg, task).paths)
    if leaves >= cfg.diloco.num_fragments:
        return cfg
    diloco = cfg.diloco.model_copy(update={"num_fragments": leaves})
    return cfg.model_copy(update={"diloco": diloco})


def learner_specs(
    cfg: RunConfig,
    task: Task,
    lg: LearnerGroupConfig,
    sizes: Mapping[str, int] | None = None,
    tree: TreeLayout | None = None,
) -> dict[str, PartitionSpec]:
    """Each leaf's PartitionSpec on learner `lg`'s mesh (`sizes`, default its config's);
    ConfigError naming the learner and the leaf when the task's rules do not fit it."""
    tree = tree or layout_of(cfg, task)
    try:
        return partitioning.leaf_specs(
            task,
            tree,
            abstract_params(cfg, task),
            sizes or lg.mesh_sizes,
            lg.mesh.min_shard_elements,
        )
    except partitioning.ShardingError as err:
        raise ConfigError(f"learners: {lg.name!r} (mesh {lg.mesh.describe()}): {err}") from None


def learner_layout(
    cfg: RunConfig,
    task: Task,
    tree: TreeLayout,
    lg: LearnerGroupConfig,
    devices: Sequence[Any] | None = None,
) -> sharding.ShardedLayout:
    """Learner `lg`'s layout over `devices` (on Ray: every device of its hosts). The in-process
    runs pass None: the learner takes as many of the process's devices as its mesh has, or,
    where the process has fewer, one device (the same math, replicated)."""
    if devices is None:
        available = jax.devices()
        enough = len(available) >= lg.num_devices
        devices = available[: lg.num_devices] if enough else available[:1]
    if len(devices) == lg.num_devices:
        sizes = lg.mesh_sizes
    elif len(devices) == 1:
        sizes = dict.fromkeys(lg.mesh_sizes, 1)
    else:
        raise ConfigError(
            f"learners: {lg.name!r} has {lg.num_devices} devices in its config "
            f"({lg.num_hosts} host(s) x {lg.host_devices}) but JAX sees {len(devices)}; "
            "set devices_per_host to what each host has"
        )
    specs = learner_specs(cfg, task, lg, sizes, tree)
    return _layout(tree, tuple(specs.items()), tuple(sorted(sizes.items())), tuple(devices))


@functools.lru_cache(maxsize=16)
def _layout(
    tree: TreeLayout,
    specs: tuple[tuple[str, PartitionSpec], ...],
    sizes: tuple[tuple[str, int], ...],
    devices: tuple[Any, ...],
) -> sharding.ShardedLayout:
    # One layout (so one compiled step) for every learner of the process with the same mesh:
    # the reference run has M of them.
    return sharding.ShardedLayout(sharding.make_mesh(dict(sizes), devices), dict(specs), tree)


def tokens_per_step(task: Task, learner: LearnerGroupConfig) -> int:
    """Tokens in one inner step of `learner` (its batch of examples)."""
    return learner.batch_size * task.data.tokens_per_example


def total_inner_steps(cfg: RunConfig, task: Task) -> int:
    """Inner steps each learner takes if every learner shares the token budget (or
    `inner.decay_tokens`) by batch size; the length of the default learning-rate schedule."""
    total_batch = sum(lg.batch_size for lg in cfg.learners)
    tokens = cfg.inner.decay_tokens or cfg.token_budget
    return max(1, tokens // (total_batch * task.data.tokens_per_example))


def learning_rate(cfg: RunConfig, task: Task) -> Callable[[int], float] | None:
    """The inner learning rate at a learner's inner step, as the config's AdamW schedules it
    (a restarted learner resumes its schedule at its step, learner_core.py); None for a task
    that brings its own optimizer, whose schedule is its own."""
    if task.optimizer is not None:
        return None
    schedule = inner.make_lr_schedule(cfg.inner, total_inner_steps(cfg, task))
    return lambda step: float(schedule(step))


@dataclass
class Setup:
    """What every process of a run shares: the task, initial parameters, fragments and the
    held-out evaluation."""

    cfg: RunConfig
    task: Task
    layout: TreeLayout
    init: dict[str, np.ndarray]  # float32, host
    plan: FragmentPlan
    eval_fn: inner.EvalFn = field(repr=False)

    @classmethod
    def build(cls, cfg: RunConfig) -> Setup:
        task = task_of(cfg)
        layout = layout_of(cfg, task)
        flat = layout.flatten(init_params(cfg, task))
        init = {k: np.asarray(v, np.float32) for k, v in flat.items()}
        plan = _plan(cfg, task, layout)
        return cls(cfg, task, layout, init, plan, inner.make_eval_fn(task, layout))

    @functools.cached_property
    def heldout(self) -> list[Batch]:
        batches = list(self.task.data.heldout())
        if not batches:
            raise ConfigError(f"task: {self.cfg.task}: data.heldout() gave no batch")
        return batches

    def evaluate(self, params: dict[str, Any]) -> float:
        return inner.evaluate(self.eval_fn, params, self.heldout)

    def num_params(self) -> int:
        return self.layout.num_params()

    def param_bytes(self) -> int:
        return 4 * self.num_params()


def check_task(cfg: RunConfig) -> dict[str, Any]:
    """Build the task and fragment its parameters, then train-loss one batch of the first
    learner, evaluate the held-out set and check that examples are addressable: every problem
    is one ConfigError naming what failed and the fix. Returns what was found (parameters,
    leaves, first loss), for the run's log."""
    setup = Setup.build(cfg)
    for learner in cfg.learners:  # each mesh can lay the parameters out
        learner_specs(cfg, setup.task, learner, tree=setup.layout)
    lg = cfg.learners[0]
    batch, num_tokens = next(setup.task.data.batches(0, cfg.num_learners, 0, lg.batch_size))
    if not isinstance(num_tokens, int | np.integer) or num_tokens <= 0:
        raise ConfigError(
            f"task: {cfg.task}: data.batches() yielded num_tokens={num_tokens!r}; it must be a "
            "positive int (the tokens in the batch)"
        )
    tx, step = _first_step(setup.task, setup.layout, cfg.inner, total_inner_steps(cfg, setup.task))
    params = {k: jax.numpy.asarray(v, setup.layout.dtypes[k]) for k, v in setup.init.items()}
    try:
        loss = float(step(params, inner.init_opt_state(tx, setup.layout, params), batch)[2])
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(
            f"task: {cfg.task}: the first training step failed: {type(err).__name__}: {err}"
        ) from None
    heldout = _check_heldout(cfg, setup)
    if not (math.isfinite(loss) and math.isfinite(heldout)):
        raise ConfigError(
            f"task: {cfg.task}: the first training loss is {loss} and the held-out loss "
            f"{heldout} at initialisation; fix the model's init or loss (or lower inner.lr)"
        )
    _check_addressable(cfg, setup.task, cfg.num_learners, lg.batch_size)
    return {
        "task": cfg.task,
        "num_params": setup.num_params(),
        "num_leaves": len(setup.layout.paths),
        "first_loss": loss,
        "tokens_per_batch": int(num_tokens),
    }


@functools.lru_cache(maxsize=8)
def _first_step(
    task: Task, layout: TreeLayout, inner_cfg: InnerOptimizerConfig, total_steps: int
) -> tuple[optax.GradientTransformation, inner.TrainStep]:
    # One per task, layout and schedule in a process: the driver checks the task before every
    # run, and a test process drives many runs of the same task.
    tx = inner.inner_optimizer(task, inner_cfg, total_steps)
    return tx, inner.make_train_step(task, layout, tx)


HELDOUT_SHAPE = "data.heldout() must give a list of batches (`[batch]` for one), not a batch"


def _check_heldout(cfg: RunConfig, setup: Setup) -> float:
    """The held-out loss of the initial parameters; a ConfigError naming the evaluation."""
    try:
        first = setup.heldout[0]
        if isinstance(first, str | bytes):  # the keys of a dict given as the batch
            raise ConfigError(f"task: {cfg.task}: {HELDOUT_SHAPE} (it gave {first!r} first)")
        return setup.evaluate(setup.init)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(
            f"task: {cfg.task}: the held-out evaluation failed: {type(err).__name__}: {err}; "
            f"{HELDOUT_SHAPE}, each one the loss takes"
        ) from None


def _check_addressable(cfg: RunConfig, task: Task, num_parts: int, size: int) -> None:
    """Examples are addressable (the DataSource contract, ray_diloco/task.py): `2 * size`
    examples read as one batch, as two batches of `size`, and the second of those read again
    from the cursor the first ended at, are the same examples. A learner's batch may span two
    leases, and a restarted learner reads from its ledger cursor: a source that breaks this
    trains on other data than the ledger counts."""
    data = task.data
    whole, _ = next(data.batches(0, num_parts, 0, 2 * size))
    halves = data.batches(0, num_parts, 0, size)
    (first, first_tokens), (second, _) = next(halves), next(halves)
    resumed, _ = next(data.batches(0, num_parts, int(first_tokens), size))
    joined = jax.tree.map(
        lambda a, b: np.concatenate([np.asarray(a), np.asarray(b)]), first, second
    )
    reads = {
        f"one batch of {2 * size} against two of {size}": (whole, joined),
        f"the second batch of {size} against a read from cursor {first_tokens}": (second, resumed),
    }
    for what, (a, b) in reads.items():
        left, right = (jax.tree_util.tree_leaves_with_path(t) for t in (a, b))
        same = [p for p, _ in left] == [p for p, _ in right] and all(
            np.shape(x) == np.shape(y) and np.array_equal(np.asarray(x), np.asarray(y))
            for (_, x), (_, y) in zip(left, right, strict=True)
        )
        if not same:
            raise ConfigError(
                f"task: {cfg.task}: data.batches() gives other examples for {what}; example e "
                "of a part must be the same whichever batch it falls in and from whichever "
                "cursor it is read (derive each example from its index, not from the batch)"
            )
