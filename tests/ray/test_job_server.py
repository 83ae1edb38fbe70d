"""`ray job submit` against a real `ray start --head` cluster (ray-notes §6): a job training a
user's own task (tests/fixtures/custom_task.py, shipped in the working directory) succeeds,
writes its summary, and the detached synchronizer outlives the job's driver.

The cluster is started by this module in its own temp dir with free ports, and stopped by
ending exactly the processes of that cluster (never `ray stop`, which would end every Ray on
the machine)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import psutil
import pytest
import yaml

from tests.cluster_helpers import free_port, prepare_ray_env

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
CUSTOM = ROOT / "tests" / "fixtures" / "custom_task.yaml"
EXCLUDES = [".git", "runs", "benchmarks/results", "**/__pycache__", ".*_cache"]


class Head(NamedTuple):
    gcs_address: str
    dashboard_url: str
    temp_dir: str


def _ray_cli() -> list[str]:
    # The job agent and this test must use the interpreter that has Ray (ray-notes §6).
    script = Path(sys.executable).with_name("ray")
    return [str(script)] if script.exists() else [sys.executable, "-m", "ray.scripts.scripts"]


def _stop_cluster(temp_dir: str) -> None:
    """End the processes of the cluster rooted at `temp_dir` (found by that path in their
    command lines), by pid: SIGTERM, then SIGKILL for those still there after 5 s."""
    mine = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(temp_dir in part for part in proc.info["cmdline"] or ()):
                mine.append(proc)
    for proc in mine:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(mine, timeout=5)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()


@pytest.fixture(scope="module")
def head() -> Iterator[Head]:
    prepare_ray_env()
    import ray

    if ray.is_initialized():
        ray.shutdown()
    temp_dir = tempfile.mkdtemp(prefix="rdj", dir="/tmp")  # short: unix socket paths
    gcs, dashboard = free_port(), free_port()
    ports = {
        "--port": gcs,
        "--dashboard-port": dashboard,
        "--dashboard-agent-listen-port": free_port(),
        "--dashboard-agent-grpc-port": free_port(),
        "--runtime-env-agent-port": free_port(),
        "--metrics-export-port": free_port(),
        "--ray-client-server-port": free_port(),
        "--node-manager-port": free_port(),
        "--object-manager-port": free_port(),
    }
    cmd = [
        *_ray_cli(),
        "start",
        "--head",
        "--num-cpus=3",
        "--object-store-memory=200000000",
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
        *(f"{flag}={port}" for flag, port in ports.items()),
    ]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    try:
        subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=120)
        yield Head(f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dashboard}", temp_dir)
    finally:
        ray.shutdown()
        _stop_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _job_config(tmp_path: Path) -> Path:
    tree = yaml.safe_load(CUSTOM.read_text())
    tree.update(run_dir=str(tmp_path / "run"), token_budget=3200)
    tree["learners"] = tree["learners"][:1]
    tree["synchronizer"]["name"] = "sync-job"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


@pytest.mark.timeout(200)
def test_submitted_job_succeeds_and_keeps_the_detached_synchronizer(
    head: Head, tmp_path: Path
) -> None:
    from ray.job_submission import JobStatus, JobSubmissionClient

    config = _job_config(tmp_path)
    client = JobSubmissionClient(head.dashboard_url)
    job = client.submit_job(
        entrypoint=(
            f"{sys.executable} -m ray_diloco.cli train --config {config} --keep-synchronizer"
        ),
        runtime_env={
            "working_dir": str(ROOT),
            "excludes": EXCLUDES,
            "env_vars": {"RAY_AUTH_MODE": "disabled", "JAX_PLATFORMS": "cpu"},
        },
    )
    deadline, status = time.monotonic() + 170, None
    while time.monotonic() < deadline:
        status = client.get_job_status(job)
        if status in {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}:
            break
        time.sleep(1)
    assert status == JobStatus.SUCCEEDED, client.get_job_logs(job)[-4000:]
    summary = yaml.safe_load((tmp_path / "run" / "summary.json").read_text())
    assert summary["tokens"] >= 3200 and summary["rounds"] > 0
    assert summary["heldout_loss"] < summary["evals"][0]["heldout_loss"]
    assert "tokens" in client.get_job_logs(job)  # the live progress display

    import ray

    ray.init(address=head.gcs_address, namespace="diloco-test-job")
    sync: Any = ray.get_actor("sync-job", namespace="ray_diloco")  # outlived the driver
    status_now = ray.get(sync.status.remote(), timeout=30)
    assert status_now.finished and status_now.rounds == summary["rounds"]
    ray.kill(sync, no_restart=True)
