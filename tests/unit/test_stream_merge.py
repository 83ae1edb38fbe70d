"""Unit tests for algorithm/stream_merge.py: the merge read from encoded contributions equals
merge.py's over the decoded ones bit for bit, and holds one chunk of scratch, not a float32
copy per contribution."""

from __future__ import annotations

import dataclasses
import tracemalloc
from collections.abc import Callable

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_diloco.algorithm import merge, wire
from ray_diloco.algorithm.chunks import CHUNK
from ray_diloco.algorithm.stream_merge import (
    Streamed,
    _reader,
    arrival_norms,
    stream_leaf,
    stream_outer_gradient,
)
from ray_diloco.config import WireDtype

WIRES: list[tuple[WireDtype, int]] = [
    ("bfloat16", 0),
    ("int4", 64),
    ("int4", 48),
    ("int4", 7),
    ("int2", 20),
    ("int8", 0),
    ("float32", 0),
]


def _enc(rng: np.random.Generator, n: int, dtype: WireDtype, bs: int, scale: float) -> wire.Encoded:
    return wire.encode(rng.normal(0, scale, n).astype(np.float32), dtype, bs or 64)


def _same(a: merge.Scaled, b: merge.Scaled) -> None:
    np.testing.assert_array_equal(a[0], b[0])
    assert a[0].dtype == b[0].dtype == np.float32 and a[0].shape == b[0].shape
    assert a[1] == b[1]


@pytest.mark.parametrize(("dtype", "bs"), WIRES)
def test_reader_is_decode_from_any_chunk_start(dtype: WireDtype, bs: int) -> None:
    n = 3 * CHUNK + 37  # odd, and neither CHUNK nor any block size divides it
    enc = _enc(np.random.default_rng(1), n, dtype, bs, 1.0)
    want = wire.decode(enc)
    if dtype == "bfloat16":  # the shift that widens it is ml_dtypes' cast, bit for bit
        cast = np.frombuffer(enc.payload, ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(want.view(np.uint32), cast.view(np.uint32))
    fill = _reader(enc)
    got = np.empty(n, np.float32)
    for s in range(0, n, CHUNK):
        e = min(s + CHUNK, n)
        fill(s, e, got[s:e])
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize(("dtype", "bs"), WIRES)
def test_arrival_norms_are_decode_adds(dtype: WireDtype, bs: int) -> None:
    rng = np.random.default_rng(2)
    n = 2 * CHUNK + 1  # odd, a multiple of 3 and of no block size
    enc = _enc(rng, n, dtype, bs, 1e-3)
    base, g = rng.normal(0, 0.02, (2, n)).astype(np.float32)
    _, sq, own = wire.decode_add(enc, base, g)
    assert arrival_norms(enc, base, g) == (sq, own)
    assert arrival_norms(enc, base) == (0.0, own)
    # A leaf of two dimensions is read flat, as decode_add reads it.
    two_d = dataclasses.replace(enc, shape=(3, n // 3))  # the same bytes
    assert arrival_norms(two_d, base.reshape(3, -1), g.reshape(3, -1)) == (sq, own)
    with pytest.raises(ValueError, match="arrival_norms"):
        arrival_norms(enc, base[:-1], g)


CASES = [(*w, m, CHUNK) for w in WIRES for m in ("rda", "mean")]
CASES += [("bfloat16", 0, "rda", 2 * CHUNK), ("int4", 48, "mean", 2 * CHUNK)]


@pytest.mark.parametrize(("dtype", "bs", "method", "chunk"), CASES)
def test_stream_equals_merge_of_decoded_contributions(
    dtype: WireDtype, bs: int, method: merge.MergeMethod, chunk: int
) -> None:
    """As sync_core holds offers today: theta_c = decode_add(delta_c, base_c) against G,
    with two contributions on one base, one on another, one moved along with G since; a
    leaf that neither the chunk nor any block size divides (odd, too)."""
    n = 2 * CHUNK + 37
    rng = np.random.default_rng(bs)
    g, b0, b1, old = rng.normal(0, 0.02, (4, n)).astype(np.float32)
    encs = [_enc(rng, n, dtype, bs, s) for s in (1e-3, 2e-3, 5e-4, 1e-3)]
    weights = [1.0, 3.0, 0.0, 2.5]
    starts = [b0, b0, b1, old]
    thetas = [wire.decode_add(e, s)[0] for e, s in zip(encs, starts, strict=True)]
    thetas[3] = g + (thetas[3] - old)  # sync_core._anchored: an offer held over a round
    want = merge.scaled_outer_gradient(
        {"w": g}, [({"w": t}, w) for t, w in zip(thetas, weights, strict=True)], (), method
    )
    streamed = [Streamed({"w": e}, {"w": s}) for e, s in zip(encs, starts, strict=True)]
    streamed[3] = Streamed({"w": encs[3]}, {"w": old}, {"w": old})
    got = stream_outer_gradient(
        {"w": g}, list(zip(streamed, weights, strict=True)), (), method, chunk=chunk
    )
    _same(got["w"], want["w"])


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 2 * CHUNK + 1),
    wire_case=st.sampled_from(WIRES),
    m=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    method=st.sampled_from(["rda", "mean"]),
)
def test_stream_equals_merge_without_global_value(
    n: int, wire_case: tuple[WireDtype, int], m: int, seed: int, method: merge.MergeMethod
) -> None:
    """Plain deltas (no G, no base): `merge.rda` / `merge.weighted_mean` of the decoded ones."""
    dtype, bs = wire_case
    rng = np.random.default_rng(seed)
    encs = [_enc(rng, n, dtype, bs, float(rng.uniform(1e-4, 1.0))) for _ in range(m)]
    weights = list(rng.uniform(0.1, 5.0, m))
    decoded = [wire.decode(e) for e in encs]
    ref = merge.rda if method == "rda" else merge.weighted_mean
    want = ref(decoded, weights)
    array, scale = stream_leaf(None, [(e, None, None) for e in encs], weights, method)
    np.testing.assert_array_equal(merge._scaled((array, scale)), want)


def test_known_norms_and_embedding_leaves() -> None:
    """The guard's norms (arrival_norms) stand in for RDA's first pass; embedding leaves take
    the mean: the same as merge.py given the same."""
    rng = np.random.default_rng(3)
    leaves = {"emb": 700, "w": CHUNK + 3}
    g = {k: rng.normal(0, 0.02, n).astype(np.float32) for k, n in leaves.items()}
    deltas = [{k: _enc(rng, n, "int4", 64, 1e-3) for k, n in leaves.items()} for _ in range(3)]
    weights = [2.0, 1.0, 1.0]
    sq = [{k: arrival_norms(d[k], g[k], g[k])[0] for k in leaves} for d in deltas]
    thetas = [{k: wire.decode_add(d[k], g[k])[0] for k in leaves} for d in deltas]
    want = merge.scaled_outer_gradient(
        g, list(zip(thetas, weights, strict=True)), {"emb"}, "rda", sq
    )
    streamed = [Streamed(d, g) for d in deltas]
    got = stream_outer_gradient(g, list(zip(streamed, weights, strict=True)), {"emb"}, "rda", sq)
    for k in leaves:
        _same(got[k], want[k])
    assert got["emb"][1] == 1.0  # the mean's scale


def test_bad_input() -> None:
    g = np.zeros(4, np.float32)
    enc = wire.encode(np.ones(4, np.float32), "bfloat16")
    with pytest.raises(ValueError, match="chunk"):
        stream_leaf(g, [(enc, None, None)], [1.0], "rda", chunk=1000)
    with pytest.raises(ValueError, match=r"diloco\.merge"):
        stream_outer_gradient({"w": g}, [(Streamed({"w": enc}), 1.0)], method="sum")  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="lacks leaf"):
        stream_outer_gradient({"w": g, "v": g}, [(Streamed({"w": enc}), 1.0)])
    with pytest.raises(ValueError, match="not a well-formed"):
        stream_outer_gradient({"w": np.zeros(5, np.float32)}, [(Streamed({"w": enc}), 1.0)])
    with pytest.raises(ValueError, match="weights sum to zero"):
        stream_leaf(g, [(enc, None, None)], [0.0], "mean")


