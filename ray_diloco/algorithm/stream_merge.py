"""Layer: algorithm (pure, no Ray). A round's merge read straight from its contributions' wire
bytes: each contribution stays encoded (bfloat16, int4, ...) until the merge, which decodes it
one cache-sized chunk at a time, adds it into the outer gradient and moves on. Beyond its
fragment-sized result, a merge holds one chunk of float32 scratch whatever the number of
contributions or the fragment's size (`merge.py` takes the contributions as decoded float32
arrays: 4 bytes a parameter per contribution, held from arrival to the round's close). RDA's
two passes (the contributions' norms, then the directions) each decode the chunk again rather
than keep it; the norms the guard measured on arrival (`arrival_norms`) save the first.

The arithmetic is `merge.py`'s, operation for operation in float32 (the same decoded values,
the same sums, each squared norm summed per `CHUNK` in float32 and over chunks in float64),
so the result equals `merge.scaled_outer_gradient` over the decoded contributions bit for bit.
docs/decisions/070-streaming-merge.md has the measurements.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from ray_diloco.algorithm import merge, wire
from ray_diloco.algorithm.buffers import Buffers
from ray_diloco.algorithm.chunks import CHUNK, F32, flat32, flat_kept, wide
from ray_diloco.algorithm.merge import MergeMethod, Scaled, check_round

Values = Mapping[str, np.ndarray]


@dataclass(frozen=True)
class Streamed:
    """One contribution to a fragment as the merge reads it: its values are
    `theta = start + decode(delta)` per leaf (`decode(delta)` where `start` is None), and with
    `anchor` they are moved along with G since: `G + (theta - anchor)` (an offer held over
    from a round closed since, whose outer gradient stays its own update). `start` and
    `anchor` are the synchronizer's own fragment values (shared by every offer on that base),
    never a copy per contribution."""

    delta: Mapping[str, wire.Encoded]
    start: Values | None = None
    anchor: Values | None = None


def _reader(enc: wire.Encoded) -> wire.Fill:
    """`fill(s, e, out)`: decode elements s:e of `enc` into the float32 `out` from views of its
    buffers (no copy of the leaf): `wire.decode`'s values, bit for bit, from any chunk start."""
    wire._checked(enc)  # payload and scales of the sizes the elements need
    return wire._decoder(enc)[1]


class _Source:
    """One contribution's leaf: writes its outer gradient over elements s:e, `g - theta`
    (`theta` without `g`), exactly as `merge.py` computes it from `theta` in float32."""

    def __init__(
        self,
        enc: wire.Encoded,
        start: np.ndarray | None,
        anchor: np.ndarray | None,
        g: np.ndarray | None,
    ) -> None:
        self.fill = _reader(enc)
        self.start, self.anchor, self.g = start, anchor, g

    def outer(self, s: int, e: int, out: np.ndarray, scratch: np.ndarray) -> None:
        self.fill(s, e, out)
        if self.start is not None:
            out += wide(self.start, s, e, scratch)  # theta, as `wire.decode_add` makes it
        if self.anchor is not None:
            out -= self.anchor[s:e]
            out += self.g[s:e]  # type: ignore[index]  # G + (theta - anchor), as sync_core
        if self.g is not None:
            np.subtract(self.g[s:e], out, out=out)


def _sq(chunk: np.ndarray) -> float:
    """The chunk's squared norm as `chunks.sq_distance` sums it: in float32 per `CHUNK` of the
    leaf, in float64 over those (a chunk starts at a multiple of `CHUNK`, so its pieces are
    the leaf's)."""
    return sum(
        float(np.dot(p, p)) for p in (chunk[i : i + CHUNK] for i in range(0, chunk.size, CHUNK))
    )


def _check_chunk(chunk: int) -> None:
    if chunk < CHUNK or chunk % CHUNK:
        raise ValueError(f"stream merge: chunk={chunk} must be a positive multiple of {CHUNK}")


def _norms(sources: Sequence[_Source], n: int, chunk: int) -> list[float]:
    """`||d_c||^2` of every source's outer gradient, one chunk at a time."""
    buf, scratch = np.empty((2, min(chunk, n)), F32)
    sq = [0.0] * len(sources)
    with np.errstate(over="ignore", invalid="ignore"):  # a non-finite norm is the answer
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            for c, src in enumerate(sources):
                src.outer(s, e, buf[: e - s], scratch)
                sq[c] += _sq(buf[: e - s])
    return sq


def _combine(
    sources: Sequence[_Source],
    coefs: Sequence[float],
    n: int,
    chunk: int,
    buffers: Buffers | None,
) -> tuple[np.ndarray, float]:
    """`sum_c coefs[c] * d_c` in float32 (as `merge._combine`) and its squared norm, in an
    array of `buffers` (a fresh one without)."""
    out = np.empty(n, F32) if buffers is None else buffers.empty(n)
    buf, scratch = np.empty((2, min(chunk, n)), F32)
    total = 0.0
    live = [(src, F32(coef)) for src, coef in zip(sources, coefs, strict=True) if coef != 0.0]
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        acc, t = out[s:e], buf[: e - s]
        acc[...] = 0.0
        for src, coef in live:
            src.outer(s, e, t, scratch)
            t *= coef
            acc += t
        total += _sq(acc)
    return out, total


