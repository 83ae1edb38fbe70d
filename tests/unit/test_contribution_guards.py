"""Broken or malicious contributions on the synchronizer core (algorithm.md section 7): each is
refused with its reason, counted in `rejected`, and changes neither the global model, nor the
versions, nor the token ledger. Honest contributions are not refused."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from ray_diloco.actors.host_faults import nan_encoded
from ray_diloco.algorithm import wire
from ray_diloco.algorithm.rounds import ContributionMeta, Verdict
from ray_diloco.algorithm.sync_core import SynchronizerCore
from ray_diloco.config import load_config
from ray_diloco.sim.simulate import run_reference
from tests.sync_helpers import TINY, tiny_core

TOKENS_PER_STEP = 32 * 8  # the default learner's batch (32) x the tiny model's seq_len (8)


def _core(*extra: str) -> SynchronizerCore:
    core = tiny_core(load_config(None, [*TINY, "diloco.norm_guard_min_samples=4", *extra]))
    core.register("learner-0", 0, now=0.0, tokens_per_step=TOKENS_PER_STEP)
    core.report("learner-0", 0, now=0.0, step_time_s=0.1, cursor=0)
    return core


def _meta(step: int, steps: int = 4, fragment: int = 0, base: int = 0) -> ContributionMeta:
    return ContributionMeta("learner-0", 0, fragment, base, step, steps, steps * TOKENS_PER_STEP)


def _delta(core: SynchronizerCore, scale: float = 0.01, seed: int = 0) -> dict[str, wire.Encoded]:
    rng = np.random.default_rng(seed)
    values = core.values[0]
    delta = {k: (scale * rng.normal(size=v.shape)).astype(np.float32) for k, v in values.items()}
    return wire.encode_tree(delta, core.cfg.diloco.wire_dtype)


def _state(core: SynchronizerCore) -> tuple[Any, ...]:
    values = {k: v.copy() for frag in core.values for k, v in frag.items()}
    return values, core.book.versions(), core.ledger.state_dict()


def _assert_unchanged(core: SynchronizerCore, before: tuple[Any, ...]) -> None:
    values, versions, ledger = before
    assert core.poll(now=100.0) == []  # nothing pending: no round can close
    assert core.book.versions() == versions
    assert core.ledger.state_dict() == ledger
    for frag in core.values:
        for k, v in frag.items():
            np.testing.assert_array_equal(v, values[k])


def _leaf(delta: dict[str, wire.Encoded]) -> str:
    return next(iter(delta))


def test_broken_contributions_are_refused_with_their_reason() -> None:
    core = _core()
    good = _delta(core)
    k = _leaf(good)
    dtype = core.cfg.diloco.wire_dtype
    wrong_shape = {**good, k: wire.encode(np.zeros((3, 3), np.float32), dtype)}
    wrong_dtype = {**good, k: wire.encode(wire.decode(good[k]), "float32")}
    truncated = {**good, k: dataclasses.replace(good[k], payload=good[k].payload[:-2])}
    other = wire.encode_tree({p: np.zeros_like(v) for p, v in core.values[1].items()}, dtype)
    cases = [
        (_meta(4, fragment=7), good, Verdict.UNKNOWN_FRAGMENT),
        (_meta(4, fragment=0), other, Verdict.MALFORMED),  # fragment 1's leaves sent as 0
        (_meta(4), wrong_shape, Verdict.WRONG_SHAPE),
        (_meta(4), wrong_dtype, Verdict.WRONG_DTYPE),
        (_meta(4), truncated, Verdict.MALFORMED),
        (_meta(4), {k: good[k]}, Verdict.MALFORMED),  # a leaf missing
        (dataclasses.replace(_meta(4), num_tokens=10**12), good, Verdict.ABSURD_COUNTERS),
        (_meta(4, steps=40), good, Verdict.ABSURD_COUNTERS),  # 40 steps since base at step 4
    ]
    before = _state(core)
    for meta, delta, verdict in cases:
        assert core.offer(meta, delta, now=1.0) is verdict, verdict
    _assert_unchanged(core, before)
    assert core.rejected == {
        "unknown_fragment": 1,
        "malformed": 3,
        "wrong_shape": 1,
        "wrong_dtype": 1,
        "absurd_counters": 2,
    }
    # an absurd or unknown contribution's counters are not counted as lost work
    assert core.rejected_tokens == 5 * 4 * TOKENS_PER_STEP


def test_a_replayed_contribution_is_refused_and_merged_once() -> None:
    core = _core()
    meta, delta = _meta(4), _delta(core)
    assert core.offer(meta, delta, now=1.0) is Verdict.ACCEPTED
    (pub,) = core.poll(now=2.0)
    core.messages(pub, ["learner-0"])  # version 1 goes back to it
    before = _state(core)
    # the same message again, after its round merged, and again with the round's base
    assert core.offer(meta, delta, now=3.0) is Verdict.REPLAYED
    assert core.offer(dataclasses.replace(meta, base_version=1), delta, now=3.0) is (
        Verdict.REPLAYED
    )
    _assert_unchanged(core, before)
    assert core.ledger.account("learner-0").merged == {0: 4 * TOKENS_PER_STEP}
    assert core.rejected == {"replayed": 2} and core.rejected_tokens == 0
    assert pub.version == 1


@pytest.mark.parametrize("anchor", ["current", "base"])
def test_corrupted_updates_are_refused_once_the_guard_is_armed(anchor: str) -> None:
    # The tiny config's inner warm-up is 20 steps: honest updates after it arm the guard
    # (4 samples), then a x1000 update and a NaN one are refused and change nothing.
    core = _core(f"diloco.anchor={anchor}", "diloco.max_staleness_versions=100")
    step = 20
    for i in range(4):
        step += 4
        base = core.book.versions()[0]
        assert core.offer(_meta(step, base=base), _delta(core, seed=i), now=i) is Verdict.ACCEPTED
        (pub,) = core.poll(now=i + 0.5)
        core.messages(pub, ["learner-0"])  # each version goes back to it
    base = core.book.versions()[0]
    before = _state(core)
    huge = _delta(core, scale=10.0, seed=9)
    assert core.offer(_meta(step + 4, base=base), huge, now=9.0) is Verdict.NORM_OUTLIER
    nan = {k: nan_encoded(e) for k, e in huge.items()}  # what a diverged learner sends
    assert core.offer(_meta(step + 8, base=base), nan, now=9.0) is Verdict.NON_FINITE
    _assert_unchanged(core, before)
    # honest work goes on being accepted
    assert core.offer(_meta(step + 12, base=base), _delta(core), now=10.0) is Verdict.ACCEPTED


def test_the_synchronizer_keeps_only_the_bases_a_learner_may_still_use() -> None:
    # Current anchoring reconstructs theta from the learner's base: the record keeps the
    # versions from its last accepted base on (and the newest), not a fixed history.
    core = _core("diloco.max_staleness_versions=4")
    for i in range(3):
        meta = _meta(4 * (i + 1), base=i)
        assert core.offer(meta, _delta(core, seed=i), now=i) is Verdict.ACCEPTED
        (pub,) = core.poll(now=i + 0.5)
        core.messages(pub, ["learner-0"])  # it gets each version back
    assert sorted(core.down.held[0]["learner-0"]) == [2, 3]
    stale = _meta(16, base=1)
    assert core.offer(stale, _delta(core), now=9.0) is Verdict.STALE_VERSION


@pytest.mark.timeout(120)
def test_an_honest_run_has_no_refusals() -> None:
    # K = 1 without grace, publishing only to contributors: the setting in which the old guard
    # refused honest work most (learners' bases 3 versions behind the current value).
    tiny_run = [
        "task_args.model.d_model=16",
        "task_args.model.num_layers=1",
        "task_args.model.num_heads=2",
        "task_args.model.d_ff=32",
        "task_args.model.seq_len=16",
        "task_args.data.source=synthetic",
        "task_args.data.eval_batches=1",
        "diloco.sync_every=4",
        "diloco.num_fragments=4",
        "diloco.grace_fraction=0",
        "diloco.publish_to=contributors",
        "learners.2.speed=0.8",
        "learners.3.jitter=0.2",
        "token_budget=150000",
    ]
    s = run_reference(load_config(None, tiny_run))
    assert "norm_outlier" not in s["rejected"] and s["ledger_violations"] == []
    assert s["rounds"] > 200
