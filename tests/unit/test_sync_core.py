"""The synchronizer core's own rules (algorithm/sync_core.py) on a tiny model and a hand-driven
clock: the staleness discount in the merge weights, the outer warm-up, an offer that waited
while G moved, a learner that leaves, which published versions are kept, the merge's clock and
the bytes it reports resident."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ray_diloco.algorithm import wire
from ray_diloco.algorithm.merge import token_weight
from ray_diloco.algorithm.round_types import ContributionMeta, Verdict
from ray_diloco.algorithm.sync_core import SynchronizerCore
from ray_diloco.config import load_config
from tests.sync_helpers import TINY, registered_core, tiny_core

TOKENS_PER_STEP = 64


def _core(*overrides: str, learners: tuple[str, ...] = ("a", "b")) -> SynchronizerCore:
    return registered_core(load_config(None, [*TINY, *overrides]), learners, TOKENS_PER_STEP)


def _offer(
    core: SynchronizerCore,
    learner: str,
    base: int,
    step: int,
    now: float,
    size: float = 0.01,
    steps: int = 4,
) -> Verdict:
    """`learner` offers fragment 0 at inner step `step`, `steps` steps after it took `base`:
    theta = that version + `size`."""
    leaves = core.history.published[0][base]
    delta = {k: np.full(v.shape, size, np.float32) for k, v in leaves.items()}
    meta = ContributionMeta(learner, 0, 0, base, step, steps, steps * TOKENS_PER_STEP)
    return core.offer(meta, wire.encode_tree(delta, "float32"), now=now)


def _values(core: SynchronizerCore) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in core.values[0].items()}


def test_a_stale_contribution_weighs_less_by_the_staleness_penalty() -> None:
    core = _core("diloco.staleness_penalty=1.0", "diloco.quorum_min=2")
    assert _offer(core, "a", 0, 4, now=0.0) is Verdict.ACCEPTED
    assert _offer(core, "b", 0, 4, now=0.0) is Verdict.ACCEPTED
    assert [p.version for p in core.poll(now=0.0)] == [1]
    assert _offer(core, "a", 1, 8, now=1.0) is Verdict.ACCEPTED  # on the newest version
    # b, one version behind, offers its 4 new steps on version 0 (8 since it took it)
    assert _offer(core, "b", 0, 8, now=1.0, steps=8) is Verdict.ACCEPTED
    (close,) = core.close_due(now=1.0)
    tokens = 4 * TOKENS_PER_STEP
    learners = [c.meta.learner for c in close.contributions]
    weights = dict(zip(learners, core._weights(close), strict=True))
    assert weights == {
        "a": token_weight(tokens, 4),
        "b": token_weight(tokens, 4, staleness=1, staleness_penalty=1.0),
    }
    assert weights["b"] == weights["a"] / 2


def test_the_outer_warm_up_scales_the_first_rounds_step() -> None:
    # The first round of a fragment with a 2-round warm-up steps at half the outer lr: the
    # same contribution moves G half as far as without the warm-up (SGD, no momentum yet).
    moves = {}
    for rounds in (0, 2):
        core = _core(f"outer.warmup_rounds={rounds}", learners=("a",))
        before = _values(core)
        _offer(core, "a", 0, 4, now=0.0)
        core.poll(now=0.0)
        moves[rounds] = {k: core.values[0][k] - before[k] for k in before}
    for k, cold in moves[0].items():
        assert np.abs(cold).max() > 0
        np.testing.assert_allclose(moves[2][k], 0.5 * cold, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("anchor", ["current", "base"])
def test_an_offer_that_waited_while_g_moved_merges_as_if_it_came_after(anchor: str) -> None:
    # b's offer on version 0 arrives while a's round merges (it joins the next round) or just
    # after that round committed: the same theta, merged into the same G, at the same
    # staleness; the merge must not use norms or an anchor measured against the G it waited on.
    results = []
    for late in (True, False):
        core = _core(f"diloco.outer_anchor={anchor}")
        _offer(core, "a", 0, 4, now=0.0, size=0.02)
        (close,) = core.close_due(now=0.0)
        if late:  # after the round closed, before its merge moved G
            assert _offer(core, "b", 0, 4, now=0.1, size=-0.01) is Verdict.ACCEPTED
        pub = core.merge(close, sync_time_s=0.0)
        core.commit(pub, now=0.2)
        if not late:
            assert _offer(core, "b", 0, 4, now=0.2, size=-0.01) is Verdict.ACCEPTED
        assert [p.version for p in core.poll(now=0.3)] == [2]
        results.append(_values(core))
    for k, v in results[0].items():
        np.testing.assert_allclose(v, results[1][k], rtol=1e-6, atol=1e-8)


def test_a_learner_that_left_has_its_work_merged_and_its_data_returned() -> None:
    core = _core(learners=("a",))
    assert _offer(core, "a", 0, 4, now=0.0) is Verdict.ACCEPTED
    leases = core.leave("a", now=0.5)
    assert sum(lease.size for lease in leases) > 0
    assert core.history.bases[0] == {} and "a" not in core.book.live(now=0.5)
    # no learner left to be based on any version: the round still merges, the newest stays
    assert [p.version for p in core.poll(now=0.6)] == [1]
    assert list(core.history.published[0]) == [1]
    assert core.ledger.tokens_merged(0) == 4 * TOKENS_PER_STEP


def test_a_version_a_learner_is_still_based_on_is_kept() -> None:
    core = _core()
    _offer(core, "a", 0, 4, now=0.0)
    core.poll(now=0.0)
    _offer(core, "a", 1, 8, now=1.0)
    core.poll(now=1.0)
    # b never left version 0: it stays, and b's work on it is taken
    assert sorted(core.history.published[0]) == [0, 1, 2]
    assert _offer(core, "b", 0, 4, now=2.0) is Verdict.ACCEPTED
    core.poll(now=2.0)
    assert 0 in core.history.published[0]
    # once b's base moved on, version 0 goes; a's last offer was on version 1
    assert _offer(core, "b", 3, 8, now=3.0) is Verdict.ACCEPTED
    core.poll(now=3.0)
    assert sorted(core.history.published[0]) == [1, 2, 3, 4]


def test_the_merge_keeps_the_virtual_clock_and_times_itself_otherwise() -> None:
    core = _core(learners=("a",))
    _offer(core, "a", 0, 4, now=0.0)
    (pub,) = core.poll(now=0.0, sync_time_s=0.25)
    assert pub.sync_time_s == 0.25
    _offer(core, "a", 1, 8, now=1.0)
    (pub,) = core.poll(now=1.0)
    assert 0.0 < pub.sync_time_s < 60.0


def test_resident_bytes_count_every_array_once() -> None:
    core = _core()
    params = sum(a.size for v in core.values.values() for a in v.values())
    # version 0 is the global value itself (the same arrays): no bytes of its own
    assert core.resident_bytes() == {
        "global": 4 * params,
        "momentum": 4 * params,
        "versions": 0,
        "differences": 0,
        "held": 0,
    }


def test_a_broken_offer_claiming_no_tokens_loses_none() -> None:
    core = _core()
    delta = wire.encode_tree({"no such leaf": np.zeros(2, np.float32)}, "float32")
    meta = ContributionMeta("a", 0, 0, 0, 4, 4, 0)
    assert core.offer(meta, delta, now=0.0) is Verdict.MALFORMED
    assert core.rejected_tokens == 0
    bigger = dataclasses.replace(meta, num_tokens=4 * TOKENS_PER_STEP)
    assert core.offer(bigger, delta, now=0.0) is Verdict.MALFORMED
    assert core.rejected_tokens == 4 * TOKENS_PER_STEP


def test_a_restore_before_any_round_keeps_version_0_exact() -> None:
    # Version 0 is the float32 initialisation every learner starts from, bit for bit; a
    # restored core must not round it to the dtype later versions are kept in (bfloat16).
    core = _core()
    restored = tiny_core(core.cfg)
    restored.load_state_dict(core.state_dict(), now=1.0)
    for k, v in core.history.published[0][0].items():
        kept = restored.history.published[0][0][k]
        assert kept.dtype == np.float32
        np.testing.assert_array_equal(kept, v)


def test_a_leave_lets_the_round_it_held_back_reach_its_quorum_then() -> None:
    core = _core("diloco.quorum_min=2")
    assert _offer(core, "a", 0, 4, now=0.0) is Verdict.ACCEPTED
    assert core.book.fragments[0].quorum_s is None  # K = 2: waits for b
    core.leave("b", now=0.5)
    assert core.book.fragments[0].quorum_s == 0.5  # K falls to the one learner left
    assert [p.version for p in core.poll(now=0.5)] == [1]


def test_a_learner_that_leaves_before_it_registered_changes_nothing() -> None:
    core = _core()
    assert core.leave("never-registered", now=1.0) == []
    assert set(core.history.bases[0]) == {"a", "b"}


def test_the_final_round_merges_work_short_of_the_quorum_and_counts_it_merged() -> None:
    # K = 2, and only a's work is held when the run ends: no round is due, the final round
    # merges it like any other (the ledger counts its tokens, the fragment moves).
    core = _core("diloco.quorum_min=2")
    assert _offer(core, "a", 0, 4, now=0.0) is Verdict.ACCEPTED
    assert core.close_due(now=1.0) == []
    before = _values(core)
    (close,) = core.close_final(now=1.0)
    pub = core.merge(close)
    core.commit(pub, now=1.0)
    assert pub.version == 1 and core.ledger.tokens_merged(0) == 4 * TOKENS_PER_STEP
    assert any(not np.array_equal(before[k], v) for k, v in core.values[0].items())
    assert core.close_final(now=1.0) == [] and not core.book.open_work()
