"""Publications on their way down (algorithm/downstream.py): quantized differences with error
feedback kept on the synchronizer, the chain or the full value for a learner that skipped
versions, and the learner side that resolves them in any order (LearnerCore.receive)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from ray_diloco.algorithm import wire
from ray_diloco.algorithm.downstream import Downstream
from ray_diloco.algorithm.learner_core import LearnerCore
from ray_diloco.algorithm.round_types import ContributionMeta, Verdict
from ray_diloco.algorithm.setup import Setup
from ray_diloco.algorithm.sync_core import Publication, SynchronizerCore
from ray_diloco.config import DilocoConfig, load_config
from ray_diloco.sim.simulate import run_reference
from tests.sync_helpers import TINY

SHAPE = (640,)


def _walk(steps: int = 40, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """A global value drifting like a trained parameter: small steps in a random direction."""
    rng = np.random.default_rng(seed)
    g = rng.normal(size=SHAPE).astype(np.float32)
    out = []
    for _ in range(steps):
        g = (g + 0.05 * rng.normal(size=SHAPE)).astype(np.float32)
        out.append({"w": g})
    return out


def _half_steps(encoded: wire.Encoded) -> np.ndarray:
    scales = np.frombuffer(encoded.scales, "<f4")
    return np.repeat(scales, encoded.block_size)[: encoded.num_elements] / 2


@pytest.mark.parametrize("dtype", ["int4", "int2"])
def test_error_feedback_keeps_the_copy_within_half_a_step(dtype: str) -> None:
    # float32 full values, so the bound is the quantizer's alone: after every version Q is
    # within half a quantization step of G (what one difference missed is in the next), while
    # adding up independently quantized version-to-version differences drifts away.
    down = Downstream(DilocoConfig(publish_delta=dtype, wire_dtype="float32"), [0])
    walk = _walk()
    q, naive, prev = walk[0], dict(walk[0]), walk[0]
    for version, g in enumerate(walk[1:], start=1):
        q, diff = down.publish(0, version, g, q)
        assert diff["w"].dtype == dtype
        assert np.all(np.abs(g["w"] - q["w"]) <= _half_steps(diff["w"]) * (1 + 1e-5) + 1e-7)
        naive = {"w": naive["w"] + wire.decode(wire.encode(g["w"] - prev["w"], dtype))}
        prev = g
    assert np.abs(g["w"] - naive["w"]).max() > 3 * np.abs(g["w"] - q["w"]).max()


def test_bfloat16_full_values_stay_exact_on_the_wire() -> None:
    # With a bfloat16 full dtype every Q is a bfloat16 value, so the full-value fallback
    # carries it exactly; the bfloat16 rounding is fed back like the quantizer's.
    down = Downstream(DilocoConfig(publish_delta="int4"), [0])
    walk = _walk()
    q = {"w": walk[0]["w"].astype(ml_dtypes.bfloat16).astype(np.float32)}
    for version, g in enumerate(walk[1:], start=1):
        q, diff = down.publish(0, version, g, q)
        np.testing.assert_array_equal(wire.decode(wire.encode(q["w"], "bfloat16")), q["w"])
        spacing = np.abs(g["w"]) * 2.0**-8  # bfloat16 keeps 8 bits of mantissa
        assert np.all(np.abs(g["w"] - q["w"]) <= _half_steps(diff["w"]) + spacing + 1e-7)


def test_a_learner_that_skipped_versions_gets_the_chain_or_the_full_value() -> None:
    # int4 with its scales is 0.5625 bytes an element against bfloat16's 2: three missed
    # differences are still cheaper than the value, four are not.
    down = Downstream(DilocoConfig(publish_delta="int4", max_staleness_versions=8), [0])
    down.adopted("a", {0: 0})
    down.adopted("b", {0: 0})
    walk = _walk()
    q = walk[0]
    sent: dict[int, list] = {}
    for version in range(1, 9):
        q, _ = down.publish(0, version, walk[version], q)
        to = ["a", "b"] if version in (3, 7) else ["b"]
        sent[version] = down.messages(0, version, q, to)
    (a_and_b,) = [g for g in sent[3] if "a" in g[0]]
    assert [(m.version, m.base) for m in a_and_b[1]] == [(1, 0), (2, 1), (3, 2)]
    (a_late,) = [g for g in sent[7] if "a" in g[0]]
    assert [(m.version, m.base) for m in a_late[1]] == [(7, None)]
    (b_late,) = [g for g in sent[7] if "b" in g[0]]
    assert [(m.version, m.base) for m in b_late[1]] == [(7, 6)]
    # A learner nobody told us about gets the full value; so does everyone after a restore.
    ((names, msgs),) = down.messages(0, 8, q, ["new"])
    assert names == ["new"] and msgs[0].base is None
    down.forget(0)
    assert all(m.base is None for _, ms in down.messages(0, 8, q, ["a", "b"]) for m in ms)


@pytest.fixture(scope="module")
def setup() -> Setup:
    return Setup.build(load_config(None, [*TINY, "diloco.publish_delta=int4"]))


def _round(sync: SynchronizerCore, learner: str, version: int) -> Publication:
    values = sync.snapshot()[0][1]
    rng = np.random.default_rng(version)
    delta = {k: rng.normal(0, 0.01, v.shape).astype(np.float32) for k, v in values.items()}
    meta = ContributionMeta(learner, 0, 0, version - 1, 4 * version, 4, 256)
    assert sync.offer(meta, wire.encode_tree(delta, "bfloat16"), now=version) is Verdict.ACCEPTED
    (pub,) = sync.poll(now=version + 0.5)
    return pub


def test_learner_copies_equal_the_synchronizer_s_in_any_order(setup: Setup) -> None:
    # What a learner holds of a version is, bit for bit, what the synchronizer rebuilds its
    # contributions from, however the differences arrive (Ray may run them out of order).
    cfg = setup.cfg
    sync = SynchronizerCore(cfg, setup.plan, setup.init)
    sync.register("a", 0, now=0.0)
    sync.report("a", 0, now=0.0, step_time_s=0.1, cursor=0)
    snapshot = sync.snapshot()
    learner = LearnerCore(cfg, cfg.learners[0], setup.task, setup.layout, setup.plan, snapshot)
    msgs = []
    for version in (1, 2, 3):
        ((names, sent),) = sync.messages(_round(sync, "a", version), ["a"])
        assert names == ["a"] and [(m.version, m.base) for m in sent] == [(version, version - 1)]
        msgs += sent
    assert sync.bytes_down["a"] == sum(m.nbytes for m in msgs)
    for msg in reversed(msgs):
        learner.receive(msg)
    version, values = learner.held()[0]
    assert version == 3
    for k, v in values.items():
        np.testing.assert_array_equal(v, sync.history.published[0][3][k])
    assert learner.apply_received() == [0] and learner.base_version[0] == 3
    assert not learner.waiting[0]


def test_four_bit_publications_in_the_reference_run() -> None:
    # The same run with 4-bit differences down moves about 3.5x fewer bytes down (0.5625
    # against bfloat16's 2 bytes an element) and trains about as well.
    base = [*TINY, "token_budget=6000", "run_dir=/tmp/ray_diloco-test-down"]
    full = run_reference(load_config(None, [*base, "diloco.publish_delta=none"]))
    four = run_reference(load_config(None, [*base, "diloco.publish_delta=int4"]))
    assert full["rounds"] == four["rounds"] > 0
    assert four["bytes_down"] < full["bytes_down"] / 3
    assert abs(four["heldout_loss"] - full["heldout_loss"]) < 0.05 * full["heldout_loss"]
