"""A tiny synchronizer for unit tests (no Ray): the config overrides and a core built from
them, shared by the checkpoint and publication tests, and its recovery after a restore."""

from __future__ import annotations

from collections.abc import Mapping

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
    # the learner offers on its own count (every H steps), which these tests drive by hand
    "diloco.schedule=offer",
]


def tiny_core(cfg: RunConfig) -> SynchronizerCore:
    setup = Setup.build(cfg)
    return SynchronizerCore(cfg, setup.plan, setup.init)


def registered_core(
    cfg: RunConfig, learners: tuple[str, ...], tokens_per_step: int
) -> SynchronizerCore:
    """`tiny_core` with `learners` registered at t = 0, each having reported a 0.1 s step."""
    core = tiny_core(cfg)
    for name in learners:
        core.register(name, 0, now=0.0, tokens_per_step=tokens_per_step)
        core.report(name, 0, now=0.0, step_time_s=0.1, cursor=0)
    return core


def resume_without_learners(core: SynchronizerCore, published: Mapping[int, int]) -> int:
    """Recovery after a restore with no learner to hand a value over: `published` holds the
    highest version of each fragment delivered before the restart. Where that is newer than
    what the checkpoint holds, the restored value gets a fresh version number above it
    (`finish_recovery`). Returns the rounds lost."""
    core.start_recovery([], published)
    return sum(core.finish_recovery(p)[1] for p in list(core.recovering))
