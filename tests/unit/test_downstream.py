"""Publications on their way down (algorithm/downstream.py): full values or quantized
differences with error feedback, and the learner side that resolves them (LearnerCore)."""

from __future__ import annotations

import numpy as np
import pytest

from ray_diloco.algorithm import wire
from ray_diloco.algorithm.downstream import Downstream, Message
from ray_diloco.algorithm.learner_core import LearnerCore
from ray_diloco.algorithm.setup import Setup
from ray_diloco.config import DilocoConfig, load_config
from ray_diloco.sim.simulate import run_reference
from tests.sync_helpers import TINY

SHAPE = (256,)


def _walk(seed: int = 0, steps: int = 40) -> list[dict[str, np.ndarray]]:
    """A global value drifting like a trained parameter: small steps in a random direction."""
    rng = np.random.default_rng(seed)
    g = rng.normal(size=SHAPE).astype(np.float32)
    out = []
    for _ in range(steps):
        g = (g + 0.05 * rng.normal(size=SHAPE)).astype(np.float32)
        out.append({"w": g})
    return out


def _apply(copy: dict[str, np.ndarray], have: int, msg: Message) -> tuple[dict, int]:
    """What a learner does with a message (LearnerCore.resolve, without JAX)."""
    decoded = wire.decode_tree(msg.encoded)
    if msg.base is None:
        return decoded, msg.version
    assert msg.base == have, "a difference to a version the learner does not hold"
    return {k: copy[k] + decoded[k] for k in copy}, msg.version


def test_float_publications_send_full_values_and_share_the_copies() -> None:
    down = Downstream(DilocoConfig(), num_fragments=1)
    pub = down.publish(1, _walk()[0])
    msgs = down.messages(0, pub, ["a", "b"])
    assert msgs["a"] is msgs["b"] and msgs["a"].base is None
    assert msgs["a"].encoded["w"].dtype == "bfloat16"
    assert down.base("a", 0, 1) is down.base("b", 0, 1) is pub.decoded


def test_error_feedback_keeps_the_copy_within_one_quantization_step() -> None:
    # Four bits both ways: after every version each learner's copy is within half a
    # quantization step of the global value (the part lost in one difference is in the next),
    # while quantizing each version-to-version difference on its own lets the error grow.
    d = DilocoConfig(anchor="base", publish_dtype="int4", int4_block_size=64)
    down = Downstream(d, num_fragments=1)
    start = {"w": np.zeros(SHAPE, np.float32)}
    down.adopted("a", {0: (0, start)})
    copy, have, naive, prev = dict(start), 0, dict(start), start
    for version, g in enumerate(_walk(), start=1):
        (msg,) = down.messages(0, down.publish(version, g), ["a"]).values()
        assert msg.base == version - 1 and msg.encoded["w"].dtype == "int4"
        copy, have = _apply(copy, have, msg)
        np.testing.assert_array_equal(copy["w"], down.held[0]["a"][version]["w"])  # exact
        half_step = np.repeat(np.frombuffer(msg.encoded["w"].scales, "<f4"), 64) / 2
        assert np.all(np.abs(g["w"] - copy["w"]) <= half_step * (1 + 1e-5) + 1e-7)
        naive = {"w": naive["w"] + wire.decode(wire.encode(g["w"] - prev["w"], "int4"))}
        prev = g
    assert np.abs(g["w"] - naive["w"]).max() > 3 * np.abs(g["w"] - copy["w"]).max()


