"""An embedded local Ray whose node fails to start is started again (`driver._connect`).

The fault is Ray's own, made to happen: the dashboard agent of the first node starts 25 s
late, so its raylet gives up waiting for the agent's port (15 s, hard-coded in Ray 2.60) and
exits, as it did on a busy machine; the driver must then start a fresh Ray and run on it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "fixtures" / "tiny_train.yaml"
SCRIPT = """
import sys
from ray._private import ray_constants, services

build = services._build_python_executable_command_memory_profileable
delayed = []

def late_first_agent(process_type, session_dir, *args, **kwargs):
    command = build(process_type, session_dir, *args, **kwargs)
    if process_type == ray_constants.PROCESS_TYPE_DASHBOARD_AGENT and not delayed:
        delayed.append(command)
        return ["/bin/sh", "-c", 'sleep 25; exec "$0" "$@"', *command]
    return command

services._build_python_executable_command_memory_profileable = late_first_agent

import ray
from ray_diloco.config import load_config
from ray_diloco.runtime.driver import _connect

import psutil

embedded, _ = _connect(load_config(sys.argv[1], [f"run_dir={sys.argv[2]}"]), None, False)
print("embedded", embedded, "delayed agents", len(delayed))
ours = psutil.Process().children(recursive=True)
print("control processes", sum("gcs_server" in p.name() for p in ours))
print("answer", ray.get(ray.remote(lambda: 42).remote()))
"""


@pytest.mark.timeout(240)
def test_an_embedded_ray_that_fails_to_start_is_started_again(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(TINY), str(tmp_path / "run")],
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "embedded True delayed agents 1" in done.stdout, done.stdout
    assert "answer 42" in done.stdout
    # the failed attempt's GCS was stopped, not left running beside the new one
    assert "control processes 1" in done.stdout, done.stdout
    # the first node did fail, and the driver said so
    assert "did not come up" in done.stderr and "starting it again (2 of 3)" in done.stderr
