"""Synchronizer checkpoints (algorithm/checkpoint.py): round trip, keep-N, digest."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from ray_diloco.algorithm import checkpoint, wire
from ray_diloco.algorithm.round_types import ContributionMeta, Verdict
from ray_diloco.algorithm.sync_core import SynchronizerCore
from ray_diloco.config import load_config
from tests.sync_helpers import TINY, tiny_core


def _merge_one_round(core: SynchronizerCore) -> None:
    core.register("a", 0, now=0.0)
    core.report("a", 0, now=0.0, step_time_s=0.1, cursor=512)
    values = core.snapshot()[0][1]
    delta = {k: np.full_like(v, 0.01) for k, v in values.items()}
    meta = ContributionMeta("a", 0, 0, 0, 4, 4, 512)
    assert core.offer(meta, wire.encode_tree(delta, "bfloat16"), now=0.1) is Verdict.ACCEPTED
    (pub,) = core.poll(now=0.2)
    core.messages(pub, ["a"])  # counts the bytes sent down


@pytest.mark.timeout(60)
def test_sync_state_round_trips_through_orbax(tmp_path):
    cfg = load_config(None, TINY)
    core = tiny_core(cfg)
    _merge_one_round(core)
    ckpt = checkpoint.Checkpointer(tmp_path / "ck", keep=2)
    arrays, meta = checkpoint.sync_state_to_tree(core.state_dict())
    ckpt.save(1, arrays, {**meta, "digest": checkpoint.state_digest(cfg)})
    ckpt.close()

    fresh = tiny_core(cfg)
    loaded = checkpoint.Checkpointer(tmp_path / "ck", keep=2).restore()
    assert loaded is not None
    arrays2, meta2 = loaded
    assert meta2["digest"] == checkpoint.state_digest(cfg)
    state = checkpoint.sync_state_from_tree(arrays2, meta2, fresh.outer_states)
    fresh.load_state_dict(state, now=5.0)
    assert fresh.book.versions() == core.book.versions() == {0: 1, 1: 0}
    for a, b in zip(fresh.values.values(), core.values.values(), strict=True):
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    for a, b in zip(fresh.outer_states.values(), core.outer_states.values(), strict=True):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_array_equal(x, y)
    assert fresh.ledger.resume_cursor("a") == 512
    assert fresh.ledger.account("a").merged == {0: 512}
    assert fresh.bytes_down == core.bytes_down and fresh.bytes_up == core.bytes_up
    assert fresh.snapshot()[0][0] == 1
    # the restored learner is fenced until it registers again
    assert fresh.book.live(now=5.0) == set()


@pytest.mark.timeout(60)
def test_keeps_newest_steps_and_restores_latest(tmp_path):
    ckpt = checkpoint.Checkpointer(tmp_path, keep=2)
    assert ckpt.restore() is None
    for step in (3, 6, 9):
        ckpt.save(step, {"w": {"x": np.full(3, step, np.float32)}}, {"step": step})
    assert ckpt.latest_step() == 9
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["6", "9"]
    arrays, meta = ckpt.restore()
    assert meta == {"step": 9}
    np.testing.assert_array_equal(arrays["w"]["x"], np.full(3, 9, np.float32))
    # a second process opening the same directory sees the same newest step
    assert checkpoint.Checkpointer(tmp_path, keep=2).latest_step() == 9


def test_digest_tracks_state_shape_only():
    a = load_config(None, TINY)
    assert checkpoint.state_digest(a) == checkpoint.state_digest(
        load_config(None, [*TINY, "token_budget=5", "metrics.eval_every_s=1"])
    )
    assert checkpoint.state_digest(a) != checkpoint.state_digest(
        load_config(None, [*TINY, "task_args.model.d_model=32"])
    )
