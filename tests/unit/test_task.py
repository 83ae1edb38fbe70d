"""The task contract (ray_diloco/task.py, algorithm/pytree.py, algorithm/setup.py): any
pytree is fragmented by key path, tasks are named by import path or carried by value, and
every bad task ends in one ConfigError naming the field, before anything trains."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ray_diloco
from ray_diloco.algorithm.fragments import plan_fragments
from ray_diloco.algorithm.pytree import TreeLayout
from ray_diloco.algorithm.setup import Setup, check_task, fitted_config, fragment_plan
from ray_diloco.config import ConfigError, load_config
from ray_diloco.task import Task, load_task, task_spec
from tests.fixtures.custom_task import TeacherData, make_task

ROOT = Path(__file__).resolve().parents[2]
CUSTOM = ROOT / "tests" / "fixtures" / "custom_task.yaml"


class _Mlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.layers = nnx.List([nnx.Linear(4, 8, rngs=rngs), nnx.Linear(8, 2, rngs=rngs)])
        self.embed = nnx.Embed(10, 4, rngs=rngs)


def test_layout_of_nested_dicts_and_lists_round_trips() -> None:
    tree = {
        "enc": [{"w": jnp.ones((3, 4)), "b": jnp.zeros(4)}, {"w": jnp.ones((4, 4))}],
        "head": {"w": jnp.ones((4, 1))},
    }
    layout = TreeLayout.of(tree)
    assert layout.paths == ("enc/0/b", "enc/0/w", "enc/1/w", "head/w")
    assert layout.sizes() == {"enc/0/b": 4, "enc/0/w": 12, "enc/1/w": 16, "head/w": 4}
    flat = layout.flatten(tree)
    back = layout.unflatten(flat)
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    leaves = zip(jax.tree.leaves(back), jax.tree.leaves(tree), strict=True)
    assert all(np.array_equal(a, b) for a, b in leaves)
    plan = plan_fragments(layout.sizes(), 2)
    assert sorted(p for frag in plan.fragments for p in frag) == sorted(layout.paths)


def test_layout_of_nnx_state_names_leaves_without_the_variable_wrapper() -> None:
    state = nnx.state(_Mlp(nnx.Rngs(0)), nnx.Param)
    layout = TreeLayout.of(state)
    assert set(layout.paths) == {
        "layers/0/kernel",
        "layers/0/bias",
        "layers/1/kernel",
        "layers/1/bias",
        "embed/embedding",
    }
    back = layout.unflatten(layout.flatten(state))
    assert jax.tree.structure(back) == jax.tree.structure(state)


def test_layout_of_a_linen_style_params_dict() -> None:
    import flax.linen as nn

    variables = nn.Dense(3).init(jax.random.key(0), jnp.ones((1, 5)))
    assert TreeLayout.of(variables).paths == ("params/bias", "params/kernel")


def test_layout_rejects_integer_leaves_and_colliding_paths() -> None:
    with pytest.raises(ValueError, match="'step' has dtype int32"):
        TreeLayout.of({"w": jnp.ones(3), "step": jnp.zeros((), jnp.int32)})
    with pytest.raises(ValueError, match=r"share the key paths \['a/b'\]"):
        TreeLayout.of({"a/b": jnp.ones(1), "a": {"b": jnp.ones(1)}})


def test_custom_task_trains_in_the_reference_run_through_the_yaml_path(tmp_path: Path) -> None:
    from ray_diloco.sim.simulate import run_reference

    cfg = load_config(CUSTOM, [f"run_dir={tmp_path}", "token_budget=6000"])
    setup = Setup.build(cfg)
    assert len(setup.layout.paths) == 6 and setup.plan.num_fragments == 3
    assert check_task(cfg)["num_leaves"] == 6
    summary = run_reference(cfg, setup=setup)
    first, last = summary["evals"][0]["heldout_loss"], summary["evals"][-1]["heldout_loss"]
    assert last < 0.5 * first
    assert summary["tokens"] >= 6000 and summary["ledger_violations"] == []


def test_data_source_resumes_exactly_from_a_cursor() -> None:
    data = TeacherData(4, seed=0)
    straight = [b for b, _ in _take(data.batches(1, 3, 0, 8), 5)]
    resumed = [b for b, _ in _take(data.batches(1, 3, 24, 8), 2)]
    for a, b in zip(straight[3:], resumed, strict=True):
        np.testing.assert_array_equal(a["x"], b["x"])


def _take(it, n):  # type: ignore[no-untyped-def]
    return [next(it) for _ in range(n)]


def test_task_spec_names_importable_factories_and_carries_the_rest_by_value() -> None:
    assert task_spec(make_task) == "tests.fixtures.custom_task:make_task"

    def local_factory() -> Task:  # a script's or notebook's factory: not importable by name
        return make_task(hidden=8)

    spec = task_spec(local_factory)
    assert spec.startswith("cloudpickle:")
    task = load_task(spec, {})
    assert TreeLayout.of(jax.eval_shape(task.init, jax.random.key(0))).shapes["head/w"] == (8, 1)


@pytest.mark.parametrize(
    ("task", "args", "match"),
    [
        ("no_colon_here", {}, r"task='no_colon_here': expected 'package.module:factory'"),
        ("no_such_pkg.mod:make", {}, r"no module 'no_such_pkg'"),
        ("tests.fixtures.custom_task:nope", {}, r"has no callable 'nope'"),
        ("tests.fixtures.custom_task:make_task", {"widht": 3}, r"task_args: .*'widht'"),
        (
            "ray_diloco.tasks.byte_lm:make_task",
            {"model": {"d_model": -1}},
            r"task_args\.model\.d_model: Input should be greater than or equal to 8",
        ),
        ("ray_diloco.config:load_config", {"path": None}, r"returned RunConfig, not a"),
        (
            "ray_diloco.tasks.token_lm:make_task",
            {"data_dir": "/no/such/dir"},
            r"data_dir='/no/such/dir' is not a directory",
        ),
    ],
)
def test_bad_tasks_are_one_config_error_naming_the_field(task, args, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=match):
        load_task(task, args)


def _tiny(*overrides: str):  # type: ignore[no-untyped-def]
    return load_config(CUSTOM, list(overrides))


def test_a_pytree_too_small_for_the_fragments_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"exceeds the 6 parameter leaves") as err:
        fragment_plan(_tiny("diloco.num_fragments=8", "diloco.sync_every=8"))
    assert str(err.value).count("diloco.num_fragments=") == 1, err.value  # named once
    assert "set diloco.num_fragments to at most 6" in str(err.value)


def test_the_default_fragment_count_fits_a_task_with_fewer_leaves() -> None:
    # The default (24) exceeds the custom task's 6 leaves: unset, it becomes one per leaf;
    # set, it is the user's choice and refused as it stands.
    task = ["task=tests.fixtures.custom_task:make_task", "task_args={}"]
    unset = load_config(None, task)
    fitted = fitted_config(unset)
    assert (unset.diloco.num_fragments, fitted.diloco.num_fragments) == (24, 6)
    assert fragment_plan(fitted).num_fragments == 6
    chosen = load_config(None, [*task, "diloco.num_fragments=24"])
    assert fitted_config(chosen) is chosen
    with pytest.raises(ConfigError, match=r"diloco\.num_fragments=24 exceeds the 6"):
        fragment_plan(chosen)
    # The Python API keeps what the config left unset, so it is fitted there too.
    trainer = ray_diloco.Trainer("tests.fixtures.custom_task:make_task", unset)
    assert fitted_config(trainer.config).diloco.num_fragments == 6


def test_a_heldout_set_that_is_a_bare_batch_is_named_as_the_evaluation() -> None:
    # A bare dict iterates as its keys, a bare (x, y) tuple as two arrays: both used to be
    # reported as "the first training step failed: ValueError: too many values to unpack".
    for task in ("dict_heldout_task", "tuple_heldout_task"):
        with pytest.raises(ConfigError) as err:
            check_task(_tiny(f"task=tests.unit.test_task:{task}", "task_args={}"))
        message = str(err.value)
        assert "data.heldout() must give a list of batches (`[batch]` for one)" in message
        assert "first training step" not in message, message


def test_a_data_source_whose_examples_move_with_the_batching_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"data.batches\(\) gives other examples for one batch"):
        check_task(_tiny("task=tests.unit.test_task:batch_seeded_task", "task_args={}"))
    check_task(_tiny())  # the fixture's source derives each example from its index: accepted


class _BatchSeeded(TeacherData):
    """Each batch drawn from a generator seeded by its cursor: resumable (the same cursor, the
    same batch) but example e depends on where its batch starts."""

    def batches(self, part, num_parts, cursor, batch_size):  # type: ignore[no-untyped-def]
        while True:
            rng = np.random.default_rng([part, cursor])
            x = rng.normal(size=(batch_size, self.x.shape[1])).astype(np.float32)
            yield {"x": x, "y": x[:, :1]}, batch_size
            cursor += batch_size


def _with_data(data: TeacherData) -> Task:
    base = make_task()
    return Task(init=base.init, loss=base.loss, data=data)


def batch_seeded_task() -> Task:
    return _with_data(_BatchSeeded(16, 0))


class _DictHeldout(TeacherData):
    def heldout(self):  # type: ignore[no-untyped-def]
        return super().heldout()[0]


class _TupleHeldout(TeacherData):
    def heldout(self):  # type: ignore[no-untyped-def]
        batch = super().heldout()[0]
        return batch["x"], batch["y"]


def dict_heldout_task() -> Task:
    return _with_data(_DictHeldout(16, 0))


def tuple_heldout_task() -> Task:
    return _with_data(_TupleHeldout(16, 0))


def test_a_non_finite_first_loss_is_refused_before_training() -> None:
    with pytest.raises(ConfigError, match="first training loss is nan"):
        check_task(_tiny("task=tests.unit.test_task:nan_task", "task_args={}"))


def test_data_without_the_contract_is_refused() -> None:
    with pytest.raises(ConfigError, match="lacks tokens_per_example, batches"):
        load_task("tests.unit.test_task:no_data_task", {})


def nan_task() -> Task:
    base = make_task()
    return Task(init=base.init, loss=lambda p, b: (jnp.float32(math.nan), {}), data=base.data)


def no_data_task() -> Task:
    return Task(init=make_task().init, loss=make_task().loss, data=object())  # type: ignore[arg-type]


def test_cli_reports_a_bad_task_in_one_line_without_a_traceback(tmp_path: Path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "ray_diloco.cli",
            "simulate",
            "--config",
            str(CUSTOM),
            "--set",
            "task=tests.fixtures.custom_task:nope",
            "--set",
            f"run_dir={tmp_path / 'r'}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert lines == [
        "error: task='tests.fixtures.custom_task:nope': "
        "tests.fixtures.custom_task has no callable 'nope'"
    ], run.stderr
    assert not (tmp_path / "r").exists()  # nothing written
