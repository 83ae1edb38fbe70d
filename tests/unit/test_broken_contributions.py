"""Broken or malicious contributions: a fragment of the wrong shape or dtype, a
wrong fragment index, an absurd token or step count, a replay, a corrupted (blown-up or NaN)
update, late ones under `late_policy: drop` and an old incarnation's pending one are refused
with their reason counted, and change neither the global model nor the ledger
(algorithm/sync_core.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest

from ray_diloco.algorithm import wire
from ray_diloco.algorithm.round_types import ContributionMeta, Verdict
from ray_diloco.algorithm.sync_core import Publication, SynchronizerCore
from ray_diloco.config import load_config
from tests.sync_helpers import TINY, registered_core

TOKENS_PER_STEP = 64


def _core(*overrides: str) -> SynchronizerCore:
    cfg = load_config(None, [*TINY, "diloco.max_staleness_versions=3", *overrides])
    return registered_core(cfg, ("a", "b"), TOKENS_PER_STEP)


def _delta(core: SynchronizerCore, fragment: int = 0, size: float = 0.01) -> dict[str, np.ndarray]:
    # float32 deltas whatever the dtype the published versions are kept in (bfloat16)
    return {k: np.full(v.shape, size, np.float32) for k, v in core.snapshot()[fragment][1].items()}


def _meta(learner: str = "a", base: int = 0, step: int = 4, fragment: int = 0) -> ContributionMeta:
    return ContributionMeta(learner, 0, fragment, base, step, 4, 4 * TOKENS_PER_STEP)


def _state(core: SynchronizerCore) -> tuple[dict[str, np.ndarray], dict[int, int], int]:
    values = {k: v.copy() for k, v in core.global_params().items()}
    merged = sum(core.ledger.tokens_merged(p) for p in range(core.plan.num_fragments))
    return values, core.book.versions(), merged


def _nan(core: SynchronizerCore) -> dict[str, wire.Encoded]:
    """A NaN update of fragment 0 (`wire.encode` refuses NaN: a broken learner's bytes, built
    by hand)."""
    nan = {k: wire.Encoded("float32", v.shape, v.tobytes(), b"") for k, v in _delta(core).items()}
    return {k: dataclasses.replace(e, payload=b"\xff" * len(e.payload)) for k, e in nan.items()}


def _rounds_of_a(core: SynchronizerCore, bases: range) -> None:
    """Learner a alone moves fragment 0 on: one offer on each of `bases` (4 steps since the
    one before), each merged in a round of its own."""
    for version in bases:
        meta = _meta("a", base=version, step=4 * (version + 1))
        assert core.offer(meta, wire.encode_tree(_delta(core), "bfloat16"), version + 0.1) is (
            Verdict.ACCEPTED
        )
        assert len(core.poll(now=version + 0.5)) == 1


def _wrong_shape(core: SynchronizerCore) -> tuple[ContributionMeta, dict[str, wire.Encoded]]:
    delta = _delta(core)
    name = next(iter(delta))
    delta[name] = np.zeros((*delta[name].shape, 2), np.float32)  # bytes match its own shape
    return _meta(), wire.encode_tree(delta, "float32")


def _wrong_dtype(core: SynchronizerCore) -> tuple[ContributionMeta, dict[str, wire.Encoded]]:
    encoded = wire.encode_tree(_delta(core), "float32")
    name = next(iter(encoded))
    encoded[name] = dataclasses.replace(encoded[name], dtype="float64")  # type: ignore[arg-type]
    return _meta(), encoded


def _short_payload(core: SynchronizerCore) -> tuple[ContributionMeta, dict[str, wire.Encoded]]:
    encoded = wire.encode_tree(_delta(core), "bfloat16")
    name = next(iter(encoded))
    encoded[name] = dataclasses.replace(encoded[name], payload=encoded[name].payload[:-2])
    return _meta(), encoded


def _scales_for_payload(
    core: SynchronizerCore,
) -> tuple[ContributionMeta, dict[str, wire.Encoded]]:
    # the right byte count in all, split wrongly between payload and scales
    encoded = wire.encode_tree(_delta(core), "int8")
    name = next(iter(encoded))
    e = encoded[name]
    encoded[name] = dataclasses.replace(e, payload=e.payload[:-1], scales=e.scales + b"\0")
    return _meta(), encoded


def _missing_leaf(core: SynchronizerCore) -> tuple[ContributionMeta, dict[str, wire.Encoded]]:
    encoded = wire.encode_tree(_delta(core), "bfloat16")
    encoded.pop(next(iter(encoded)))
    return _meta(), encoded


def _not_encoded(core: SynchronizerCore) -> tuple[ContributionMeta, dict[str, wire.Encoded]]:
    return _meta(), _delta(core)  # type: ignore[return-value]  # raw arrays, not Encoded


def _wrong_index(core: SynchronizerCore) -> tuple[ContributionMeta, dict[str, wire.Encoded]]:
    return _meta(fragment=7), wire.encode_tree(_delta(core), "bfloat16")


def _negative_index(core: SynchronizerCore) -> tuple[ContributionMeta, dict[str, wire.Encoded]]:
    # Python would read published[-1] (the last fragment) without the check
    return _meta(fragment=-1), wire.encode_tree(_delta(core, fragment=1), "bfloat16")


def _absurd_tokens(core: SynchronizerCore) -> tuple[ContributionMeta, dict[str, wire.Encoded]]:
    meta = dataclasses.replace(_meta(), num_tokens=10**15)
    return meta, wire.encode_tree(_delta(core), "bfloat16")


def _more_steps_than_taken(
    core: SynchronizerCore,
) -> tuple[ContributionMeta, dict[str, wire.Encoded]]:
    meta = dataclasses.replace(_meta(), step=3, num_steps=4)
    return meta, wire.encode_tree(_delta(core), "bfloat16")


def _absurd_steps(core: SynchronizerCore) -> tuple[ContributionMeta, dict[str, wire.Encoded]]:
    # more steps than the whole run's budget has: it would shrink its norm per step
    meta = dataclasses.replace(_meta(), step=10**9, num_steps=10**9)
    return meta, wire.encode_tree(_delta(core, size=10.0), "bfloat16")


Broken = Callable[[SynchronizerCore], tuple[ContributionMeta, dict[str, wire.Encoded]]]


@pytest.mark.parametrize(
    ("broken", "verdict"),
    [
        (_wrong_shape, Verdict.MALFORMED),
        (_wrong_dtype, Verdict.MALFORMED),
        (_short_payload, Verdict.MALFORMED),
        (_scales_for_payload, Verdict.MALFORMED),
        (_missing_leaf, Verdict.MALFORMED),
        (_not_encoded, Verdict.MALFORMED),
        (_wrong_index, Verdict.MALFORMED),
        (_negative_index, Verdict.MALFORMED),
        (_absurd_tokens, Verdict.IMPLAUSIBLE),
        (_more_steps_than_taken, Verdict.IMPLAUSIBLE),
        (_absurd_steps, Verdict.IMPLAUSIBLE),
    ],
)
def test_broken_contribution_is_refused_and_changes_nothing(
    broken: Broken, verdict: Verdict
) -> None:
    core = _core()
    before = _state(core)
    meta, delta = broken(core)
    assert core.offer(meta, delta, now=0.1) is verdict
    assert core.rejected == {verdict.value: 1}
    assert core.rejected_tokens <= meta.num_steps * TOKENS_PER_STEP  # not the absurd claim
    assert core.poll(now=10.0) == []  # nothing pending: no round to close
    values, versions, trained = _state(core)
    assert versions == before[1] and trained == before[2]
    for k, v in values.items():
        np.testing.assert_array_equal(v, before[0][k])


def test_replayed_contribution_is_refused_and_the_ledger_counts_its_tokens_once() -> None:
    core = _core()
    encoded = wire.encode_tree(_delta(core), "bfloat16")
    assert core.offer(_meta(step=4), encoded, now=0.1) is Verdict.ACCEPTED
    core.poll(now=1.0)
    later = wire.encode_tree(_delta(core), "bfloat16")
    assert core.offer(_meta(base=1, step=8), later, now=1.1) is Verdict.ACCEPTED
    core.poll(now=2.0)
    merged, values = core.ledger.tokens_merged(0), core.global_params()
    assert core.offer(_meta(step=4), encoded, now=2.1) is Verdict.REPLAYED  # base 0, again
    assert core.poll(now=3.0) == []
    assert core.ledger.tokens_merged(0) == merged == 8 * TOKENS_PER_STEP
    for k, v in core.global_params().items():
        np.testing.assert_array_equal(v, values[k])
    assert core.rejected == {"replayed": 1}


def _merging(core: SynchronizerCore) -> Publication:
    """A round of `a`'s offer on base 0, merged and not yet committed."""
    assert core.offer(_meta("a"), wire.encode_tree(_delta(core), "bfloat16"), 0.1) is (
        Verdict.ACCEPTED
    )
    (close,) = core.close_due(now=0.2)
    return core.merge(close)


