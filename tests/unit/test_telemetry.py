"""Training telemetry: each progress point carries every learner's training loss, learning rate,
tokens and steps (metrics.jsonl), TensorBoard event files in the run dir hold them (read back
with the tensorboard package's EventAccumulator, as TensorBoard reads them), and W&B gets the
same values only when asked (never imported otherwise)."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from ray_diloco.config import RunConfig, load_config
from ray_diloco.control.events import LearnerState
from ray_diloco.control.protocol import LearnerProgress, LearnerRow, SupervisorStatus
from ray_diloco.observe.progress import ProgressTracker
from ray_diloco.observe.telemetry import Telemetry
from tests.status_helpers import sync_status

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "fixtures" / "tiny_train.yaml"
REGIONS = {"a": "local", "b": "local"}


def _points(lr_at: Any = None) -> list[dict[str, Any]]:
    """Three polls: learner a trains (loss falls), b reports its second step only once."""
    tracker = ProgressTracker(10_000, REGIONS, lr_at=lr_at)
    reports = [
        {"a": (2, 256, 5.5), "b": (1, 128, 5.6)},
        {"a": (5, 640, 4.9), "b": (1, 128, 5.6)},  # b did not advance
        {"a": (9, 1152, 4.1), "b": (4, 512, 5.0)},
    ]
    points = []
    for i, rep in enumerate(reports):
        st = sync_status(
            tokens=sum(r[1] for r in rep.values()),
            heldout_loss=5.0 - i if i else None,
            rounds=i,
            learners={
                n: LearnerProgress(s, c, loss, 0.1, i + 1, 0.0) for n, (s, c, loss) in rep.items()
            },
        )
        training = {n: LearnerRow(LearnerState.TRAINING, 0, 0) for n in rep}
        points.append(tracker.point(10.0 * (i + 1), st, SupervisorStatus(learners=training)))
    return points


def test_a_progress_point_carries_each_learners_training_curve() -> None:
    last = _points(lr_at=lambda step: 1e-3 * step)[-1]["learners"]
    a = last["a"]
    assert (a["step"], a["tokens"], a["loss"]) == (9, 1152, 4.1)
    assert a["lr"] == pytest.approx(9e-3)
    assert (last["b"]["step"], last["b"]["loss"]) == (4, 5.0)
    assert _points()[-1]["learners"]["a"]["lr"] is None  # a task's own optimizer: unknown


def test_the_learning_rate_is_the_schedule_the_learners_step_with() -> None:
    import dataclasses

    from ray_diloco.algorithm import inner
    from ray_diloco.algorithm.setup import learning_rate, total_inner_steps
    from tests.fixtures.custom_task import make_task

    cfg = load_config(TINY)
    own = make_task()
    assert learning_rate(cfg, own) is None  # its own optax schedule: not ray_diloco's to read
    task = dataclasses.replace(own, optimizer=None)  # the config's AdamW
    lr_at = learning_rate(cfg, task)
    assert lr_at is not None
    schedule = inner.make_lr_schedule(cfg.inner, total_inner_steps(cfg, task))
    for step in (0, cfg.inner.warmup_steps, 3 * cfg.inner.warmup_steps):
        assert lr_at(step) == pytest.approx(float(schedule(step)))
    assert lr_at(cfg.inner.warmup_steps) == pytest.approx(cfg.inner.lr)


def test_tensorboard_lists_every_learners_training_loss(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = load_config(TINY)
    telemetry = Telemetry(cfg, tmp_path, t0=1_000_000.0)
    for point in _points(lr_at=lambda step: 1e-3 * step):
        telemetry.write(point)
    telemetry.close()

    def scalars(run: str, tag: str) -> list[tuple[int, float, float]]:
        acc = EventAccumulator(str(tmp_path / "tensorboard" / run))
        acc.Reload()
        return [(e.step, round(e.value, 6), e.wall_time) for e in acc.Scalars(tag)]

    assert [s[:2] for s in scalars("learners/a", "train/loss")] == [(2, 5.5), (5, 4.9), (9, 4.1)]
    assert [s[:2] for s in scalars("learners/b", "train/loss")] == [(1, 5.6), (4, 5.0)]
    assert [s[:2] for s in scalars("learners/a", "train/tokens")][-1] == (9, 1152)
    assert [s[1] for s in scalars("learners/a", "train/lr")] == [0.002, 0.005, 0.009]
    assert [s[2] for s in scalars("learners/a", "train/loss")] == [1_000_010, 1_000_020, 1_000_030]
    # the global model's held-out loss against the run's tokens, once it was evaluated
    assert [s[:2] for s in scalars("run", "eval/heldout_loss")] == [(768, 4.0), (1664, 3.0)]


def test_wandb_is_imported_only_when_enabled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` would fail
    off = load_config(TINY, ["metrics.tensorboard=false"])
    Telemetry(off, tmp_path, 0.0).write(_points()[-1])  # never imports it
    assert not (tmp_path / "tensorboard").exists()

    logged: list[tuple[dict[str, float], int]] = []
    fake = types.SimpleNamespace(
        init=lambda **kw: types.SimpleNamespace(
            log=lambda d, step: logged.append((d, step)), finish=lambda: None, kw=kw
        )
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    on: RunConfig = load_config(TINY, ["metrics.tensorboard=false", "metrics.wandb.enabled=true"])
    telemetry = Telemetry(on, tmp_path, 0.0)
    for point in _points():
        telemetry.write(point)
    telemetry.close()
    values, step = logged[-1]
    assert step == 1664 and values["train/loss/a"] == 4.1 and values["eval/heldout_loss"] == 3.0
    assert "train/loss/b" not in logged[1][0]  # b did not advance at the second poll
