"""Who receives a merged fragment (`diloco.publish_to`) and how a refused learner catches up
(algorithm/sync_core.py), plus the effect on the reference run."""

from __future__ import annotations

import numpy as np
import pytest

from ray_diloco.algorithm import wire
from ray_diloco.algorithm.round_types import ContributionMeta, Verdict
from ray_diloco.algorithm.sync_core import SynchronizerCore
from ray_diloco.config import load_config
from ray_diloco.sim.simulate import run_reference
from tests.sync_helpers import TINY, tiny_core

LEARNERS = ["a", "b", "c"]


def _core(publish_to: str, *extra: str) -> SynchronizerCore:
    overrides = [*TINY, "diloco.max_staleness_versions=1", f"diloco.publish_to={publish_to}"]
    overrides += extra
    core = tiny_core(load_config(None, overrides))
    for name in LEARNERS:
        core.register(name, 0, now=0.0)
        core.report(name, 0, now=0.0, step_time_s=0.1, cursor=0)
    return core


def _offer(core: SynchronizerCore, learner: str, base: int, now: float) -> Verdict:
    values = core.snapshot()[0][1]
    delta = {k: np.full_like(v, 0.01) for k, v in values.items()}
    meta = ContributionMeta(learner, 0, 0, base, 4 * (base + 1), 4, 256)  # 4 steps per base
    return core.offer(meta, wire.encode_tree(delta, "bfloat16"), now=now)


@pytest.mark.parametrize(("publish_to", "expected"), [("contributors", ["b"]), ("all", LEARNERS)])
def test_recipients(publish_to: str, expected: list[str]) -> None:
    core = _core(publish_to)
    assert _offer(core, "b", base=0, now=0.1) is Verdict.ACCEPTED
    (pub,) = core.poll(now=0.2)
    assert core.recipients(pub, LEARNERS) == expected
    assert core.recipients(pub, ["a", "c"]) == ([] if publish_to == "contributors" else ["a", "c"])


def test_a_refused_learner_catches_up_on_the_newest_version() -> None:
    core = _core("contributors")
    for version in (1, 2):  # b's rounds move fragment 0 two versions past a's base
        assert _offer(core, "b", base=version - 1, now=0.1 * version) is Verdict.ACCEPTED
        core.poll(now=0.1 * version + 0.05)
    stale = ContributionMeta("a", 0, 0, 0, 4, 4, 256)
    assert _offer(core, "a", base=0, now=1.0) is Verdict.STALE_VERSION
    newest = core.catch_up(stale, Verdict.STALE_VERSION)
    assert newest is not None and newest.base is None  # the full value
    assert newest.version == 2
    for k, v in wire.decode_tree(newest.encoded).items():
        np.testing.assert_array_equal(v, core.snapshot()[0][1][k])
    # accepted contributions and dead incarnations need no catching up
    assert core.catch_up(stale, Verdict.ACCEPTED) is None
    assert core.catch_up(stale, Verdict.OLD_INCARNATION) is None


def test_publish_to_all_catches_up_only_a_base_gone_from_the_history() -> None:
    # A learner of "publish to all" hears of every version, unless its base no longer exists
    # (a restore fell back to the checkpoint and renamed it): then, if nobody can contribute,
    # no round closes and nothing is published, so the refusal must bring the newest version.
    # (Publications as differences always bring it: a learner that missed one is stuck.)
    core = _core("all", "diloco.publish_delta=none")
    assert _offer(core, "b", base=0, now=0.1) is Verdict.ACCEPTED
    core.poll(now=0.2)
    kept = ContributionMeta("a", 0, 0, 0, 4, 4, 256)
    assert core.catch_up(kept, Verdict.STALE_VERSION) is None
    gone = ContributionMeta("a", 0, 0, 7, 4, 4, 256)
    assert _offer(core, "a", base=7, now=0.3) is Verdict.FUTURE_VERSION
    newest = core.catch_up(gone, Verdict.FUTURE_VERSION)
    assert newest is not None and newest.version == 1


@pytest.mark.timeout(120)
def test_publishing_to_contributors_moves_fewer_bytes_down() -> None:
    base = [
        "task_args.model.d_model=16",
        "task_args.model.num_layers=1",
        "task_args.model.num_heads=2",
        "task_args.model.d_ff=32",
    ]
    base += ["task_args.model.seq_len=16", "task_args.data.source=synthetic", "token_budget=40000"]
    base += ["learners.2.speed=0.8", "learners.3.speed=0.8", "diloco.sync_every=8"]
    base += ["diloco.num_fragments=4"]
    runs = {
        to: run_reference(load_config(None, [*base, f"diloco.publish_to={to}"]))
        for to in ("contributors", "all")
    }
    assert runs["contributors"]["rounds"] == runs["all"]["rounds"] > 0
    assert runs["contributors"]["bytes_down"] < runs["all"]["bytes_down"]
    assert runs["contributors"]["bytes_up"] == runs["all"]["bytes_up"]
