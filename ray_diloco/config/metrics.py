"""Layer: config (pydantic only). What a run exports to watch it: evaluations, progress points,
Ray metrics, TensorBoard and Weights & Biases."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ray_diloco.config.base import _Frozen


class WandbConfig(_Frozen):
    """Weights & Biases logging of the driver's progress points (`wandb` is imported only when
    this is enabled: `pip install ray_diloco[wandb]`)."""

    enabled: bool = Field(False, description="log every progress point to W&B (off: no import)")
    project: str = Field("ray_diloco", description="the W&B project")
    entity: str | None = Field(None, description="the W&B team or user (None: your default)")
    mode: Literal["online", "offline"] = Field(
        "online", description="offline: write the W&B run under run_dir to sync it later"
    )


class MetricsConfig(_Frozen):
    eval_every_s: float = Field(10.0, gt=0)
    log_every_s: float = Field(2.0, gt=0)
    export_ray_metrics: bool = True
    tensorboard: bool = Field(
        True, description="TensorBoard event files in run_dir/tensorboard (one run per learner)"
    )
    wandb: WandbConfig = Field(
        default_factory=WandbConfig, description="Weights & Biases logging (off by default)"
    )
