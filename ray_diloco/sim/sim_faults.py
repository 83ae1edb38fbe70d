"""Layer: sim (pure, no Ray). Learner failures in the in-process reference run.

The seeded chaos schedule of `control/chaos.py` decides when which learner dies (every fault
that takes a learner's process or host down counts: kill_host, kill_group, remove_node,
hang_host). On the virtual clock a failure costs what it costs a real learner (docs/algorithm.md
sections 7 and 9):
- DiLoCo: the learner stops; the work it did on each fragment since it last handed that
  fragment over is lost; `chaos.restart_s` later a new incarnation adopts the published
  fragments and resumes its data cursor from the token ledger. The others keep going (a
  synchronous barrier waits for it, which is why that mode stalls).
- data-parallel: one learner spans every host, so any failure stalls the whole job for
  `restart_s` and rolls it back to its last checkpoint (`chaos.dp_checkpoint_every_steps`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from ray_diloco.algorithm.learner_core import LearnerCore
from ray_diloco.config import RunConfig
from ray_diloco.control.chaos import chaos_schedule

DEADLY = frozenset({"kill_host", "kill_group", "remove_node", "hang_host"})


def failure_times(cfg: RunConfig, horizon_s: float) -> list[tuple[float, int]]:
    """(virtual time, learner index) of every learner failure in the run's chaos schedule."""
    if not cfg.chaos.enabled:
        return []
    names = [lg.name for lg in cfg.learners]
    regions = sorted({lg.region for lg in cfg.learners})
    actions = chaos_schedule(cfg.chaos, names, regions, horizon_s)
    return [(a.at_s, names.index(a.target)) for a in actions if a.kind in DEADLY and a.target]


def horizon(cfg: RunConfig, tokens_per_example: int) -> float:
    """A generous bound on the run's virtual length, for drawing random failures."""
    tokens_per_s = sum(
        lg.batch_size * tokens_per_example * lg.speed / cfg.step_time_s for lg in cfg.learners
    )
    return 4.0 * cfg.token_budget / tokens_per_s + 10 * cfg.chaos.restart_s


def lost_steps(core: LearnerCore) -> float:
    """Steps of a dying learner's work that never reach the global model, averaged over
    fragments: those after its last offer of the fragment (an offer already sent still
    arrives and is merged), or all since it last received it when none is outstanding."""
    per_fragment = []
    for p in range(core.plan.num_fragments):
        offered = core.outstanding.get(p)
        per_fragment.append(core.step - offered[0] if offered else core.steps_since[p])
    return sum(per_fragment) / len(per_fragment)


def _copy(tree: Any) -> Any:
    return jax.tree.map(jnp.copy, tree)


@dataclass
class DataParallelCheckpoint:
    """What a data-parallel job restarts from: parameters, optimizer state and data cursor."""

    params: Any
    opt_state: Any
    cursor: int
    step: int

    @classmethod
    def take(cls, core: LearnerCore) -> DataParallelCheckpoint:
        # Copies on the devices: the learner's step donates the arrays it is given.
        return cls(_copy(core.params), _copy(core.opt_state), core.cursor, core.step)

    def restore(self, core: LearnerCore) -> int:
        """Roll `core` back; returns the number of steps that must be redone."""
        redo = core.step - self.step
        core.params, core.opt_state = _copy(self.params), _copy(self.opt_state)
        core.seek(self.cursor)
        core.step = self.step
        return redo