def test_learners_holding_the_same_copy_share_one_message() -> None:
    d = DilocoConfig(anchor="base", publish_dtype="int4")
    down = Downstream(d, num_fragments=1)
    start = {"w": np.zeros(SHAPE, np.float32)}
    down.adopted("a", {0: (0, start)})
    down.adopted("b", {0: (0, start)})
    g1, g2 = (down.publish(v, g) for v, g in enumerate(_walk()[:2], start=1))
    first = down.messages(0, g1, ["a", "b", "new"])
    assert first["a"] is first["b"] and first["a"].base == 0
    assert first["new"].base is None  # holds nothing known: the full value, in bfloat16
    assert first["new"].encoded["w"].dtype == "bfloat16"
    # only a gets version 2 (publish_to: contributors): b is now one version behind
    (to_a,) = down.messages(0, g2, ["a"]).values()
    both = down.messages(0, down.publish(3, g2.values), ["a", "b"])
    assert both["a"].base == 2 and both["b"].base == 1 and both["a"] is not both["b"]
    assert to_a.base == 1
    # a's copies: what its contributions may be based on, until it contributes on a newer one
    assert sorted(down.held[0]["a"]) == [0, 1, 2, 3]
    down.offered("a", 0, base=2)
    assert sorted(down.held[0]["a"]) == [2, 3]
    down.prune(0, oldest=3)
    assert sorted(down.held[0]["a"]) == [3] and sorted(down.held[0]["b"]) == [3]


def _learner() -> LearnerCore:
    cfg = load_config(None, [*TINY, "diloco.anchor=base", "diloco.publish_dtype=int4"])
    s = Setup.build(cfg)
    snapshot = {p: (0, {k: s.init[k] for k in f}) for p, f in enumerate(s.plan.fragments)}
    return LearnerCore(cfg, cfg.learners[0], s.task, s.layout, s.plan, snapshot)


def test_the_learner_resolves_differences_in_order() -> None:
    core = _learner()
    k = core.plan.fragments[0][0]
    base = core.base_values[0][k]
    one = {kk: np.ones_like(v) for kk, v in core.base_values[0].items()}
    # version 2 (a difference to 1) arrives before version 1 (a difference to 0)
    assert core.resolve(0, 2, one, base=1) == []
    ((p, v1, _), (_, v2, full2)) = core.resolve(0, 1, one, base=0)
    assert (p, v1, v2) == (0, 1, 2)
    np.testing.assert_allclose(full2[k], base + 2, rtol=1e-6)
    # a difference to a version older than the newest received is obsolete
    assert core.resolve(0, 3, one, base=1) == []
    # full values supersede; later differences apply to them
    full = {kk: np.zeros_like(v) for kk, v in one.items()}
    assert [x[1] for x in core.resolve(0, 5, full)] == [5]
    assert core.resolve(0, 4, full) == []  # older full values: ignored
    ((_, v6, full6),) = core.resolve(0, 6, one, base=5)
    assert v6 == 6 and np.all(full6[k] == 1)
    core.receive(0, 7, one, base=6)
    assert core.apply_received() == [0]
    assert core.base_version[0] == 7 and np.allclose(core.base_values[0][k], 2)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("publish_to", ["all", "contributors"])
def test_four_bit_publications_train_like_bfloat16_ones(publish_to: str) -> None:
    base = [
        "task_args.model.d_model=16",
        "task_args.model.num_layers=1",
        "task_args.model.num_heads=2",
        "task_args.model.d_ff=32",
        "task_args.model.seq_len=16",
        "task_args.data.source=synthetic",
        "task_args.data.eval_batches=1",
        "diloco.sync_every=4",
        "diloco.num_fragments=4",
        "diloco.anchor=base",
        "diloco.wire_dtype=int4",
        f"diloco.publish_to={publish_to}",
        "learners.2.speed=0.8",
        "token_budget=40000",
    ]
    runs = {
        dtype: run_reference(load_config(None, [*base, f"diloco.publish_dtype={dtype}"]))
        for dtype in ("bfloat16", "int4")
    }
    bf16, int4 = runs["bfloat16"], runs["int4"]
    assert int4["rounds"] == bf16["rounds"] > 0
    assert int4["bytes_down"] < 0.4 * bf16["bytes_down"]
    assert abs(int4["heldout_loss"] - bf16["heldout_loss"]) < 0.05 * bf16["heldout_loss"]