def test_late_contributions_dropped_by_policy_are_counted_as_refused() -> None:
    core = _core("diloco.late_policy=drop")
    pub = _merging(core)
    late = _meta("b")  # arrives while the round of its base merges
    assert core.offer(late, wire.encode_tree(_delta(core), "bfloat16"), 0.3) is Verdict.ACCEPTED
    assert core.commit(pub, now=0.4) == [late]
    assert core.rejected == {"late": 1}
    assert core.rejected_tokens == late.num_tokens
    assert core.poll(now=5.0) == []  # dropped, never merged


def test_corrupted_update_is_refused_by_the_norm_guard_and_changes_nothing() -> None:
    # Armed after one closed round and the inner warm-up (2 steps): honest updates of 0.01 per
    # element over 4 steps set the fragment's per-step median; a 1000x one is refused, a NaN
    # too, and a long honest one (40 steps, 10x the update) is not: the guard judges per step.
    core = _core("diloco.norm_guard_warmup_rounds=1", "inner.warmup_steps=2")
    step = 0
    for base in range(3):
        step += 4
        encoded = wire.encode_tree(_delta(core), "bfloat16")
        assert core.offer(_meta(base=base, step=step), encoded, now=base) is Verdict.ACCEPTED
        core.poll(now=base + 0.5)
    before = _state(core)
    blown_up = wire.encode_tree(_delta(core, size=10.0), "bfloat16")
    assert core.offer(_meta(base=3, step=step + 4), blown_up, now=4.0) is Verdict.NORM_OUTLIER
    nan = _nan(core)
    assert core.offer(_meta(base=3, step=step + 8), nan, now=4.1) is Verdict.NON_FINITE
    assert core.poll(now=5.0) == []
    values, versions, merged = _state(core)
    assert versions == before[1] and merged == before[2]
    for k, v in values.items():
        np.testing.assert_array_equal(v, before[0][k])
    long = dataclasses.replace(_meta(base=3, step=step + 48), num_steps=40, num_tokens=40 * 64)
    encoded = wire.encode_tree(_delta(core, size=0.1), "bfloat16")
    assert core.offer(long, encoded, now=5.1) is Verdict.ACCEPTED
    assert core.rejected == {"norm_outlier": 1, "non_finite": 1}


