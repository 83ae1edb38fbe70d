"""A learner trains on every device of its slice (algorithm/sharding.py, LearnerCore): its mesh
over the process's CPU devices (tests/conftest.py gives each test process 8), parameters and
Adam's moments sharded by the task's rules or FSDP, a received fragment laid back out as its
leaf, one compilation of the step, and the same losses as one device."""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ray_diloco.algorithm import partitioning, sharding, wire
from ray_diloco.algorithm.downstream import Message
from ray_diloco.algorithm.learner_core import LearnerCore, compile_ahead
from ray_diloco.algorithm.setup import Setup, check_task, learner_layout
from ray_diloco.config import ConfigError, load_config
from ray_diloco.sim.simulate import run_reference
from ray_diloco.task import Task
from tests.sync_helpers import TINY

# Wide enough that every matrix has a dimension 4 divides, small enough for 2 cores.
SHARDED = [*TINY, "task_args.model.d_model=32", "task_args.model.d_ff=64"]


def _mesh(devices: int, **axes: int) -> list[str]:
    over = [f"learners.{i}.devices_per_host={devices}" for i in range(4)]
    over += [f"learners.{i}.mesh.min_shard_elements=256" for i in range(4)]
    return over + [f"learners.{i}.mesh.{a}={n}" for i in range(4) for a, n in axes.items()]


def _core(cfg: Any, setup: Setup) -> LearnerCore:
    snapshot = {
        p: (0, {k: np.asarray(setup.init[k], np.float32) for k in paths})
        for p, paths in enumerate(setup.plan.fragments)
    }
    return LearnerCore(cfg, cfg.learners[0], setup.task, setup.layout, setup.plan, snapshot)


def _fraction(array: jax.Array) -> float:
    """What one device holds of the array."""
    shard = array.addressable_shards[0].data
    return shard.size / array.size


def test_the_test_process_has_a_slice_of_devices() -> None:
    assert len(jax.devices()) >= 4


def test_every_large_leaf_and_both_adam_moments_are_a_quarter_per_device() -> None:
    cfg = load_config(None, [*SHARDED, *_mesh(4)])
    setup = Setup.build(cfg)
    core = _core(cfg, setup)
    assert core.layout.num_devices == 4
    large = [k for k in setup.layout.paths if setup.layout.sizes()[k] >= 256]
    assert len(large) >= 8  # the matrices and embeddings
    for k in setup.layout.paths:
        assert _fraction(core.params[k]) == (0.25 if k in large else 1.0), k
    adam = core.opt_state[1][0]  # clip, then adamw's chain: ScaleByAdamState first
    for moments in (adam.mu, adam.nu):
        for k in large:
            assert moments[k].sharding == core.params[k].sharding, k
            assert _fraction(moments[k]) == 0.25, k
    assert adam.count.sharding.is_fully_replicated


def test_a_tensor_parallel_rule_from_the_task_is_applied() -> None:
    cfg = load_config(None, [*SHARDED, *_mesh(4, fsdp=2, tensor=2)])
    setup = Setup.build(cfg)
    rules = [(r"mlp/up/kernel$", P("fsdp", "tensor")), (r"mlp/down/kernel$", P("tensor", "fsdp"))]
    task = Task(setup.task.init, setup.task.loss, setup.task.data, sharding=rules)
    specs = partitioning.leaf_specs(task, setup.layout, None, cfg.learners[0].mesh_sizes, 256)
    up, down = "blocks/0/mlp/up/kernel", "blocks/0/mlp/down/kernel"
    assert specs[up] == P("fsdp", "tensor") and specs[down] == P("tensor", "fsdp")
    assert specs["blocks/0/attn/q/kernel"] == P("fsdp", None)  # the default for the rest
    layout = sharding.ShardedLayout(
        sharding.make_mesh(cfg.learners[0].mesh_sizes, jax.devices()[:4]), specs, setup.layout
    )
    placed = layout.param(up, setup.init[up])
    assert placed.addressable_shards[0].data.shape == (16, 32)  # (32, 64) over 2 x 2
    np.testing.assert_array_equal(np.asarray(placed), setup.init[up])


