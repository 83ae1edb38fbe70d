"""`ray-diloco scale` adds a learner to a running job and removes it again: the new
learner contributes merged rounds, its leave is graceful (no restart, no failure), and the
token ledger stays exact."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ray_diloco.config import load_config
from ray_diloco.control.events import FailureDetected, LearnerJoined, LearnerLeft, RoundClosed
from ray_diloco.control.tape import read_tape

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "fixtures" / "tiny_train.yaml"


def _scale(run_dir: Path, address: str, *args: str) -> str:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ray_diloco.cli",
            "scale",
            str(run_dir),
            "--address",
            address,
            *args,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.timeout(480)
def test_scale_adds_and_removes_a_learner_in_a_running_job(ray_local: Any, tmp_path: Path) -> None:
    import ray

    from ray_diloco.runtime.driver import run_training

    run_dir = tmp_path / "scaled"
    cfg = load_config(
        TINY,
        [
            f"run_dir={run_dir}",
            "synchronizer.name=sync-scale",
            "diloco.mode=decoupled",
            # Trains until the test has removed its learner (a ceiling, never reached), with
            # the learning rate decaying over 200k tokens: a run that ends at its budget raced
            # the extra learner's boot on a slow machine ("no running job").
            "token_budget=4000000",
            "inner.decay_tokens=200000",
            "pace=step_time",
            "step_time_s=0.05",
            "elastic.lease_tokens=1024",
        ],
    )
    result: dict[str, Any] = {}
    removed = threading.Event()

    def stop_when(sup: dict[str, Any]) -> str | None:
        return "extra learner removed" if removed.is_set() else None

    thread = threading.Thread(
        target=lambda: result.update(
            summary=run_training(cfg, progress=lambda line: None, stop_when=stop_when)
        )
    )
    thread.start()
    sync: Any = None

    def status() -> tuple[int, dict[str, int]]:
        """The synchronizer's rounds and merged contributions per learner, (0, {}) while it
        is not up yet (it builds the task first)."""
        nonlocal sync
        with contextlib.suppress(ValueError, ray.exceptions.GetTimeoutError):
            sync = sync or ray.get_actor("sync-scale", namespace=cfg.synchronizer.namespace)
            st = ray.get(sync.status.remote(), timeout=10)
            return st.rounds, st.contributions_merged
        return 0, {}

    deadline = time.monotonic() + 180
    while status()[0] < 5:
        assert time.monotonic() < deadline and thread.is_alive(), "the run did not start"
        time.sleep(0.5)
    address = ray.get_runtime_context().gcs_address
    out = _scale(run_dir, address, "--add", "name=extra,batch_size=8")
    assert "learner extra joins the run" in out
    while status()[1].get("extra", 0) < 3:
        assert time.monotonic() < deadline + 60 and thread.is_alive(), "extra never contributed"
        time.sleep(0.5)
    assert "extra" in _scale(run_dir, address, "--list")
    _scale(run_dir, address, "--remove", "extra")
    # The run goes on without it: the leave is on the tape, then rounds are merged after it.
    tape = run_dir / "events.jsonl"
    while not [e for e in read_tape(tape) if isinstance(e, LearnerLeft)]:
        assert time.monotonic() < deadline + 180 and thread.is_alive(), "extra never left"
        time.sleep(0.5)
    rounds = status()[0]
    while status()[0] < rounds + 4:
        assert time.monotonic() < deadline + 180 and thread.is_alive(), "the run stalled"
        time.sleep(0.5)
    removed.set()
    thread.join(timeout=200)
    summary = result["summary"]
    events = read_tape(run_dir / "events.jsonl")
    assert [e.learner for e in events if isinstance(e, LearnerJoined)] == ["extra"]
    (left,) = [e for e in events if isinstance(e, LearnerLeft)]
    assert left.learner == "extra" and left.reason == "requested"
    assert not [e for e in events if isinstance(e, FailureDetected)]
    extra = summary["learners"]["extra"]
    assert extra["contributions_merged"] >= 3 and extra["restarts"] == 0
    assert extra["state"] == "left"
    assert summary["ledger_violations"] == []
    assert summary["tokens"] == sum(a["tokens"] for a in summary["learners"].values())
    assert [e for e in events if isinstance(e, RoundClosed) and e.t > left.t]
    # what a watcher sees (the progress display and the run report read these points)
    points = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    shown = [p["learners"]["extra"] for p in points if "extra" in p.get("learners", {})]
    assert any(ls["state"] == "training" and ls["merged"] > 0 for ls in shown)
    assert shown[-1]["state"] == "left" and shown[-1]["region"] == "local"


def test_scale_reports_a_bad_run_dir_in_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ray_diloco.cli", "scale", str(tmp_path), "--list"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 2
    assert (
        done.stderr == f"error: {tmp_path}/config.json not found; give the run_dir of a "
        "running job\n"
    )
