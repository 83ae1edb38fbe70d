"""Layer: algorithm (pure, no Ray). Wire formats for fragments crossing a learner-synchronizer
link: float32, bfloat16, int8 (per-tensor scale), int4 (blockwise scales, two values per
byte) and int2 (blockwise scales, four values per byte: where quality breaks). Streaming
DiLoCo (docs/algorithm.md section 1) sends outer gradients in 4 bits without measurable loss; the
byte counts here are what the bandwidth measure (section 9) adds up.

Layouts (all little-endian, independent of the host):
- float32: 4 bytes per element, no scales.
- bfloat16: 2 bytes per element, round-to-nearest-even (ml_dtypes), no scales.
- int8: one byte per element `round(x / s)` in [-127, 127], one float32 scale `s = absmax / 127`.
- int4: the flattened tensor in blocks of `block_size` elements (the last may be short), one
  float32 scale `absmax / 7` per block, values in [-7, 7] as two's-complement nibbles, element
  2i in the low nibble of byte i and 2i+1 in the high one (ceil(n / 2) bytes).
- int2: as int4, with scale `absmax / 1` and values in [-1, 1] as two-bit two's-complement
  fields, element 4i + j in bits 2j..2j+1 of byte i (ceil(n / 4) bytes).
`Encoded.nbytes` counts payload and scales only; dtype, shape and block size are metadata that
both ends already know from the config and the fragment plan.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import ml_dtypes
import numpy as np
from numpy.typing import ArrayLike

from ray_diloco.algorithm.chunks import CHUNK, F32, flat32, flat_kept, sq_distance, wide
from ray_diloco.config import WireDtype

_DTYPES: tuple[WireDtype, ...] = ("float32", "bfloat16", "int8", "int4", "int2")
_INT8_MAX = 127
# The blockwise dtypes: bits per element and the largest magnitude they carry.
_BLOCKWISE = {"int4": (4, 7), "int2": (2, 1)}
_F32 = np.dtype("<f4")
_NON_FINITE = "refusing to encode non-finite values (NaN or inf)"


@dataclass(frozen=True)
class Encoded:
    """One leaf on the wire. `block_size` is meaningful for int4 and int2 only (0 otherwise)."""

    dtype: WireDtype
    shape: tuple[int, ...]
    payload: bytes
    scales: bytes
    block_size: int = 0

    @property
    def nbytes(self) -> int:
        return len(self.payload) + len(self.scales)

    @property
    def num_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def _check(dtype: str, block_size: int) -> None:
    if dtype not in _DTYPES:
        raise ValueError(f"diloco.wire_dtype={dtype!r}: expected one of {list(_DTYPES)}")
    if dtype in _BLOCKWISE and block_size < 1:
        raise ValueError(f"diloco.int4_block_size={block_size} must be >= 1")


def _num_blocks(num_elements: int, block_size: int) -> int:
    return -(-num_elements // block_size)


def wire_bytes(num_elements: int, dtype: WireDtype, block_size: int = 64) -> int:
    """Bytes `encode` produces for a leaf of `num_elements` elements (equal to `.nbytes`)."""
    _check(dtype, block_size)
    if num_elements < 0:
        raise ValueError(f"wire_bytes: num_elements={num_elements} must be >= 0")
    if dtype == "float32":
        return 4 * num_elements
    if dtype == "bfloat16":
        return 2 * num_elements
    if dtype == "int8":
        return num_elements + 4
    per_byte = 8 // _BLOCKWISE[dtype][0]
    return -(-num_elements // per_byte) + 4 * _num_blocks(num_elements, block_size)


def _scale_bytes(num_elements: int, dtype: WireDtype, block_size: int) -> int:
    """Bytes of scales a leaf of `num_elements` elements carries (the rest is payload)."""
    if dtype == "int8":
        return 4
    return 4 * _num_blocks(num_elements, block_size) if dtype in _BLOCKWISE else 0


def well_formed(enc: object, shape: tuple[int, ...]) -> bool:
    """`enc` is an `Encoded` leaf of `shape` that decodes: a wire dtype, and payload and scales
    of the byte counts its elements need. The synchronizer checks a learner's offer with it
    before decoding (a broken or malicious one is refused, never a crash)."""
    if not (isinstance(enc, Encoded) and enc.shape == shape and enc.dtype in _DTYPES):
        return False
    if not (isinstance(enc.payload, bytes) and isinstance(enc.scales, bytes)):
        return False
    if enc.dtype in _BLOCKWISE and (not isinstance(enc.block_size, int) or enc.block_size < 1):
        return False
    n = enc.num_elements
    scales = _scale_bytes(n, enc.dtype, enc.block_size)
    return len(enc.scales) == scales and enc.nbytes == wire_bytes(n, enc.dtype, enc.block_size)


def _symmetric(blocks: np.ndarray, qmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Quantize each row of `blocks` (finite float32) with scale absmax / qmax: (q as int8,
    scales). The absmax is exact; the scale and the quotient are taken in float64."""
    # |x| is x without its sign bit, and non-negative floats order as their bits do: the
    # integer maximum is the float's, and NumPy reduces integers along a short row 2.5x faster.
    bits = blocks.view(np.uint32) & np.uint32(0x7FFFFFFF)
    absmax = (np.max(bits, axis=1) if blocks.shape[1] else np.zeros(len(blocks), np.uint32)).view(
        F32
    )
    scales = (absmax.astype(np.float64) / qmax).astype(np.float32)
    # A zero (or underflowed) scale means the block is all zeros as far as float32 can tell
    # (every |x| below ~1e-44): divide by 1 instead, which rounds each to 0.
    safe = np.where(scales > 0, scales, 1.0).astype(np.float64)
    q = np.divide(blocks, safe[:, None])
    np.rint(q, out=q)
    q8 = q.astype(np.int8)
    # float32 rounds absmax / qmax to within 2^-24 of it: a quotient reaches qmax, no further.
    return np.clip(q8, -qmax, qmax, out=q8), scales


