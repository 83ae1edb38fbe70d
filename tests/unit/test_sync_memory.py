"""The synchronizer core's resident memory per parameter (docs/synchronizer-memory.md): the
global value and the outer momentum in float32, the published versions that can still be a
base in bfloat16, and nothing that grows with the contributions once their round closed.
Measured with tracemalloc (every NumPy array and bytes object the core allocates), so a piece
of state nobody accounted for fails here, not in a benchmark."""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest

from ray_diloco.algorithm import wire
from ray_diloco.algorithm.fragments import FragmentPlan
from ray_diloco.algorithm.round_types import ContributionMeta
from ray_diloco.algorithm.sync_core import SynchronizerCore
from ray_diloco.config import build_config

N = 1 << 19  # parameters: 4 fragments of 2 leaves
LEARNERS = 4
ROUNDS = 4


def _run(publish_delta: str) -> tuple[SynchronizerCore, int, int, int, int]:
    """A core driven through ROUNDS rounds of every fragment (int4 offers, every learner sent
    every version); returns it, the bytes it holds after, its peak, and the round buffers it
    allocated and handed out in the last rounds."""
    leaves = {f"f{p}/w{i}": N // 8 for p in range(4) for i in range(2)}
    plan = FragmentPlan(
        tuple((f"f{p}/w0", f"f{p}/w1") for p in range(4)), (N // 4,) * 4, frozenset()
    )
    cfg = build_config(
        {
            "learners": [{"name": f"l{i}"} for i in range(LEARNERS)],
            "diloco": {
                "num_fragments": 4,
                "quorum_min": LEARNERS,
                "wire_dtype": "int4",
                "publish_delta": publish_delta,
            },
        }
    )
    rng = np.random.default_rng(0)
    init = {k: rng.normal(0, 0.02, n).astype(np.float32) for k, n in leaves.items()}
    deltas = [
        {k: wire.encode(rng.normal(0, 1e-3, n), "int4") for k, n in leaves.items()}
        for _ in range(LEARNERS)
    ]
    names = [f"l{i}" for i in range(LEARNERS)]
    gc.collect()
    tracemalloc.start()
    core = SynchronizerCore(cfg, plan, init)
    for n in names:
        core.register(n, 0, 0.0)
    now = 0.0
    for r in range(ROUNDS):
        if r == 2:  # past the first rounds, which still hold version 0 (float32) as a base
            tracemalloc.reset_peak()
        if r == ROUNDS - 1:
            allocated, reused = core.buffers.allocated, core.buffers.reused
        for p, paths in enumerate(plan.fragments):  # one fragment due at a time (streaming)
            base = core.book.fragments[p].version
            for n, d in zip(names, deltas, strict=True):
                meta = ContributionMeta(n, 0, p, base, 8 * (r + 1), 8, 1024)
                assert core.offer(meta, {k: d[k] for k in paths}, now).value == "accepted"
            now += 1e6  # past the grace window
            (pub,) = core.poll(now, 0.0)
            core.messages(pub, names)
            del pub  # a publication holds its round's offers until sent
    gc.collect()
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    fresh = core.buffers.allocated - allocated
    return core, current, peak, fresh, fresh + core.buffers.reused - reused


@pytest.mark.parametrize("publish_delta", ["int4", "none"])
def test_resident_bytes_per_parameter(publish_delta: str) -> None:
    core, current, peak, fresh, handed = _run(publish_delta)
    pieces = core.resident_bytes()
    # float32 global value and momentum: 8 B; the newest version and the one the learners'
    # next offers are based on, bfloat16: 4 B. Nothing held once the rounds closed.
    assert pieces["global"] == pieces["momentum"] == 4 * N
    assert pieces["versions"] == 2 * 2 * N
    assert pieces["held"] == 0 and pieces["differences"] == 0
    # The round buffers kept for the next rounds: one round's worth of the largest fragment
    # (its merged gradient, new value and Q_v), not more; once every fragment's round has
    # released the first buffers, every round's arrays are reused ones.
    fragment = N // 4
    assert 0 < core.spare_bytes() <= 12 * fragment
    assert fresh == 0
    # ... and they are every round's: each leaf's merged gradient (the new trace) and new
    # value come from the pool, and its Q_v where versions go down as differences (a full
    # version's Q_v is a view of its message's bytes), for the 4 fragments' 2 leaves.
    assert handed == (3 if publish_delta != "none" else 2) * 2 * 4
    # Everything the core allocated and still holds, accounted or not: the pieces above, the
    # spare buffers, plus bookkeeping (round book, ledger, a version's full message).
    assert current <= sum(pieces.values()) + core.spare_bytes() + 0.25 * N, (current / N, pieces)
    # Working memory beyond that, past the first rounds: about 3 float32 copies of the one
    # fragment being merged (12.2 B a parameter of it), not of the model; a trace allocated
    # afresh each round instead of taking over the merged gradient's arrays makes it 16.2.
    assert peak - current <= 14 * fragment, ((peak - current) / fragment, pieces)
