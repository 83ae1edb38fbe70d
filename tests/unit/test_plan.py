"""`ray-diloco plan`: its output and exit codes, its fragment bytes against the real wire
encoding, its memory checks: the synchronizer's against the head, each learner's per chip
against its chip's HBM. (Its link loads against the reference run's bytes: test_simulate; the
per-chip figures against counts by hand: test_memory.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ray_diloco import cli
from ray_diloco.algorithm.memory import ChipMemory
from ray_diloco.cluster.files import ClusterSpec, HeadNode
from ray_diloco.cluster.plan import (
    fragment_wire_bytes,
    make_plan,
    render,
    synchronizer_memory_bytes,
)
from ray_diloco.config import load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "fixtures" / "tiny_train.yaml"


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # job files name cluster files relative to the working directory
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # plan sets it; restored after each test


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _learner(out: str, name: str) -> str:
    """The learner's two lines of the plan, joined."""
    lines = out.splitlines()
    (i,) = [i for i, ln in enumerate(lines) if ln.strip().startswith(name)]
    return lines[i] + lines[i + 1]


def test_plan_of_the_gke_job(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _plan(capsys, "--config", "jobs/cluster-gke.yaml")
    assert (rc, err) == (0, "")
    assert "problems: none" in out
    assert "GCS fault tolerance on (Redis)" in out and "synchronizer  on the head" in out
    v6e = _learner(out, "v6e-0")
    assert "2 host(s) x 4 chips" in v6e and "worker group 'v6e-2x4'" in v6e
    assert "us-east5-b" in v6e and "bundle i on TPU worker i" in v6e
    # The job's corpus is on the pods: the chips' rows say what they could not estimate here.
    row = _memory_row(out, "v6e-0")
    assert "activations not estimated: the task's data is not readable here" in row, row
    assert "total at least 0.2 GB of a v6e chip's 32 GB HBM" in row, row


def test_plan_of_the_multi_region_job_and_a_shape_mismatch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc, out, _ = _plan(capsys, "--config", "jobs/cluster-v5p-v6e.yaml")
    assert rc == 0
    v6e = _learner(out, "v6e-0")
    assert "1 host(s) x 8 chips" in v6e and "europe-west4-v6e.yaml" in v6e
    (eu,) = [ln for ln in out.splitlines() if ln.strip().startswith("europe-west4")]
    assert "2 Gbps real" in eu and "% used" in eu
    # The same job asking for the two-host v6e shape the TPU VM does not have: exit 1.
    rc, out, _ = _plan(
        capsys, "--config", "jobs/cluster-v5p-v6e.yaml", "--set", "learners.1.num_hosts=2"
    )
    assert rc == 1
    assert "problems: 1" in out and "has 1 host(s) x 8 chips; set num_hosts: 1" in out
    # A region without a declared link, and the synchronizer's region not the head's.
    rc, out, _ = _plan(
        capsys,
        "--config",
        "jobs/cluster-v5p-v6e.yaml",
        "--set",
        "cluster.links={}",
        "--set",
        "synchronizer.region=us-central1",
    )
    assert rc == 1 and "problems: 2" in out
    assert "region europe-west4 has no link" in out and "set synchronizer.region: us-east5" in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--config", "jobs/local.yaml"], "no cluster file"),
        (["--config", "jobs/cluster-gke.yaml", "--cluster", "nope.yaml"], "nope.yaml"),
        (["--config", "jobs/cluster-gke.yaml", "--cluster", "jobs/local.yaml"], "neither"),
        (["--config", "jobs/cluster-gke.yaml", "--set", "learners.1.topology=3x3"], "3x3"),
        (["--config", "jobs/cluster-gke.yaml", "--set", "learners.1.num_hosts=4"], "num_hosts"),
        (["--config", "missing.yaml"], "missing.yaml"),
    ],
)
def test_bad_input_is_one_error_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    rc, out, err = _plan(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and needle in err, err


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int4"])
def test_fragment_bytes_are_the_wire_encodings(dtype: str) -> None:
    from ray_diloco.algorithm import wire
    from ray_diloco.algorithm.setup import fragment_plan, layout_of

    cfg = load_config(TINY, [f"diloco.wire_dtype={dtype}", "diloco.publish_delta=none"])
    frags = fragment_plan(cfg)
    shapes = layout_of(cfg).shapes
    up, down = fragment_wire_bytes(cfg, frags.sizes)

    def encoded(wire_dtype: str) -> int:
        zeros = {k: np.zeros(shapes[k], np.float32) for frag in frags.fragments for k in frag}
        return wire.tree_bytes(wire.encode_tree(zeros, wire_dtype, cfg.diloco.int4_block_size))

    leaves = sum(len(f) for f in frags.fragments)
    assert 0 <= encoded(dtype) - up <= 5 * leaves  # int4 rounds blocks per leaf; others exact
    assert down == encoded(wire.publish_dtype(dtype))


def test_a_head_too_small_for_the_synchronizer_is_a_problem() -> None:
    cfg = load_config(TINY, ["synchronizer.region=r1"])
    need = synchronizer_memory_bytes(cfg, 10**9)  # a billion parameters: 4 GB per copy
    assert need > 4 * 10**9 * (cfg.diloco.max_staleness_versions + cfg.num_learners)
    head = HeadNode("test head", "r1", None, 8, 32 * 2**30, False)
    spec = ClusterSpec(("test",), (head,), (), ())
    plan = make_plan(cfg, spec, [5 * 10**8, 5 * 10**8])
    assert [p for p in plan.problems if "the synchronizer needs" in p], plan.problems
    big = HeadNode("test head", "r1", None, 8, 2**40, False)
    plan = make_plan(cfg, ClusterSpec(("test",), (big,), (), ()), [5 * 10**8, 5 * 10**8])
    assert plan.problems == []


# ~1.2B parameters, 512-token windows, 32 sequences a step on each learner: 4 per chip of 8.
ONE_B = [
    "--set",
    "task_args.model={vocab_size: 256, d_model: 2048, num_layers: 24, num_heads: 16, "
    "d_ff: 8192, seq_len: 512}",
    "--set",
    "task_args.data.source=synthetic",  # the job's corpus is on the pods; the same shapes
    "--set",
    "learners.0.batch_size=32",
    "--set",
    "learners.1.batch_size=32",
]
REPLICATED_V6E = ["--set", "learners.1.mesh.data=-1", "--set", "learners.1.mesh.fsdp=1"]


def _memory_row(out: str, name: str) -> str:
    lines = out.splitlines()
    (i,) = [i for i, ln in enumerate(lines) if ln.strip().startswith(name)]
    return lines[i + 2]


def test_a_1b_model_fits_sharded_and_is_refused_replicated_on_v6e(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc, out, err = _plan(capsys, "--config", "jobs/cluster-gke.yaml", *ONE_B)
    assert (rc, err) == (0, ""), out
    assert "model: 1,210,157,056 parameters" in out and "problems: none" in out
    for name, chip in (("v5p-0", "a v5p chip's 95 GB"), ("v6e-0", "a v6e chip's 32 GB")):
        row = _memory_row(out, name)
        assert "params+grads+optimizer 2.4 GB" in row and "at 4 examples per chip" in row, row
        assert f"total 22.2 GB of {chip} HBM" in row, row
    rc, out, err = _plan(capsys, "--config", "jobs/cluster-gke.yaml", *ONE_B, *REPLICATED_V6E)
    assert (rc, err) == (1, ""), out
    assert "params+grads+optimizer 19.4 GB" in _memory_row(out, "v6e-0")
    assert "total 22.2 GB" in _memory_row(out, "v5p-0")  # the other learner is unchanged
    assert "problems: 1" in out
    (problem,) = [ln for ln in out.splitlines() if ln.startswith("  - ")]
    assert problem == (
        "  - learner 'v6e-0': 39.2 GB per chip (params 4.8 GB, grads 4.8 GB, optimizer 9.7 GB, "
        "activations 19.8 GB at 4 examples per chip) exceeds a v6e chip's 32 GB HBM; shard it "
        "(learners.1.mesh.data=1, learners.1.mesh.fsdp=-1), use a bigger slice or a smaller "
        "batch (learners.1.batch_size)"
    )


def test_chip_memory_is_checked_against_the_chip_s_hbm_only() -> None:
    cfg = load_config(
        "jobs/cluster-gke.yaml", ["learners.1.mesh.data=-1", "learners.1.mesh.fsdp=1"]
    )
    head = HeadNode("test head", "us-east5", None, 8, 2**40, False)
    spec = ClusterSpec(("test",), (head,), (), ())
    at_most = ChipMemory(31 * 10**9, 0, 0, 10**9, 1)  # exactly a v6e chip's 32 GB
    over = ChipMemory(33 * 10**9, 0, 0, None, 32, unread="OSError: no corpus")
    plan = make_plan(cfg, spec, [1000], {"v5p-0": over, "v6e-0": at_most})
    assert [p for p in plan.problems if "per chip" in p] == []  # 33 GB is no problem on v5p
    plan = make_plan(cfg, spec, [1000], {"v5p-0": at_most, "v6e-0": over})
    (problem,) = [p for p in plan.problems if "per chip" in p]
    assert problem.startswith("learner 'v6e-0': at least 33.0 GB per chip (")
    assert "activations not estimated: the task's data is not readable here (OSError" in problem
    assert problem.endswith(
        "32 GB HBM; shard it (learners.1.mesh.data=1, "
        "learners.1.mesh.fsdp=-1) or use a bigger slice"
    )
    cpu = load_config(TINY, ["synchronizer.region=r1"])
    head = HeadNode("test head", "r1", None, 8, 2**40, False)
    huge = ChipMemory(10**15, 10**15, 10**15, 10**15, 8)
    plan = make_plan(cpu, ClusterSpec(("test",), (head,), (), ()), [1000], {"a": huge, "b": huge})
    assert plan.problems == []  # a CPU device's memory is not known: printed, not checked
    assert "memory is not known here, not checked" in render(plan)
