"""A tiny synchronizer for unit tests (no Ray): the config overrides and a core built from
them, shared by the checkpoint and publication tests."""

from __future__ import annotations

from ray_diloco.algorithm.sync_core import SynchronizerCore
from ray_diloco.config import RunConfig
from ray_diloco.sim.simulate import fragment_plan
from ray_diloco.tasks import transformer as model

TINY = [
    "model.d_model=16",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.d_ff=32",
    "model.seq_len=8",
    "diloco.sync_every=4",
    "diloco.num_fragments=2",
    "diloco.quorum_min=1",
    "diloco.grace_max_s=0",
]


def tiny_core(cfg: RunConfig) -> SynchronizerCore:
    return SynchronizerCore(cfg, fragment_plan(cfg), model.init_params(cfg.model, cfg.seed))
