"""Where a contribution's outer gradient is anchored (`diloco.outer_anchor`) and how far a
round steps (`diloco.round_step`), on the synchronizer core with plain SGD at outer lr 1 so
that every step is exact: G_new = G - (G - theta) * share."""

from __future__ import annotations

import numpy as np
import pytest

from ray_diloco.algorithm import wire
from ray_diloco.algorithm.round_types import ContributionMeta, Verdict
from ray_diloco.algorithm.sync_core import SynchronizerCore
from ray_diloco.config import load_config
from tests.sync_helpers import TINY, tiny_core

LEARNERS = ["a", "b", "c", "d"]
PLAIN_SGD = ["outer.lr=1", "outer.momentum=0", "diloco.merge=mean", "diloco.wire_dtype=float32"]


def _core(*overrides: str) -> SynchronizerCore:
    core = tiny_core(load_config(None, [*TINY, *PLAIN_SGD, *overrides]))
    for name in LEARNERS:
        core.register(name, 0, now=0.0)
        core.report(name, 0, now=0.0, step_time_s=0.1, cursor=0)
    return core


def _values(core: SynchronizerCore) -> dict[str, np.ndarray]:
    return core.snapshot()[0][1]


def _offer(
    core: SynchronizerCore, learner: str, base: int, update: float, now: float, close: bool = True
) -> int:
    """`learner` trained from version `base` and moved every value of fragment 0 by `update`;
    the round closes unless `close` is false. Returns how many contributions it merged."""
    delta = {k: np.full_like(v, update) for k, v in core.history.published[0][base].items()}
    meta = ContributionMeta(learner, 0, 0, base, 4 * (base + 1), 4, 256)
    assert core.offer(meta, wire.encode_tree(delta, "float32"), now=now) is Verdict.ACCEPTED
    if not close:
        return 0
    (pub,) = core.poll(now=now + 0.05)
    assert pub.fragment == 0
    return len(pub.close.contributions)


def _moved(after: dict[str, np.ndarray], before: dict[str, np.ndarray]) -> float:
    (step,) = {round(float(v), 6) for k in after for v in np.unique(after[k] - before[k])}
    return step


@pytest.mark.parametrize(("anchor", "kept"), [("base", True), ("current", False)])
def test_a_stale_contribution_adds_its_update_only_when_anchored_at_its_base(
    anchor: str, kept: bool
) -> None:
    core = _core(f"diloco.outer_anchor={anchor}", "diloco.round_step=full")
    v0 = _values(core)
    _offer(core, "b", base=0, update=0.25, now=0.1)  # version 1: G0 + 0.25
    _offer(core, "a", base=0, update=0.5, now=0.2)  # a never saw version 1
    # Anchored at its base, a's round adds a's own update to b's; anchored at the current
    # value it replaces G by a's values, and b's round is undone.
    assert _moved(_values(core), v0) == pytest.approx(0.75 if kept else 0.5)


@pytest.mark.parametrize(
    ("round_step", "step"),
    [("share", 0.25), ("fraction", 0.25), ("sqrt", 0.5), ("sqrt_each", 0.5), ("full", 1.0)],
)
def test_a_one_learner_round_steps_by_its_share_of_the_learners(
    round_step: str, step: float
) -> None:
    # share s = 1/4: "share" and "fraction" step s of the way, "sqrt" sqrt(s), "full" all of it
    core = _core(f"diloco.round_step={round_step}")
    v0 = _values(core)
    _offer(core, "c", base=0, update=0.5, now=0.1)  # 1 of the 4 live learners
    assert _moved(_values(core), v0) == pytest.approx(0.5 * step, abs=1e-6)


@pytest.mark.parametrize(("round_step", "step"), [("sqrt", 0.5**0.5), ("sqrt_each", 1.0)])
def test_a_two_learner_round_steps_by_its_rule(round_step: str, step: float) -> None:
    # Two of the 4 learners in one round: "sqrt" takes sqrt(2/4) of a step, "sqrt_each" 2 x
    # 1/sqrt(4), as far as the same two in rounds of their own.
    core = _core(f"diloco.round_step={round_step}")
    v0 = _values(core)
    _offer(core, "a", base=0, update=0.5, now=0.1, close=False)
    assert _offer(core, "b", base=0, update=0.5, now=0.1) == 2
    assert _moved(_values(core), v0) == pytest.approx(0.5 * step, abs=1e-6)
