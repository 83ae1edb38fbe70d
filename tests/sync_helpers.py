"""A tiny synchronizer for unit tests (no Ray): the config overrides and a core built from
them, shared by the checkpoint and publication tests."""

from __future__ import annotations

from ray_diloco.algorithm.setup import Setup
from ray_diloco.algorithm.sync_core import SynchronizerCore
from ray_diloco.config import RunConfig

TINY = [
    "task_args.model.d_model=16",
    "task_args.model.num_layers=1",
    "task_args.model.num_heads=2",
    "task_args.model.d_ff=32",
    "task_args.model.seq_len=8",
    "diloco.sync_every=4",
    "diloco.num_fragments=2",
    "diloco.quorum_min=1",
    "diloco.grace_max_s=0",
]


def tiny_core(cfg: RunConfig) -> SynchronizerCore:
    setup = Setup.build(cfg)
    return SynchronizerCore(cfg, setup.plan, setup.init)
