"""Layer: algorithm (pure, no Ray). The method's variants: each `diloco.*` choice that changes
the math is a small function here, chosen once when a core is built (`Variants.of`), so that
the merge, the round book and the learner read as the method and name the rule they apply.
docs/decisions/020-variants-as-strategies.md says which variant is the default and why.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ray_diloco.algorithm.fragments import fragment_offset
from ray_diloco.config import DilocoConfig

Values = dict[str, np.ndarray]

# (learners the round merged, learners in the run) -> (scale of its outer gradient, the share
# of one outer step it takes, momentum decay included: `outer.outer_step(fraction=...)`).
RoundStep = Callable[[int, int], tuple[float, float]]


def _share(merged: int, learners: int) -> float:
    return min(1.0, merged / learners)


def step_full(merged: int, learners: int) -> tuple[float, float]:
    """A whole outer step, however few learners the round merged (docs/algorithm.md section 6)."""
    return 1.0, 1.0


def step_share(merged: int, learners: int) -> tuple[float, float]:
    """The gradient scaled by the share of the learners merged; momentum decays every round."""
    return _share(merged, learners), 1.0


def step_fraction(merged: int, learners: int) -> tuple[float, float]:
    """The round is that share of an outer step: M one-learner rounds make one step of M."""
    return 1.0, _share(merged, learners)


def step_sqrt(merged: int, learners: int) -> tuple[float, float]:
    """sqrt(share) of an outer step: a round of everyone is one step, one of 4 learners half."""
    return 1.0, _share(merged, learners) ** 0.5


def step_sqrt_each(merged: int, learners: int) -> tuple[float, float]:
    """Each merged learner is 1/sqrt(learners) of a step, the round at most one."""
    return 1.0, min(1.0, _share(merged, learners) * learners**0.5)


ROUND_STEPS: dict[str, RoundStep] = {
    "full": step_full,
    "share": step_share,
    "fraction": step_fraction,
    "sqrt": step_sqrt,
    "sqrt_each": step_sqrt_each,
}

# (merge weights, inner steps of each contribution, H) -> the share of the round's outer
# gradient that goes through the outer optimizer (the rest moves G as it is).
Accelerate = Callable[[Sequence[float], Sequence[int], int], float]


def accelerate_all(weights: Sequence[float], steps: Sequence[int], sync_every: int) -> float:
    """The whole outer gradient through the outer optimizer (docs/algorithm.md section 6)."""
    return 1.0


def accelerate_window(weights: Sequence[float], steps: Sequence[int], sync_every: int) -> float:
    """One sync window's worth: 1/m of a round whose contributions cover m > 1 windows of H
    inner steps on weighted average (work trained through an outage is taken, not amplified)."""
    total = sum(weights)
    if total <= 0:
        return 1.0
    covered = sum(w * n for w, n in zip(weights, steps, strict=True))
    return min(1.0, sync_every * total / covered) if covered > 0 else 1.0


ACCELERATE: dict[str, Accelerate] = {"all": accelerate_all, "window": accelerate_window}


@dataclass(frozen=True)
class Anchor:
    """Where a contribution's outer gradient is anchored (`diloco.outer_anchor`). `current`:
    G - theta at the synchronizer's current value (docs/algorithm.md section 6). `base`: the
    learner's own update, base - theta, whatever happened to G since (Streaming DiLoCo)."""

    own_update: bool

    def start(self, current: Values, base: Values) -> Values:
        """What an offer's wire delta (theta - its base) is added to, to hold it."""
        return current if self.own_update else base

    def moved_from(self, held_at: Values, g: Values) -> Values | None:
        """A contribution held while G was `held_at` and merged into `g`: the G it moves along
        from (a base-anchored one is G plus its own update), or None when taken as held."""
        return held_at if self.own_update and held_at is not g else None


ANCHORS = {"current": Anchor(own_update=False), "base": Anchor(own_update=True)}

# (the learners a round merged, the live learners) -> who receives the merged fragment.
Recipients = Callable[[set[str], Iterable[str]], list[str]]


def to_all(merged: set[str], live: Iterable[str]) -> list[str]:
    """Every live learner (docs/algorithm.md section 5)."""
    return list(live)


def to_contributors(merged: set[str], live: Iterable[str]) -> list[str]:
    """Only the learners the round merged (one version back per contribution)."""
    return [n for n in live if n in merged]


PUBLISH_TO: dict[str, Recipients] = {"all": to_all, "contributors": to_contributors}


class OwnCount:
    """`schedule: offer`: each learner offers fragment p when p falls due on its own step count
    (docs/algorithm.md section 4); the synchronizer asks for nothing."""

    def reported(self, step: int) -> list[int]:
        return []


class PullClock:
    """`schedule: pull` (docs/algorithm.md section 5, the open question): learners report their
    step every step, and when fragment p falls due on the count of the learner furthest ahead
    (the first to report a due step of p past the last pull) the synchronizer pulls p's current
    value from every live learner. Each then contributes every round, whatever its speed: the
    slower ones with fewer steps, weighted by their tokens."""

    def __init__(self, sync_every: int, num_fragments: int, fragments: Iterable[int]) -> None:
        self.sync_every = sync_every
        self.offsets = {p: fragment_offset(p, sync_every, num_fragments) for p in fragments}
        self.next = {p: self._after(p, 0) for p in self.offsets}

    def _after(self, p: int, step: int) -> int:
        """The first step after `step` at which p is due: `(s + offset_p) % H == 0`."""
        return step + self.sync_every - (step + self.offsets[p]) % self.sync_every

    def reported(self, step: int) -> list[int]:
        """A learner completed `step` inner steps: the fragments to pull now, ascending."""
        due = sorted(p for p, s in self.next.items() if step >= s)
        for p in due:
            self.next[p] = self._after(p, step)
        return due


Schedule = OwnCount | PullClock
SCHEDULES: dict[str, Callable[[DilocoConfig, Iterable[int]], Schedule]] = {
    "offer": lambda d, fragments: OwnCount(),
    "pull": lambda d, fragments: PullClock(d.sync_every, d.num_fragments, fragments),
}


def schedule(d: DilocoConfig, fragments: Iterable[int]) -> Schedule:
    """The synchronizer's side of `diloco.schedule` for the fragments it owns."""
    return SCHEDULES[d.schedule](d, fragments)


@dataclass(frozen=True)
class Variants:
    """The synchronizer's variants, chosen once from the config."""

    round_step: RoundStep
    accelerate: Accelerate
    anchor: Anchor
    recipients: Recipients

    @classmethod
    def of(cls, d: DilocoConfig) -> Variants:
        return cls(
            ROUND_STEPS[d.round_step],
            ACCELERATE[d.accelerate],
            ANCHORS[d.outer_anchor],
            PUBLISH_TO[d.publish_to],
        )


def scaled(scales: Mapping[str, float], factor: float) -> dict[str, float]:
    """Each leaf's outer-gradient scale times `factor` (1.0 leaves them exactly as they are)."""
    return {k: s * factor for k, s in scales.items()}
