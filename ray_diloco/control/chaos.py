"""Layer: control (pure Python; no Ray, no JAX). The seeded chaos schedule.

`chaos_schedule` turns a `ChaosConfig` into a sorted list of `FaultAction`s, fixed before the
run starts so a failure scenario is reproducible and can be recorded on the event tape: the
explicit `schedule` entries plus, when `mtbf_s` is set, one independent Poisson process per
learner. Every random draw comes from a `random.Random` seeded with the config seed plus a
stable label offset (zlib.crc32, never `hash()`, which is salted per process), so the same
config yields the same schedule in every process and adding a learner does not reshuffle the
faults of the others. The actors layer executes the actions (faults.py); `due` is the helper
its loop polls.
"""

from __future__ import annotations

import logging
import random
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

from ray_diloco.config import ChaosConfig, FaultKind
from ray_diloco.control.events import FaultInjected

log = logging.getLogger(__name__)

LEARNER_FAULTS: frozenset[str] = frozenset(
    {
        "kill_host",
        "kill_group",
        "remove_node",
        "hang_host",
        "straggler",
        "corrupt_nan",
        "corrupt_norm",
    }
)
LINK_FAULTS: frozenset[str] = frozenset({"cut_link", "slow_link"})
SYNCHRONIZER_FAULTS: frozenset[str] = frozenset({"kill_synchronizer"})
# ChaosConfig has no slowdown knob for random faults; a factor of 1.0 would be a no-op
# straggler, so Poisson-drawn straggler/slow_link faults use this one.
POISSON_SLOWDOWN = 4.0


@dataclass(frozen=True)
class FaultAction:
    """One fault to inject at `at_s` seconds after run start; `target` is a learner name for
    learner faults, a region for link faults and None for kill_synchronizer."""

    at_s: float
    kind: FaultKind
    target: str | None
    duration_s: float = 0.0
    factor: float = 1.0
    during_checkpoint: bool = False  # kill_synchronizer: while a checkpoint is being written

    def to_event(self, t: float, detail: str = "") -> FaultInjected:
        """The tape entry recording that this action was executed at `t`."""
        return FaultInjected(
            t=t, fault=self.kind, target=self.target, duration_s=self.duration_s, detail=detail
        )


def _rng(seed: int, label: str) -> random.Random:
    # One independent stream per (seed, label); crc32 is stable across processes and versions.
    return random.Random((seed << 32) + zlib.crc32(label.encode("utf-8")))


def _pick_target(
    kind: str, rng: random.Random, learners: list[str], regions: list[str]
) -> str | None:
    if kind in SYNCHRONIZER_FAULTS:
        return None
    pool, what = (regions, "region") if kind in LINK_FAULTS else (learners, "learner")
    if not pool:
        raise ValueError(f"chaos fault {kind!r} needs a {what} target but none was given")
    return rng.choice(sorted(pool))


def _check_target(kind: str, target: str, learners: list[str], regions: list[str]) -> None:
    if kind in SYNCHRONIZER_FAULTS:
        return
    pool, what = (regions, "region") if kind in LINK_FAULTS else (learners, "learner")
    if target not in pool:
        raise ValueError(
            f"chaos.schedule: {kind} target {target!r} is not a known {what}; "
            f"use one of {sorted(pool)} or leave target empty to pick by seed"
        )


def _sort_key(a: FaultAction) -> tuple[float, str, str]:
    return (a.at_s, a.target or "", a.kind)


def chaos_schedule(
    cfg: ChaosConfig, learners: list[str], regions: list[str], horizon_s: float
) -> list[FaultAction]:
    """All faults of the run, sorted by (at_s, target). Empty when chaos is disabled.

    Explicit entries are kept whatever their time (the horizon is only an estimate of the run's
    length); Poisson faults are drawn in [0, horizon_s). Raises ValueError for a target that
    names no known learner/region, or a fault that needs a target when there is none.
    """
    if not cfg.enabled:
        return []
    actions: list[FaultAction] = []
    for i, entry in enumerate(cfg.schedule):
        target = entry.target
        if target is None:
            # Per-entry stream: resolving entry i never depends on the other entries.
            target = _pick_target(entry.kind, _rng(cfg.seed, f"schedule/{i}"), learners, regions)
        else:
            _check_target(entry.kind, target, learners, regions)
        actions.append(
            FaultAction(
                entry.at_s,
                entry.kind,
                target,
                entry.duration_s,
                entry.factor,
                entry.during_checkpoint,
            )
        )
    if cfg.mtbf_s is not None:
        for learner in sorted(set(learners)):
            actions.extend(_poisson_faults(cfg, cfg.mtbf_s, learner, learners, regions, horizon_s))
    actions.sort(key=_sort_key)
    log.info(
        "chaos schedule: %d faults within %.0fs (seed %d, %d explicit)",
        len(actions),
        horizon_s,
        cfg.seed,
        len(cfg.schedule),
    )
    return actions


def _poisson_faults(
    cfg: ChaosConfig,
    mtbf_s: float,
    learner: str,
    learners: list[str],
    regions: list[str],
    horizon_s: float,
) -> list[FaultAction]:
    """One learner's faults: exponential inter-arrival times with mean `mtbf_s`."""
    rng = _rng(cfg.seed, f"poisson/{learner}")
    out: list[FaultAction] = []
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        if t >= horizon_s:
            return out
        kind = rng.choice(cfg.kinds)
        if kind in LEARNER_FAULTS:
            target: str | None = learner
        else:
            target = _pick_target(kind, rng, learners, regions)
        factor = POISSON_SLOWDOWN if kind in ("straggler", "slow_link") else 1.0
        out.append(FaultAction(t, kind, target, cfg.fault_duration_s, factor))


def due(actions: Iterable[FaultAction], last_t: float, now: float) -> list[FaultAction]:
    """Actions with `last_t < at_s <= now`, in order. A loop that passes its previous `now` as
    `last_t` fires each action exactly once; start with `last_t=float("-inf")` so faults at
    t=0 fire on the first poll."""
    return sorted((a for a in actions if last_t < a.at_s <= now), key=_sort_key)