@pytest.mark.parametrize(
    ("dtype", "method"), [("bfloat16", "rda"), ("int4", "rda"), ("int4", "mean")]
)
def test_working_memory_is_a_chunk_not_a_copy_per_contribution(
    dtype: WireDtype, method: merge.MergeMethod
) -> None:
    """tracemalloc's peak beyond the merged result: a few chunks of float32 whatever the
    fragment's size, where decoding each contribution first costs 4 bytes a parameter each."""
    rng = np.random.default_rng(4)
    n, m = 8 * CHUNK + 5, 4
    g = rng.normal(0, 0.02, n).astype(np.float32)
    encs = [_enc(rng, n, dtype, 64, 1e-3)] * m  # the same bytes from every learner: no matter
    weights = [1.0] * m
    result = 4 * n  # the fragment-sized outer gradient every merge returns
    bound = 4 * CHUNK * 4 + 64 * 1024  # four chunks of float32 and small change

    def peak(fn: Callable[[], object]) -> int:
        tracemalloc.start()
        try:
            fn()
            return tracemalloc.get_traced_memory()[1] - result
        finally:
            tracemalloc.stop()

    streamed = [(Streamed({"w": e}, {"w": g}), w) for e, w in zip(encs, weights, strict=True)]
    assert peak(lambda: stream_outer_gradient({"w": g}, streamed, (), method)) <= bound

    def decoded_first() -> None:
        thetas = [({"w": wire.decode_add(e, g)[0]}, w) for e, w in zip(encs, weights, strict=True)]
        merge.scaled_outer_gradient({"w": g}, thetas, (), method)

    # The bound would catch the path that keeps float32 copies: it holds m of them.
    assert peak(decoded_first) >= m * 4 * n