def test_an_old_incarnations_pending_contribution_is_merged_not_waited_for() -> None:
    core = _core("diloco.quorum_min=2")
    encoded = wire.encode_tree(_delta(core), "bfloat16")
    assert core.offer(_meta("b"), encoded, now=0.1) is Verdict.ACCEPTED
    assert core.offer(_meta("a"), encoded, now=0.1) is Verdict.ACCEPTED  # the quorum is in
    core.register("a", 1, now=0.2, tokens_per_step=TOKENS_PER_STEP)
    # The old process's later offers are fenced ...
    late = dataclasses.replace(_meta("a"), step=8)
    assert core.offer(late, encoded, now=0.3) is Verdict.OLD_INCARNATION
    assert core.rejected == {"old_incarnation": 1}
    # ... but what it offered before the restart is accepted work and merges with its round,
    # which does not wait for the new incarnation (whose next offer of the fragment may be a
    # whole window away, and which a synchronous learner blocked on another round never
    # makes), and the ledger counts it.
    (pub,) = core.poll(now=10.0)
    assert [(c.meta.learner, c.meta.incarnation) for c in pub.close.contributions] == [
        ("a", 0),
        ("b", 0),
    ]
    assert core.ledger.accounts["a"].merged[0] == _meta("a").num_tokens
    # The round that kept it is over: the next needs two learners again (both live: they
    # report, or K would fall to the one live learner).
    for name, incarnation in (("a", 1), ("b", 0)):
        core.report(name, incarnation, now=10.0, step_time_s=1.0, cursor=0)
    again = dataclasses.replace(_meta("a"), incarnation=1)
    assert core.offer(again, encoded, now=10.1) is Verdict.ACCEPTED
    assert core.poll(now=12.0) == []
    b_next = _meta("b", base=1, step=12)  # b got version 1 and trained on
    assert core.offer(b_next, encoded, now=20.1) is Verdict.ACCEPTED
    (pub,) = core.poll(now=30.0)
    assert [(c.meta.learner, c.meta.incarnation) for c in pub.close.contributions] == [
        ("a", 1),
        ("b", 0),
    ]


def test_work_refused_twice_on_one_base_is_lost_once() -> None:
    core = _core()  # bases at most 3 versions behind
    _rounds_of_a(core, range(4))
    first = _meta("b", base=0, step=4)  # 4 steps since base 0, now 4 versions behind
    again = ContributionMeta("b", 0, 0, 0, 6, 6, 6 * TOKENS_PER_STEP)  # 6 since base 0
    for meta in (first, again):
        encoded = wire.encode_tree(_delta(core), "bfloat16")
        assert core.offer(meta, encoded, 5.0) is Verdict.STALE_VERSION
    assert core.rejected == {"stale_version": 2}
    assert core.rejected_tokens == again.num_tokens  # the same first 4 steps, counted once


