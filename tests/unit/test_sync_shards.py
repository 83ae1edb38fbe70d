"""A synchronizer split into shards (algorithm/shards.py, sync_core `fragments`/`owns_data`,
runtime/synchronizer/shards.py `combine_status`): the shards together compute exactly what one
synchronizer does, only shard 0 hands out data, and their statuses add up."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ray_diloco.algorithm import wire
from ray_diloco.algorithm.round_types import ContributionMeta, Verdict
from ray_diloco.algorithm.setup import Setup
from ray_diloco.algorithm.shards import assign_fragments
from ray_diloco.algorithm.sync_core import SynchronizerCore
from ray_diloco.config import load_config
from ray_diloco.control.protocol import LearnerProgress, Registered, SynchronizerStatus
from ray_diloco.runtime.synchronizer.shards import combine_status
from tests.status_helpers import sync_status
from tests.sync_helpers import TINY

LEARNERS = ("a", "b")


@pytest.fixture(scope="module")
def setup() -> Setup:
    return Setup.build(load_config(None, [*TINY, "diloco.num_fragments=3"]))


def _cores(setup: Setup, num_shards: int) -> list[SynchronizerCore]:
    owned = assign_fragments(setup.plan.sizes, num_shards)
    cores = [
        SynchronizerCore(setup.cfg, setup.plan, setup.init, fragments, owns_data=s == 0)
        for s, fragments in enumerate(owned)
    ]
    for core in cores:
        for name in LEARNERS:
            core.register(name, 0, now=0.0)
            core.report(name, 0, now=0.0, step_time_s=0.1, cursor=2048)
    return cores


def _delta(setup: Setup, fragment: int, learner: str, version: int) -> dict[str, wire.Encoded]:
    rng = np.random.default_rng([fragment, LEARNERS.index(learner), version])
    values = {
        k: rng.normal(0, 0.01, np.shape(setup.init[k])) for k in setup.plan.fragments[fragment]
    }
    return wire.encode_tree(values, "bfloat16")


def _run_rounds(setup: Setup, cores: list[SynchronizerCore], rounds: int) -> None:
    """The same offers, each to the core that owns its fragment, then every due round."""
    owner = {p: c for c in cores for p in c.owned}
    now = 0.0
    for version in range(rounds):
        for p in range(setup.plan.num_fragments):
            for name in LEARNERS:
                meta = ContributionMeta(name, 0, p, version, 4 * (version + 1), 4, 512)
                assert (
                    owner[p].offer(meta, _delta(setup, p, name, version), now) is Verdict.ACCEPTED
                )
        now += 10.0  # past every grace window
        for core in cores:
            core.poll(now)


def test_shards_merge_exactly_what_one_synchronizer_merges(setup: Setup) -> None:
    single, sharded = _cores(setup, 1), _cores(setup, 2)
    assert [c.owned for c in sharded] == list(assign_fragments(setup.plan.sizes, 2))
    _run_rounds(setup, single, 3)
    _run_rounds(setup, sharded, 3)
    one = single[0].snapshot()
    both = {p: v for c in sharded for p, v in c.snapshot().items()}
    assert sorted(both) == sorted(one) == [0, 1, 2]
    for p, (version, values) in one.items():
        assert both[p][0] == version == 3
        for k, v in values.items():
            np.testing.assert_array_equal(both[p][1][k], v)
    # The ledger's merged tokens per fragment, split over the shards, add up to the single one's.
    merged = {n: a.merged for n, a in single[0].ledger.accounts.items()}
    for name, per_fragment in merged.items():
        split = {p: t for c in sharded for p, t in c.ledger.account(name).merged.items()}
        assert split == per_fragment
    assert all(c.ledger.violations() == [] for c in [*single, *sharded])


def test_only_shard_zero_hands_out_data_and_wrong_routing_is_refused(setup: Setup) -> None:
    zero, one = _cores(setup, 2)
    assert zero.ledger.pool.holders and not one.ledger.pool.holders
    assert one.register("c", 0, now=1.0, held=([], 0, 2048)).leases == []
    assert one.report("c", 0, now=1.0, step_time_s=0.1, cursor=4096) == []
    assert one.ledger.resume_cursor("c") == 4096  # it still knows the cursor (the budget)
    p = one.owned[0]
    meta = ContributionMeta("a", 0, p, 0, 4, 4, 512)
    assert zero.offer(meta, _delta(setup, p, "a", 0), now=1.0) is Verdict.MALFORMED
    assert one.offer(meta, _delta(setup, p, "a", 0), now=1.0) is Verdict.ACCEPTED


def _status(
    shard: int, rounds: int, merged: dict[str, int], violations: list[str]
) -> SynchronizerStatus:
    return sync_status(
        shard=shard,
        fragments=[shard],
        tokens=1000,
        rounds=rounds,
        versions={shard: rounds},
        live=["a"],
        contributions_merged=merged,
        bytes_up={"a": 10},
        bytes_down={"a": 20},
        rejected={"stale_version": 1},
        ledger_violations=violations,
        tokens_dropped=7 * (shard + 1),
        registered={"a": Registered(0, {shard: rounds})},
        merged_incarnations={"a": shard},
        merged_steps={"a": 10 * (2 - shard)},
    )


def test_combined_status_adds_up_the_shards() -> None:
    st = combine_status(
        [_status(0, 4, {"a": 6}, []), _status(1, 2, {"a": 3, "b": 1}, ["a: fragment 1"])]
    )
    assert st.rounds == 6 and st.versions == {0: 4, 1: 2}
    assert st.contributions_merged == {"a": 9, "b": 1}
    assert st.mean_contributors == pytest.approx(10 / 6)
    assert st.bytes_up == {"a": 20} and st.rejected == {"stale_version": 2}
    assert st.ledger_violations == ["shard 1: a: fragment 1"]
    assert st.tokens == 1000 and st.tokens_dropped == 7  # shard 0's books
    assert st.merged_steps == {"a": 20} and st.merged_incarnations == {"a": 0}
    assert st.registered["a"].versions == {0: 4, 1: 2}
    assert st.merge_error is None
    # A shard that cannot merge makes the whole synchronizer's status say so.
    broken = dataclasses.replace(
        _status(1, 2, {"a": 3}, []), merge_error="the merge of fragment 1 failed"
    )
    st = combine_status([_status(0, 4, {"a": 6}, []), broken])
    assert st.merge_error == "shard 1: the merge of fragment 1 failed"
    # A shard that has not answered yet only leaves its counters out.
    partial = combine_status([_status(0, 4, {"a": 6}, []), None])
    assert partial.rounds == 4 and partial.shards[1] is None


def test_merged_shares_of_the_combined_status_divide_by_every_fragment() -> None:
    # Shard 0 (fragment 0) merged 600 of a's tokens and 100 of b's, shard 1 (fragment 1) 400
    # of a's: every token trains every fragment, so a's share is 1000 / (2 x 1000).
    progress = {
        "a": LearnerProgress(10, 1000, None, None, 3, 0.0),
        "b": LearnerProgress(4, 400, None, None, 3, 0.0),
        "c": LearnerProgress(0, 0, None, None, 0, 0.0),
    }
    zero = dataclasses.replace(
        _status(0, 4, {"a": 6}, []), learners=progress, tokens_merged={"a": 600, "b": 100}
    )
    one = dataclasses.replace(_status(1, 2, {"a": 3}, []), tokens_merged={"a": 400})
    st = combine_status([zero, one])
    assert st.tokens_merged == {"a": 1000, "b": 100}
    assert st.merged_shares() == {"a": 0.5, "b": 100 / 800, "c": 0.0}
    # Over every learner: 1100 tokens merged of the ledger's total, times both fragments.
    assert st.merged_share() == 1100 / (2 * st.tokens) and st.tokens > 0
    # With shard 1 silent, the share is over the fragments that answered.
    assert combine_status([zero, None]).merged_shares()["a"] == 600 / 1000