def arrival_norms(
    enc: wire.Encoded, start: ArrayLike, anchor: ArrayLike | None = None
) -> tuple[float, float]:
    """`wire.decode_add(enc, start, anchor)`'s two figures, `||anchor - (start + decode(enc))||^2`
    and `||decode(enc)||^2`, bit for bit (its chunks, its sums), without its array: what the
    synchronizer measures as an offer arrives (the norm guard's, and RDA's first pass), before
    it keeps the offer encoded. `start`, `anchor`: of the leaf's shape (or flat)."""
    n = wire._checked(enc)
    b = flat_kept(start)
    g = None if anchor is None else flat32(anchor)
    if b.size != n or (g is not None and g.size != n):
        raise ValueError(f"arrival_norms: {n} elements on the wire, values of another size")
    step, _ = wire._decoder(enc)
    fill = _reader(enc)
    buf = np.empty(min(step, n), F32)
    tmp = np.empty(min(step, n), F32)
    sq = own = 0.0
    with np.errstate(over="ignore", invalid="ignore"):  # a non-finite sum is the answer
        for s in range(0, n, step):
            e = min(s + step, n)
            chunk = buf[: e - s]
            fill(s, e, chunk)
            own += float(np.dot(chunk, chunk))
            chunk += wide(b, s, e, tmp)
            if g is not None:
                diff = np.subtract(g[s:e], chunk, out=tmp[: e - s])
                sq += float(np.dot(diff, diff))
    return sq, own


def stream_leaf(
    g: np.ndarray | None,
    sources: Sequence[tuple[wire.Encoded, np.ndarray | None, np.ndarray | None]],
    weights: Sequence[float],
    rule: MergeMethod,
    sq_norms: Sequence[float] | None = None,
    chunk: int = CHUNK,
    buffers: Buffers | None = None,
) -> Scaled:
    """One leaf's merged outer gradient as `(array, scale)`, from `(delta, start, anchor)` per
    contribution (see `Streamed`; `start`, `anchor` and `g` flat float32 arrays or None):
    `merge._mean_leaf` or `merge._rda_leaf` of the contributions' values, without decoding
    any contribution whole. `sq_norms`: `||d_c||^2` already known (RDA's first pass);
    `buffers`: where the result's array comes from (`buffers.py`)."""
    _check_chunk(chunk)
    if rule not in ("rda", "mean"):
        raise ValueError(f"diloco.merge={rule!r}: expected 'rda' or 'mean'")
    w = merge._normalized_weights(len(sources), weights)
    shapes = {enc.shape for enc, _, _ in sources}
    if len(shapes) != 1:
        raise ValueError(f"stream merge: deltas have different shapes {sorted(shapes)}")
    (shape,) = shapes
    n = math.prod(shape)
    for _, start, anchor in sources:
        for a in (g, start, anchor):
            if a is not None and a.size != n:
                raise ValueError(f"stream merge: {a.size} values for a leaf of {n} elements")
        if anchor is not None and g is None:
            raise ValueError("stream merge: a moved contribution needs the global value")
    srcs = [_Source(enc, start, anchor, g) for enc, start, anchor in sources]
    if rule == "mean":
        out, _ = _combine(srcs, list(w), n, chunk, buffers)
        return out.reshape(shape), 1.0
    if sq_norms is None:
        sq_norms = _norms(srcs, n, chunk)
    # `merge._rda_leaf` from here on: unit(0) = 0, the radius, the direction's norm.
    norms = np.sqrt(np.asarray(sq_norms, np.float64))
    coefs = [wc / nc if nc > 0 else 0.0 for wc, nc in zip(w, norms, strict=True)]
    radius = float(w @ norms)
    direction, direction_sq = _combine(srcs, coefs, n, chunk, buffers)
    direction_norm = math.sqrt(direction_sq)
    if direction_norm <= merge._DIRECTION_EPS:
        return np.zeros(shape, F32), 0.0
    return direction.reshape(shape), radius / direction_norm


def stream_outer_gradient(
    global_values: Values,
    contributions: Sequence[tuple[Streamed, float]],
    embedding_paths: Collection[str] = (),
    method: MergeMethod = "rda",
    sq_norms: Sequence[Mapping[str, float]] | None = None,
    chunk: int = CHUNK,
    buffers: Buffers | None = None,
) -> dict[str, Scaled]:
    """`merge.scaled_outer_gradient(global_values, [(theta_c, w_c)], ...)` with each `theta_c`
    given as a `Streamed` contribution (still encoded) instead of a float32 array: the same
    leaves, the same `(array, scale)` pairs, bit for bit."""
    weights = check_round(method, contributions)
    result: dict[str, Scaled] = {}
    for path, value in global_values.items():
        g = flat32(value)
        sources = []
        for i, (c, _) in enumerate(contributions):
            enc = c.delta.get(path)
            if enc is None:
                raise KeyError(f"outer_gradient: contribution {i} lacks leaf {path!r}")
            if not wire.well_formed(enc, np.shape(value)):
                raise ValueError(
                    f"outer_gradient: leaf {path!r} of contribution {i} is not a well-formed "
                    f"encoding of shape {np.shape(value)}"
                )
            start = None if c.start is None else flat_kept(c.start[path])
            anchor = None if c.anchor is None else flat32(c.anchor[path])
            sources.append((enc, start, anchor))
        rule: MergeMethod = "mean" if method == "mean" or path in embedding_paths else "rda"
        known = None if sq_norms is None or rule == "mean" else [sq[path] for sq in sq_norms]
        result[path] = stream_leaf(g, sources, weights, rule, known, chunk, buffers)
    return result