def test_work_refused_then_merged_on_its_base_is_not_lost() -> None:
    core = _core("diloco.late_policy=drop")
    pub = _merging(core)
    late = _meta("b")  # arrives while the round of its base merges: dropped at its commit
    assert core.offer(late, wire.encode_tree(_delta(core), "bfloat16"), 0.3) is Verdict.ACCEPTED
    core.commit(pub, now=0.4)
    assert core.rejected_tokens == late.num_tokens
    # the same work and more, offered on the same base: taken, so none of it is lost
    later = ContributionMeta("b", 0, 0, 0, 8, 8, 8 * TOKENS_PER_STEP)
    assert core.offer(later, wire.encode_tree(_delta(core), "bfloat16"), 0.5) is Verdict.ACCEPTED
    assert core.rejected_tokens == 0


def test_work_merged_then_refused_on_its_base_is_lost_only_past_the_merge() -> None:
    # b's 4 steps on base 0 are merged; its next offer on that base, 6 steps since it, comes
    # after 4 more versions and is refused as stale: 2 steps are lost, not 6 (counting the
    # merged 4 as lost too makes a learner lose more than it trained).
    core = _core()  # bases at most 3 versions behind
    first = _meta("b", base=0, step=4)
    assert core.offer(first, wire.encode_tree(_delta(core), "bfloat16"), 0.1) is Verdict.ACCEPTED
    assert len(core.poll(now=0.5)) == 1
    _rounds_of_a(core, range(1, 5))
    again = ContributionMeta("b", 0, 0, 0, 6, 6, 6 * TOKENS_PER_STEP)
    encoded = wire.encode_tree(_delta(core), "bfloat16")
    assert core.offer(again, encoded, 6.0) is Verdict.STALE_VERSION
    assert core.rejected_tokens == 2 * TOKENS_PER_STEP
    assert core.ledger.accounts["b"].merged[0] == first.num_tokens


def test_work_pending_then_refused_on_its_base_is_lost_only_past_the_pending() -> None:
    # b's 4 steps on base 0 wait in a round that needs a second learner; b's next offer on
    # base 0 is refused as broken (non-finite): the 4 pending steps are merged when the round
    # closes, so the refusal loses the 2 steps past them.
    core = _core("diloco.quorum_min=2")
    first = _meta("b", base=0, step=4)
    assert core.offer(first, wire.encode_tree(_delta(core), "bfloat16"), 0.1) is Verdict.ACCEPTED
    nan = _nan(core)
    again = ContributionMeta("b", 0, 0, 0, 6, 6, 6 * TOKENS_PER_STEP)
    assert core.offer(again, nan, 0.2) is Verdict.NON_FINITE
    assert core.rejected_tokens == 2 * TOKENS_PER_STEP


def test_a_refused_offer_older_than_the_merged_work_on_its_base_loses_nothing() -> None:
    # b's 6 steps on base 0 are merged; its 4-step offer on base 0, sent before them, arrives
    # after 4 more versions and is refused as stale: every one of its steps was merged.
    core = _core()
    merged = ContributionMeta("b", 0, 0, 0, 6, 6, 6 * TOKENS_PER_STEP)
    assert core.offer(merged, wire.encode_tree(_delta(core), "bfloat16"), 0.1) is Verdict.ACCEPTED
    assert len(core.poll(now=0.5)) == 1
    _rounds_of_a(core, range(1, 5))
    early = _meta("b", base=0, step=4)
    assert core.offer(early, wire.encode_tree(_delta(core), "bfloat16"), 6.0) is (
        Verdict.STALE_VERSION
    )
    assert core.rejected_tokens == 0


def test_an_old_incarnations_refusal_counts_all_its_work_lost() -> None:
    # b's new incarnation has work merged on base 0; the old process's offer on base 0 is
    # fenced, and none of its work is in what the new incarnation merged.
    core = _core()
    core.register("b", 1, now=0.0, tokens_per_step=TOKENS_PER_STEP)
    new = ContributionMeta("b", 1, 0, 0, 4, 4, 4 * TOKENS_PER_STEP)
    assert core.offer(new, wire.encode_tree(_delta(core), "bfloat16"), 0.1) is Verdict.ACCEPTED
    assert len(core.poll(now=0.5)) == 1
    old = ContributionMeta("b", 0, 0, 0, 6, 6, 6 * TOKENS_PER_STEP)
    encoded = wire.encode_tree(_delta(core), "bfloat16")
    assert core.offer(old, encoded, 0.6) is Verdict.OLD_INCARNATION
    assert core.rejected_tokens == old.num_tokens
