"""What one chip of a learner holds (algorithm/memory.py), against counts by hand: a two-leaf
task's shards of its parameters, gradients and Adam state on FSDP and on a replicated mesh, its
activation estimate, the estimate's walk into jit, remat and scan, and the 1B-parameter model's
figures from its dimensions. A mesh or sharding rule that cannot lay the parameters out is one
`error:` line of `ray-diloco plan` and `ray-diloco train`, exit 2, before anything starts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec

from ray_diloco import cli
from ray_diloco.algorithm.memory import example_activation_bytes, learner_memory
from ray_diloco.algorithm.pytree import TreeLayout
from ray_diloco.config import load_config
from ray_diloco.task import Task, task_spec

ROOT = Path(__file__).resolve().parents[2]
F32 = 4
ROWS, COLS = 256, 68  # w: 17,408 elements, over the 2**14 FSDP floor; 68 is not a multiple of 8


class _Rows:
    """Regression rows x float32[256] -> y float32[68]."""

    tokens_per_example = 1

    def batches(
        self, part: int, num_parts: int, cursor: int, batch_size: int
    ) -> Iterator[tuple[dict[str, np.ndarray], int]]:
        rng = np.random.default_rng(cursor * num_parts + part)
        while True:
            x = rng.normal(size=(batch_size, ROWS)).astype(np.float32)
            yield {"x": x, "y": np.tanh(x[:, :COLS])}, batch_size

    def heldout(self) -> list[dict[str, np.ndarray]]:
        return [next(self.batches(0, 1, 0, 8))[0]]


def _mlp_loss(params: dict[str, Any], batch: dict[str, Any]) -> tuple[jax.Array, dict[str, Any]]:
    pred = jnp.tanh(batch["x"] @ params["w"] + params["b"])
    return jnp.mean((pred - batch["y"]) ** 2), {}


def two_leaf_task(axes: list[str | None] | None = None) -> Task:
    """w float32[256, 68] and b float32[68] under Adam; `axes`: a sharding rule for w."""
    return Task(
        init=lambda rng: {"w": jnp.zeros((ROWS, COLS)), "b": jnp.zeros(COLS)},
        loss=_mlp_loss,
        data=_Rows(),
        optimizer=lambda total_steps: optax.adam(1e-3),
        sharding=None if axes is None else [(r"^w$", PartitionSpec(*axes))],
    )


def test_a_two_leaf_task_per_chip_by_hand() -> None:
    eight = "devices_per_host: 8, batch_size: 16"
    learners = (
        f"[{{name: fsdp, {eight}}}, {{name: replicated, {eight}, mesh: {{data: -1, fsdp: 1}}}}, "
        "{name: one, batch_size: 4}]"
    )
    cfg = load_config(
        None, [f"task={task_spec(two_leaf_task)}", "diloco.num_fragments=2", f"learners={learners}"]
    )
    mem = learner_memory(cfg)
    # FSDP over 8: w split along its 256 rows, b (68 elements, under the floor) whole.
    params = ROWS * COLS * F32 // 8 + COLS * F32
    assert (mem["fsdp"].params, mem["fsdp"].grads) == (params, params)
    assert mem["fsdp"].opt_state == 2 * params + 4  # Adam's mu and nu, and its int32 count
    # What the backward pass of one example keeps: tanh's output (for 1 - t**2), pred - y and
    # its square's factor, [1, 68] float32 each; w and the batch are arguments, not counted.
    per_example = 3 * COLS * F32
    assert (mem["fsdp"].examples, mem["fsdp"].activations) == (2, 2 * per_example)
    assert mem["fsdp"].total == 4 * params + 4 + 2 * per_example
    whole = (ROWS + 1) * COLS * F32
    replicated = mem["replicated"]
    assert (replicated.params, replicated.opt_state) == (whole, 2 * whole + 4)
    assert (replicated.examples, replicated.activations) == (2, 2 * per_example)  # data x 8
    assert (mem["one"].params, mem["one"].examples) == (whole, 4)  # one device: all of it


def test_a_rematerialised_block_keeps_only_its_input() -> None:
    tree = TreeLayout.of({"w": jnp.zeros((4, 8))})
    x = {"x": jax.ShapeDtypeStruct((1, 4), jnp.float32)}

    def block(params: dict[str, Any], x: jax.Array) -> jax.Array:
        return jnp.sin(jnp.cos(x @ params["w"]))

    def loss(remat: bool) -> Any:
        inner = jax.checkpoint(block) if remat else block
        return lambda params, batch: (jnp.sum(jnp.tanh(inner(params, batch["x"]))), {})

    def held(fn: Any, example: Any = x) -> int:
        task = Task(init=lambda rng: {}, loss=fn, data=_Rows())
        return example_activation_bytes(task, tree, example)

    tail = held(
        lambda p, b: (jnp.sum(jnp.tanh(b["h"])), {}),
        {"h": jax.ShapeDtypeStruct((1, 8), jnp.float32)},
    )
    assert tail > 0
    assert held(loss(remat=True)) == tail  # the block's cos and sin are recomputed
    assert held(loss(remat=False)) >= tail + 2 * 8 * F32


ONE_B_MODEL = (
    "task_args.model={vocab_size: 256, d_model: 2048, num_layers: 24, num_heads: 16, "
    "d_ff: 8192, seq_len: 512}"
)


def test_the_1b_model_per_chip_from_its_dimensions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    cfg = load_config(
        "jobs/cluster-gke.yaml",
        [
            ONE_B_MODEL,
            "task_args.data.source=synthetic",
            "learners.1.mesh.data=-1",
            "learners.1.mesh.fsdp=1",
        ],
    )
    d, layers, d_ff, vocab, seq = 2048, 24, 8192, 256, 512
    matrices = 2 * vocab * d + seq * d + layers * (4 * d * d + 2 * d * d_ff)
    scales = (2 * layers + 1) * d  # the LayerNorm scales: under the FSDP floor, replicated
    assert matrices + scales > 1.2e9
    mem = learner_memory(cfg)
    sharded = F32 * (matrices // 8 + scales)  # v5p-16: 8 chips, FSDP over all of them
    assert (mem["v5p-0"].params, mem["v5p-0"].grads) == (sharded, sharded)
    # AdamW's mu and nu, its count and the schedule's (clipping and the mask hold none).
    assert mem["v5p-0"].opt_state == 2 * sharded + 2 * 4
    whole = F32 * (matrices + scales)
    assert (mem["v6e-0"].params, mem["v6e-0"].opt_state) == (whole, 2 * whole + 8)
    assert mem["v5p-0"].examples == mem["v6e-0"].examples == 256 // 8
    assert mem["v5p-0"].activations == mem["v6e-0"].activations


_RULE = f"task={task_spec(two_leaf_task)}"
MESH_CASES = [
    # (command, overrides, what the error line names): the config's own checks...
    ("plan", ["learners.0.mesh.fsdp=3"], "spans 3 devices but the learner has 8"),
    ("train", ["learners.0.mesh.fsdp=3"], "spans 3 devices but the learner has 8"),
    ("plan", ["learners.1.mesh.fsdp=16"], "spans 16 devices but the learner has 8"),
    ("train", ["learners.1.mesh.fsdp=16"], "spans 16 devices but the learner has 8"),
    ("train", ["learners.0.mesh.tensor=3"], "the fixed axes (3 devices) do not divide"),
    # ...and the task's rules, which plan lays out for every learner before anything starts
    (
        "plan",
        [_RULE, "task_args={axes: [model]}", "diloco.num_fragments=2"],
        "'v5p-0' (mesh {data: 1, fsdp: -1, tensor: 1}): leaf 'w': axis name 'model' is neither",
    ),
    (
        "plan",
        [_RULE, "task_args={axes: [null, fsdp]}", "diloco.num_fragments=2"],
        "fsdp = 8 devices do not divide its axis of 68",
    ),
]


@pytest.mark.parametrize(("command", "overrides", "needle"), MESH_CASES)
def test_a_mesh_or_rule_that_does_not_fit_is_one_error_line(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
    overrides: list[str],
    needle: str,
) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # plan sets it; restored after the test
    sets = [arg for o in overrides for arg in ("--set", o)]
    assert cli.main([command, "--config", "jobs/cluster-gke.yaml", *sets]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and err.startswith("error: "), err
    assert needle in err and "Traceback" not in err, err