def encode(x: ArrayLike, dtype: WireDtype, block_size: int = 64) -> Encoded:
    """Encode one leaf (cast to float32 first). Non-finite values raise ValueError: guards
    reject NaN contributions before this, and the wire must not hide one inside a scale."""
    _check(dtype, block_size)
    with np.errstate(over="ignore"):  # overflow to inf is reported just below, as an error
        arr = np.asarray(x, dtype=np.float32)
    shape = tuple(int(d) for d in arr.shape)
    flat = arr.reshape(-1)
    if dtype in _BLOCKWISE:  # checked for finite values a chunk at a time
        return _blockwise(flat, None, shape, dtype, block_size, None)
    # A finite squared norm (one cache-friendly pass) proves every value finite and below
    # ~1.8e19, far inside bfloat16's range; only otherwise look element by element.
    small = math.isfinite(sq_distance(None, arr))
    if not small and not np.all(np.isfinite(arr)):
        raise ValueError(_NON_FINITE)
    if dtype == "float32":
        return Encoded(dtype, shape, flat.astype(_F32, copy=False).tobytes(), b"")
    if dtype == "bfloat16":
        bf = flat.astype(ml_dtypes.bfloat16)
        if not small and not np.all(np.isfinite(bf)):
            raise ValueError("refusing to encode values that overflow bfloat16")
        return Encoded(dtype, shape, bf.view(np.uint16).astype("<u2", copy=False).tobytes(), b"")
    q, scales = _symmetric(flat[None, :], _INT8_MAX)
    return Encoded(dtype, shape, q.tobytes(), scales.astype(_F32).tobytes())


def encode_difference(
    x: ArrayLike, base: ArrayLike, dtype: WireDtype, block_size: int, out: np.ndarray
) -> Encoded:
    """`encode(x - base)`, with `base + decode(...)` of it written into `out` (float32 or
    bfloat16, of `base`'s size): a published difference and the value it resolves to, bit for
    bit `encode` then `decode_add` (`downstream.resolve`). Blockwise dtypes take it in one pass
    a chunk at a time, without the difference's or the float32 result's array (the
    synchronizer publishes fragments of gigabytes every round)."""
    _check(dtype, block_size)
    xf, b, flat_out = flat32(x), flat_kept(base), out.reshape(-1)
    if not xf.size == b.size == flat_out.size:
        raise ValueError(
            f"encode_difference: {xf.size} values, {b.size} in the base, {flat_out.size} out"
        )
    shape = tuple(int(d) for d in np.shape(base))
    if dtype in _BLOCKWISE:
        return _blockwise(xf, b, shape, dtype, block_size, flat_out)
    with np.errstate(over="ignore"):
        enc = encode(xf - flat32(b), dtype, block_size)
    flat_out[...] = decode_add(enc, b)[0].reshape(-1)
    return enc


