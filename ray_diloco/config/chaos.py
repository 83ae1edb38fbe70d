"""Layer: config (pydantic only). Fault injection: the faults a run schedules, or draws at a
rate, and what the in-process reference run charges for them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ray_diloco.config.base import _Frozen

FaultKind = Literal[
    "kill_host",
    "kill_group",
    "remove_node",
    "hang_host",
    "straggler",
    "cut_link",
    "slow_link",
    "corrupt_nan",
    "corrupt_norm",
    "kill_synchronizer",
]


class ScheduledFault(_Frozen):
    at_s: float = Field(ge=0)
    kind: FaultKind
    target: str | None = Field(
        None, description="learner name, region or synchronizer shard; None picks by seed"
    )
    duration_s: float = Field(0.0, ge=0)
    factor: float = Field(1.0, gt=0, description="slowdown factor for straggler/slow_link")
    during_checkpoint: bool = Field(
        False,
        description="kill_synchronizer only: start a checkpoint write and kill while it runs",
    )

    @model_validator(mode="after")
    def _checkpoint_kill(self) -> ScheduledFault:
        if self.during_checkpoint and self.kind != "kill_synchronizer":
            raise ValueError(
                f"during_checkpoint applies to kill_synchronizer only, not {self.kind}; remove it"
            )
        return self


class ChaosConfig(_Frozen):
    enabled: bool = False
    seed: int = 0
    mtbf_s: float | None = Field(None, gt=0, description="mean time between failures per learner")
    kinds: tuple[FaultKind, ...] = ("kill_host",)
    schedule: tuple[ScheduledFault, ...] = ()
    fault_duration_s: float = Field(3.0, ge=0)
    # Failure costs the in-process reference run charges (a Ray run measures them instead).
    restart_s: float = Field(1.0, ge=0, description="detection + restart + compile, virtual s")
    dp_checkpoint_every_steps: int = Field(50, ge=1, description="data-parallel checkpoints")