def test_flax_metadata_and_logical_rules_lay_the_leaves_out() -> None:
    import flax.linen as nn
    from flax import nnx

    from ray_diloco.algorithm.pytree import TreeLayout
    from ray_diloco.algorithm.setup import annotations_only

    init = nnx.initializers.lecun_normal()

    class Nnx(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.up = nnx.Linear(
                8, 16, kernel_init=nnx.with_partitioning(init, (None, "tensor")), rngs=rngs
            )

    class Linen(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            kernel = nn.with_logical_partitioning(init, ("embed", "mlp"))
            return nn.Dense(16, kernel_init=kernel)(x)

    sizes = {"data": 1, "fsdp": 2, "tensor": 2}
    with annotations_only():
        state = jax.eval_shape(lambda: nnx.state(Nnx(nnx.Rngs(0))))
    task = Task(init=lambda rng: state, loss=lambda p, b: (0.0, {}), data=None)  # type: ignore[arg-type]
    specs = partitioning.leaf_specs(task, TreeLayout.of(state), state, sizes, 4)
    assert specs["up/kernel"] == P(None, "tensor") and specs["up/bias"] == P("fsdp")

    params = jax.eval_shape(lambda: Linen().init(jax.random.key(0), np.ones((1, 8))))
    logical = (("embed", "fsdp"), ("mlp", "tensor"))
    task = Task(
        init=lambda rng: params, loss=lambda p, b: (0.0, {}), data=None, logical_axis_rules=logical
    )  # type: ignore[arg-type]
    specs = partitioning.leaf_specs(task, TreeLayout.of(params), params, sizes, 4)
    assert specs["params/Dense_0/kernel"] == P("fsdp", "tensor")
    bare = Task(init=lambda rng: params, loss=lambda p, b: (0.0, {}), data=None)  # type: ignore[arg-type]
    with pytest.raises(partitioning.ShardingError, match="'embed' is neither a mesh axis"):
        partitioning.leaf_specs(bare, TreeLayout.of(params), params, sizes, 4)


def test_a_received_fragment_keeps_its_layout_and_the_step_compiles_once() -> None:
    cfg = load_config(None, [*SHARDED, *_mesh(4), "diloco.overlap_steps=1"])
    setup = Setup.build(cfg)
    core = _core(cfg, setup)
    layouts = {k: v.sharding for k, v in core.params.items()}
    for _ in range(cfg.diloco.sync_every):
        core.train_step(*core.next_batch())
    [(meta, _)] = core.offers()  # host copies of one fragment, started and collected
    p = meta.fragment
    moved = {k: core.base_values[p][k] + 0.25 for k in setup.plan.fragments[p]}
    core.receive(Message(p, 1, None, wire.encode_tree(moved, "float32")))
    assert core.apply_received() == [p]
    for k in setup.plan.fragments[p]:
        assert core.params[k].sharding == layouts[k], k
    for _ in range(3):
        core.train_step(*core.next_batch())
    assert {k: v.sharding for k, v in core.params.items()} == layouts
    assert core.step_fn._cache_size() == 1


def test_a_step_compiled_ahead_from_shapes_is_the_one_the_first_step_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A schedule length no other test compiles: the step program is this test's own.
    cfg = load_config(None, [*SHARDED, *_mesh(4), "inner.decay_tokens=123456"])
    setup = Setup.build(cfg)
    layout = learner_layout(cfg, setup.task, setup.layout, cfg.learners[0])
    with jax.log_compiles(), caplog.at_level(logging.DEBUG, logger="jax"):
        compile_ahead(cfg, cfg.learners[0], setup.task, layout)
        ahead = [r.getMessage() for r in caplog.records if "jit(step)" in r.getMessage()]
        caplog.clear()
        core = _core(cfg, setup)
        assert core.layout is layout
        core.train_step(*core.next_batch())
        first = [r.getMessage() for r in caplog.records]
    assert ahead, "compile_ahead compiled no step"
    assert not [m for m in first if "jit(step)" in m or "jit_step" in m], first


def test_an_offer_started_before_a_new_version_carries_the_old_base() -> None:
    # The copies of a due fragment run while the next step does; a version applied in between
    # must not change the delta the offer was started with.
    cfg = load_config(None, [*SHARDED, *_mesh(4), "diloco.wire_dtype=float32"])
    setup = Setup.build(cfg)
    core = _core(cfg, setup)
    for _ in range(cfg.diloco.sync_every):
        core.train_step(*core.next_batch())
    core.begin_offers()
    [started] = core.pending
    p = started.meta.fragment
    theta = {k: np.asarray(core.params[k], np.float32) for k in setup.plan.fragments[p]}
    base = core.base_values[p]
    moved = {k: base[k] + 1.0 for k in base}
    core.receive(Message(p, 1, None, wire.encode_tree(moved, "float32")))
    core.apply_received()
    core.train_step(*core.next_batch())
    [(meta, encoded)] = core.collect_offers()
    assert (meta.base_version, meta.step) == (0, cfg.diloco.sync_every)
    delta = wire.decode_tree(encoded)
    for k in theta:
        np.testing.assert_allclose(delta[k], theta[k] - base[k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode", ["synchronous", "decoupled"])
def test_a_sharded_run_gives_the_losses_of_a_replicated_one(mode: str) -> None:
    base = [*SHARDED, f"diloco.mode={mode}", "token_budget=6144"]
    replicated = run_reference(load_config(None, [*base, *_mesh(1)]))
    sharded = run_reference(load_config(None, [*base, *_mesh(4)]))
    assert sharded["rounds"] == replicated["rounds"] > 0
    assert sharded["tokens"] == replicated["tokens"]
    assert sharded["heldout_loss"] == pytest.approx(replicated["heldout_loss"], rel=1e-4)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (_mesh(4, tensor=3), "tensor: 3"),
        (_mesh(4, fsdp=8), "spans 8 devices but the learner has 4"),
        ([*_mesh(4), "learners.0.batch_size=6"], "multiple of 4"),
    ],
)
def test_a_bad_mesh_is_refused_with_the_field(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(None, [*SHARDED, *overrides])


def test_a_rule_that_does_not_divide_a_leaf_is_refused_and_the_default_fits_any_shape() -> None:
    cfg = load_config(None, [*SHARDED, *_mesh(4), "task_args.model.d_ff=66"])
    setup = Setup.build(cfg)
    rules = [("mlp/up", P(None, "fsdp"))]
    task = Task(setup.task.init, setup.task.loss, setup.task.data, sharding=rules)
    with pytest.raises(partitioning.ShardingError, match="do not divide its axis of 66"):
        partitioning.leaf_specs(task, setup.layout, None, cfg.learners[0].mesh_sizes, 256)
    check_task(cfg)  # FSDP replicates a leaf none of whose axes 4 divides


def test_default_rule_picks_the_largest_divisible_axis() -> None:
    assert partitioning.default_spec((50257, 768), 4, 1) == P(None, "fsdp")
    assert partitioning.default_spec((768, 3072), 4, 1) == P(None, "fsdp")
    assert partitioning.default_spec((3072, 768), 4, 1) == P("fsdp", None)
    assert partitioning.default_spec((768,), 4, 2**14) == P()
    assert partitioning.default_spec((7, 9), 4, 1) == P()


def test_the_layout_report_measures_the_live_arrays() -> None:
    cfg = load_config(None, [*SHARDED, *_mesh(4)])
    setup = Setup.build(cfg)
    core = _core(cfg, setup)
    report = sharding.layout_report(core.layout, core.tx, core.params, core.opt_state)
    assert report.mesh == {"data": 1, "fsdp": 4, "tensor": 1} and report.num_devices == 4
    large = {k for k in setup.layout.paths if setup.layout.sizes()[k] >= 256}
    assert {k for k, f in report.shards.items() if f == 0.25} == large
    assert {k for k, f in report.state_shards.items() if f == 0.25} == large
    whole = 4 * setup.layout.num_params()
    assert whole / 4 <= report.param_bytes_per_device < whole / 2
    assert 2 * whole / 4 <= report.state_bytes_per_device < whole  # two moments, plus counts


def test_an_emulated_slice_host_gets_one_cpu_device_per_chip(monkeypatch: pytest.MonkeyPatch):
    from ray_diloco.config import LearnerGroupConfig
    from ray_diloco.runtime.learner.spmd import emulation_env

    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_foo=1 --xla_force_host_platform_device_count=8")
    v5p = LearnerGroupConfig(name="v5p", accelerator="tpu-v5p", topology="2x2x2", batch_size=8)
    env = emulation_env(v5p, has_tpu=False)
    assert env["JAX_PLATFORMS"] == "cpu"
    assert env["XLA_FLAGS"] == "--xla_cpu_foo=1 --xla_force_host_platform_device_count=4"
    assert emulation_env(v5p, has_tpu=True) == {}  # a real slice: its TPU runtime decides
    cpu = LearnerGroupConfig(name="c", devices_per_host=2, batch_size=8)
    assert emulation_env(cpu)["XLA_FLAGS"].endswith("device_count=2")
    assert emulation_env(LearnerGroupConfig(name="g", accelerator="gpu")) == {}
