"""Layer: observe (no Ray, no JAX). The run's training curves where ML users look for them:
TensorBoard event files and, when asked, Weights & Biases.

`Telemetry.write(point)` takes every progress point the driver makes (`observe/progress.py`).
TensorBoard (tensorboardX's writer, `metrics.tensorboard`, on by default) gets one run per
learner under `run_dir/tensorboard/learners/<learner>`, so TensorBoard overlays the learners on one
chart per tag: `train/loss`, `train/lr` and `train/tokens` against the learner's inner step
(a point is written only when its step advanced), and one run `run` with `eval/heldout_loss`,
`throughput/tokens_per_s`, `run/rounds`, `run/contributors_per_round`, `run/goodput` and
`run/uptime` against the run's tokens. Every scalar carries the wall time of its poll.

W&B (`metrics.wandb.enabled`, off by default) logs the same values, the learners' as
`train/loss/<learner>` and so on, against the run's tokens. `wandb` is imported only then:
nothing else needs it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ray_diloco.config import ConfigError, RunConfig

TENSORBOARD_DIR = "tensorboard"
RUN = "run"  # the TensorBoard run of the run-level scalars, beside `learners/<name>`
LEARNER_TAGS = {"loss": "train/loss", "lr": "train/lr", "tokens": "train/tokens"}
RUN_TAGS = {
    "heldout_loss": "eval/heldout_loss",
    "tokens_per_s": "throughput/tokens_per_s",
    "rounds": "run/rounds",
    "contributors": "run/contributors_per_round",
    "goodput": "run/goodput",
    "uptime": "run/uptime",
}


class Telemetry:
    def __init__(self, cfg: RunConfig, run_dir: Path, t0: float) -> None:
        """`t0`: the wall time of run time 0 (a point's `t` is run time)."""
        self.cfg, self.t0 = cfg, t0
        self.root = run_dir / TENSORBOARD_DIR
        self._writers: dict[str, Any] = {}
        self._steps: dict[str, int] = {}
        self._wandb: Any = _start_wandb(cfg, run_dir) if cfg.metrics.wandb.enabled else None

    def write(self, point: Mapping[str, Any]) -> None:
        wall = self.t0 + float(point.get("t", time.time() - self.t0))
        tokens = int(point.get("tokens", 0))
        run_scalars = {
            tag: float(point[key]) for key, tag in RUN_TAGS.items() if point.get(key) is not None
        }
        learner_scalars: dict[str, dict[str, float]] = {}
        for name, ls in (point.get("learners") or {}).items():
            step = ls.get("step")
            if step is None or step <= self._steps.get(name, -1):
                continue  # nothing new from this learner since its last point
            self._steps[name] = int(step)
            learner_scalars[name] = {
                tag: float(ls[key]) for key, tag in LEARNER_TAGS.items() if ls.get(key) is not None
            }
        if self.cfg.metrics.tensorboard:
            for tag, value in run_scalars.items():
                self._writer(RUN).add_scalar(tag, value, tokens, walltime=wall)
            for name, scalars in learner_scalars.items():
                writer, step = self._writer(f"learners/{name}"), self._steps[name]
                for tag, value in scalars.items():
                    writer.add_scalar(tag, value, step, walltime=wall)
            for writer in self._writers.values():
                writer.flush()
        if self._wandb is not None:
            logged = dict(run_scalars)
            for name, scalars in learner_scalars.items():
                logged |= {f"{tag}/{name}": v for tag, v in scalars.items()}
            self._wandb.log(logged, step=tokens)

    def _writer(self, run: str) -> Any:
        if run not in self._writers:
            from tensorboardX import SummaryWriter

            self._writers[run] = SummaryWriter(str(self.root / run))
        return self._writers[run]

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _start_wandb(cfg: RunConfig, run_dir: Path) -> Any:
    w = cfg.metrics.wandb
    try:
        import wandb
    except ImportError:
        raise ConfigError(
            "metrics.wandb.enabled=true: the wandb package is not installed; "
            "`pip install ray_diloco[wandb]` or set metrics.wandb.enabled=false"
        ) from None
    return wandb.init(
        project=w.project,
        entity=w.entity,
        name=cfg.name,
        mode=w.mode,
        dir=str(run_dir),
        config=cfg.model_dump(mode="json"),
    )