def _blockwise(
    x: np.ndarray,
    base: np.ndarray | None,
    shape: tuple[int, ...],
    dtype: WireDtype,
    block_size: int,
    resolved: np.ndarray | None,
) -> Encoded:
    """`encode` of the flat float32 `x` (minus the `chunks.flat_kept` array `base`, if given)
    in a blockwise dtype, with `base + decode(...)` written into `resolved` if given (as
    `decode_add` adds it: each value times its block's float32 scale, then the base)."""
    bits, qmax = _BLOCKWISE[dtype]
    n = x.size
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    packed = np.empty(-(-n // per_byte), np.uint8)
    scales = np.empty(_num_blocks(n, block_size), _F32)
    # Blocks are independent: encode whole blocks (and bytes) a chunk at a time, so the
    # float64 temporaries are a chunk's, not the leaf's.
    whole = per_byte * block_size
    step = max(whole, CHUNK // whole * whole)
    buf = np.zeros(_num_blocks(min(step, n), block_size) * block_size, F32)
    scratch = np.empty(min(step, n), F32)
    with np.errstate(over="ignore", invalid="ignore"):  # a non-finite chunk raises below
        for s in range(0, n, step):
            e = min(s + step, n)
            blocks = _num_blocks(e - s, block_size)
            chunk = buf[: blocks * block_size]
            below = None if base is None else wide(base, s, e, scratch)
            if below is None:
                chunk[: e - s] = x[s:e]
            else:
                np.subtract(x[s:e], below, out=chunk[: e - s])
            chunk[e - s :] = 0.0  # zero padding leaves every block's absmax unchanged
            if not math.isfinite(float(np.dot(chunk, chunk))) and not np.all(np.isfinite(chunk)):
                raise ValueError(_NON_FINITE)
            q, sc = _symmetric(chunk.reshape(blocks, block_size), qmax)
            first = s // block_size
            scales[first : first + blocks] = sc
            fields = q.reshape(-1)[: -(-(e - s) // per_byte) * per_byte].view(np.uint8) & mask
            if fields.size % per_byte:  # the short last byte of a padded block
                fields = np.concatenate([fields, np.zeros(-fields.size % per_byte, np.uint8)])
            fields = fields.reshape(-1, per_byte)
            out = packed[s // per_byte : s // per_byte + len(fields)]
            np.copyto(out, fields[:, 0])
            for j in range(1, per_byte):
                out |= fields[:, j] << (bits * j)
            if resolved is not None and below is not None:
                value = np.multiply(q.reshape(blocks, block_size), sc[:, None], dtype=F32)
                value = value.reshape(-1)[: e - s]
                resolved[s:e] = np.add(value, below, out=value)
    return Encoded(dtype, shape, packed.tobytes(), scales.tobytes(), block_size)


def _checked(enc: Encoded) -> int:
    """The number of elements of `enc`, after checking its byte count."""
    _check(enc.dtype, enc.block_size)
    n = enc.num_elements
    if enc.nbytes != wire_bytes(n, enc.dtype, enc.block_size):
        raise ValueError(
            f"decode: {enc.nbytes} bytes for {n} {enc.dtype} elements, expected "
            f"{wire_bytes(n, enc.dtype, enc.block_size)}"
        )
    return n


Fill = Callable[[int, int, np.ndarray], None]


def _unpack_table(bits: int) -> np.ndarray:
    """Row b: the values byte b of a blockwise payload holds, lowest bits first, each field
    sign-extended from two's complement (int4: 8..15 become -8..-1; int2: 2, 3 become -2, -1)."""
    mask, sign = (1 << bits) - 1, 1 << (bits - 1)
    fields = range(8 // bits)
    return np.array(
        [[(((b >> (bits * j)) & mask) ^ sign) - sign for j in fields] for b in range(256)],
        dtype=np.float32,
    )


_UNPACK = {dtype: _unpack_table(bits) for dtype, (bits, _) in _BLOCKWISE.items()}


def _decoder(enc: Encoded) -> tuple[int, Fill]:
    """(chunk size, fill): `fill(s, e, out)` writes decoded elements s:e into `out`, reading
    views of the leaf's buffers. Any `s` will do that is a multiple of the elements a payload
    byte holds (`stream_merge.py` starts chunks at multiples of `CHUNK`); the chunk size is the
    one `decode` and `decode_add` step by (int4 chunks of whole blocks)."""
    if enc.dtype == "float32":
        src = np.frombuffer(enc.payload, dtype=_F32)

        def fill(s: int, e: int, out: np.ndarray) -> None:
            out[...] = src[s:e]

        return CHUNK, fill
    if enc.dtype == "bfloat16":
        bits = np.frombuffer(enc.payload, dtype="<u2").astype(np.uint16, copy=False)

        def fill_bf16(s: int, e: int, out: np.ndarray) -> None:
            # A bfloat16 is the top half of its float32: the shift is exact, and twice as fast
            # as ml_dtypes' cast.
            np.left_shift(bits[s:e], 16, out=out.view(np.uint32), dtype=np.uint32)

        return CHUNK, fill_bf16
    if enc.dtype == "int8":
        q8 = np.frombuffer(enc.payload, dtype=np.int8)
        scale = np.frombuffer(enc.scales, dtype=_F32)[0]
        return CHUNK, lambda s, e, out: np.multiply(q8[s:e], scale, out=out)
    packed = np.frombuffer(enc.payload, dtype=np.uint8)
    scales = np.frombuffer(enc.scales, dtype=_F32)
    bs = enc.block_size
    table = _UNPACK[enc.dtype]
    per_byte = table.shape[1]
    whole_bytes = per_byte * bs
    step = max(whole_bytes, CHUNK // whole_bytes * whole_bytes)  # whole blocks and bytes

    def fill4(s: int, e: int, out: np.ndarray) -> None:
        part = packed[s // per_byte : -(-e // per_byte)]
        if (e - s) % per_byte == 0:  # one gather: each byte to its values
            # A byte indexes a row of the table whatever its value: "clip" never clips, and
            # saves the temporary copy of `out` that the default "raise" writes through.
            np.take(table, part, axis=0, out=out.reshape(-1, per_byte), mode="clip")
        else:  # the leaf's last chunk, with the padding fields
            out[...] = table[part].reshape(-1)[: e - s]
        # Scales by block: the rest of the block the chunk starts in (none from a chunk
        # boundary), its whole blocks, and the part of the block it ends in.
        head = min(e, -(-s // bs) * bs) - s
        if head:
            out[:head] *= scales[s // bs]
        whole = (e - s - head) // bs * bs
        first = (s + head) // bs
        out[head : head + whole].reshape(-1, bs)[...] *= scales[first : first + whole // bs, None]
        if head + whole < e - s:
            out[head + whole :] *= scales[(s + head + whole) // bs]

    return step, fill4


def decode_add(
    enc: Encoded, base: ArrayLike, anchor: ArrayLike | None = None
) -> tuple[np.ndarray, float, float]:
    """`decode(enc) + base` as a fresh float32 array of `base`'s shape (a learner's values from
    its delta and the published base), `||anchor - result||^2` (0.0 without an anchor) and
    `||decode(enc)||^2` (the learner's own update; the norm guard's), NaN or inf when not
    finite, in one pass a cache-sized chunk at a time: every contribution goes through here,
    the synchronizer's hot path."""
    n = _checked(enc)
    b = flat32(base)
    if b.size != n:
        raise ValueError(f"decode_add: {n} elements on the wire, {b.size} in the base")
    g = None if anchor is None else flat32(anchor)
    step, fill = _decoder(enc)
    out = np.empty(n, _F32)
    tmp = np.empty(min(step, n), _F32)
    sq = own = 0.0
    with np.errstate(over="ignore", invalid="ignore"):  # a non-finite sum is the answer
        for s in range(0, n, step):
            e = min(s + step, n)
            chunk = out[s:e]
            fill(s, e, chunk)
            own += float(np.dot(chunk, chunk))  # the delta, while the chunk is in cache
            chunk += b[s:e]
            if g is not None:
                diff = np.subtract(g[s:e], chunk, out=tmp[: e - s])
                sq += float(np.dot(diff, diff))
    return out.reshape(np.shape(base)), sq, own


def decode(enc: Encoded) -> np.ndarray:
    """The float32 array of the original shape: a fresh array the caller may modify."""
    n = _checked(enc)
    step, fill = _decoder(enc)
    out = np.empty(n, _F32)
    for s in range(0, n, step):
        fill(s, min(s + step, n), out[s : min(s + step, n)])
    return out.reshape(enc.shape)


def encode_tree(
    values: Mapping[str, ArrayLike], dtype: WireDtype, block_size: int = 64
) -> dict[str, Encoded]:
    """Encode every leaf of a flat dict (a fragment), keeping its order."""
    return {path: encode(v, dtype, block_size) for path, v in values.items()}


def decode_tree(encoded: Mapping[str, Encoded]) -> dict[str, np.ndarray]:
    return {path: decode(enc) for path, enc in encoded.items()}


def tree_bytes(encoded: Mapping[str, Encoded]) -> int:
    """Bytes an encoded fragment puts on the wire."""
    return sum(enc.nbytes for enc in encoded.values())


def offered_bytes(delta: object) -> int:
    """Bytes a contribution put on the wire; what is not an encoded leaf counts 0 (a broken
    learner's offer is refused, and counted, without a crash)."""
    if not isinstance(delta, Mapping):
        return 0
    return sum(
        e.nbytes for e in delta.values() if isinstance(e, Encoded) and well_formed(e, e.shape)
    )


def tree_wire_bytes(leaf_sizes: Mapping[str, int], dtype: WireDtype, block_size: int = 64) -> int:
    """Bytes a fragment with these leaf sizes would put on the wire, without encoding it
    (equal to `tree_bytes(encode_tree(...))`)."""
    return sum(wire_bytes(n, dtype, block_size) for n in leaf_sizes.values())


def publish_dtype(wire_dtype: WireDtype) -> WireDtype:
    """Dtype of a published global fragment (docs/contracts.md): float32 when the wire is
    float32, else bfloat16; the downstream value is not quantized to int8/int4, because it
    replaces the learner's parameters outright rather than adding a small delta."""
    return "float32" if wire_dtype == "float32" else "bfloat16"
