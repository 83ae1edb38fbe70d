"""Layer: algorithm (pure, no Ray, no arrays). The guards that judge a contribution's numbers
(docs/algorithm.md section 7; the round state machine in rounds.py applies them in order): its
counters (`implausible`) and its norm (`NormHistory`, armed by rounds.py).

The norm guard's statistic is a contribution's own update (its delta to its base) per inner
step, kept for updates taken after the inner warm-up. A learner is judged against the median of
its own recent ones: a learner that joined late or restarted (fresh Adam moments: steps of
about the learning rate per coordinate) moves many times farther per step than one whose
moments have settled, and against the fragment's median a late learner of the custom task had
all 14 of its offers refused. Until it has `OWN_HISTORY` of its own it is judged against
everyone's with the guard squared, which still refuses a corrupted update (1e4 times too long).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ray_diloco.algorithm.round_types import ContributionMeta, RoundPolicy, Verdict

NORM_HISTORY = 32  # accepted per-step update norms kept for each running median
OWN_HISTORY = 3  # a learner's own accepted norms before it is judged against them alone


def implausible(
    meta: ContributionMeta, tokens_per_step: int | None, max_tokens: int | None
) -> bool:
    """Counters no honest learner sends: more steps since its base than it took in all, more
    tokens than its steps can read, or more work than the whole run's budget and the one step
    that crosses it (a learner stops once its own count reaches the budget; the norm guard
    divides by the steps, and the merge weighs by the tokens: neither may be inflated at will)."""
    if meta.num_steps > meta.step:
        return True
    if tokens_per_step is not None and meta.num_tokens > meta.num_steps * tokens_per_step:
        return True
    step = tokens_per_step or 0
    work = max(meta.num_tokens, meta.num_steps * step)
    return max_tokens is not None and work > max_tokens + step


def _history(values: Iterable[float] = ()) -> deque[float]:
    return deque((float(x) for x in values), maxlen=NORM_HISTORY)


@dataclass
class NormHistory:
    """One fragment's per-step norms: everyone's, and each learner's of its incarnation."""

    everyone: deque[float] = field(default_factory=_history)
    own: dict[str, deque[float]] = field(default_factory=dict)

    def record(self, learner: str, per_step: float) -> None:
        self.everyone.append(per_step)
        self.own.setdefault(learner, _history()).append(per_step)

    def forget(self, learner: str) -> None:
        """A new incarnation of `learner` starts with fresh moments: its history starts over."""
        self.own.pop(learner, None)

    def outlier(self, learner: str, per_step: float, guard: float) -> bool:
        own = self.own.get(learner, ())
        if len(own) >= OWN_HISTORY and (median := statistics.median(own)) > 0:
            return per_step > guard * median
        median = statistics.median(self.everyone) if self.everyone else 0.0
        return median > 0 and per_step > guard**2 * median

    def state(self) -> tuple[list[float], dict[str, list[float]]]:
        return list(self.everyone), {n: list(d) for n, d in self.own.items()}

    def load(self, everyone: Iterable[float], own: Mapping[str, Iterable[float]]) -> None:
        self.everyone.extend(float(x) for x in everyone)
        self.own.update({n: _history(d) for n, d in own.items()})


class Gate:
    """The fences and guards a contribution passes before it joins its fragment's round, in
    order. The round book owns one and hands each check the state it reads."""

    def __init__(self, policy: RoundPolicy) -> None:
        self.policy = policy

    def verdict(
        self,
        meta: ContributionMeta,
        incarnation: int | None,
        tokens_per_step: int | None,
        version: int,
        held: bool,
        last_step: int,
        norms: NormHistory,
        finite: bool,
        norm: float | None,
    ) -> Verdict:
        """`incarnation`: the learner's registered one (None: unknown); `version`: the
        fragment's; `held`: its value is being recovered; `last_step`: the step of the
        learner's newest accepted offer of this fragment (-1: none)."""
        if incarnation is None:
            return Verdict.UNKNOWN_LEARNER
        if meta.incarnation != incarnation:
            return Verdict.OLD_INCARNATION
        # Non-finite before the version checks: it says the learner's state may be corrupt
        # (the supervisor restarts it), which matters however stale the contribution is.
        if not finite or (norm is not None and norm != norm):
            return Verdict.NON_FINITE
        if held:
            return Verdict.RECOVERING
        if meta.base_version > version:
            return Verdict.FUTURE_VERSION
        if version - meta.base_version > self.policy.max_staleness_versions:
            return Verdict.STALE_VERSION
        if meta.num_steps <= 0 or meta.num_tokens <= 0:
            return Verdict.EMPTY
        if implausible(meta, tokens_per_step, self.policy.max_tokens):
            return Verdict.IMPLAUSIBLE
        if meta.step <= last_step:
            # An incarnation's steps only grow: an offer no newer than one already taken is a
            # replay (resent, duplicated or reordered), and taking it would count its work twice.
            return Verdict.REPLAYED
        if norm is not None and self._outlier(version, norms, meta, norm):
            return Verdict.NORM_OUTLIER
        return Verdict.ACCEPTED

    def accepted(self, norms: NormHistory, meta: ContributionMeta, norm: float | None) -> None:
        """An accepted contribution's norm per step joins the guard's medians."""
        if norm is not None and self._after_warmup(meta):
            norms.record(meta.learner, norm / meta.num_steps)

    def _after_warmup(self, meta: ContributionMeta) -> bool:
        """Every step of the contribution came after the inner learning-rate warm-up."""
        return meta.step - meta.num_steps >= self.policy.inner_warmup_steps

    def _outlier(
        self, version: int, norms: NormHistory, meta: ContributionMeta, norm: float
    ) -> bool:
        """The norm guard (docs/algorithm.md section 7, revised): the learner's own update per
        inner step against its own recent ones. Its own update, because the distance to the
        current global value includes other learners' drift; per step, because a contribution
        covering more steps is longer by construction; only updates after the inner warm-up,
        during which they grow tenfold. Armed once the fragment closed
        `norm_guard_warmup_rounds` rounds (rounds, not stored norms: with M learners one round
        adds M of them) and holds a norm from after the warm-up."""
        warm = version >= max(1, self.policy.norm_guard_warmup_rounds)
        if not (warm and norms.everyone and self._after_warmup(meta)):
            return False
        return norms.outlier(meta.learner, norm / meta.num_steps, self.policy.norm_guard)
