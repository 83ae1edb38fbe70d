"""Unit tests for algorithm/wire.py: round-trip error bounds, exact byte counts, layouts."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from ray_diloco.algorithm.wire import (
    Encoded,
    decode,
    decode_tree,
    encode,
    encode_tree,
    publish_dtype,
    tree_bytes,
    tree_wire_bytes,
    wire_bytes,
)
from ray_diloco.config import WireDtype

DTYPES: tuple[WireDtype, ...] = ("float32", "bfloat16", "int8", "int4", "int2")


def _rand(shape: tuple[int, ...], seed: int = 0, scale: float = 1.0) -> np.ndarray:
    return (scale * np.random.default_rng(seed).normal(size=shape)).astype(np.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [2, 3, 64, 128])
def test_wire_bytes_equals_encoded_nbytes(dtype: WireDtype, block_size: int) -> None:
    for n in [*range(0, 70), 127, 128, 129, 255, 1001, 4097]:
        enc = encode(_rand((n,), seed=n), dtype, block_size)
        assert enc.nbytes == wire_bytes(n, dtype, block_size), (dtype, block_size, n)
        assert decode(enc).shape == (n,)


def test_wire_bytes_hand_values() -> None:
    # 129 elements, blocks of 64: float32 4*129; bf16 2*129; int8 129 + one 4-byte scale;
    # int4 ceil(129/2) = 65 bytes of nibbles + ceil(129/64) = 3 scales * 4 bytes = 77.
    assert wire_bytes(129, "float32") == 516
    assert wire_bytes(129, "bfloat16") == 258
    assert wire_bytes(129, "int8") == 133
    assert wire_bytes(129, "int4", 64) == 77
    assert wire_bytes(0, "int4", 64) == 0
    # Large tensors: int4 with blocks of 64 costs 0.5 + 4/64 bytes/element, ~7.1x below float32.
    assert wire_bytes(1 << 20, "int4", 64) / (1 << 20) == pytest.approx(0.5625)


def test_float32_is_exact_and_keeps_shape() -> None:
    x = _rand((3, 4, 5))
    enc = encode(x, "float32")
    assert enc.scales == b""
    out = decode(enc)
    assert out.shape == (3, 4, 5) and out.dtype == np.float32
    np.testing.assert_array_equal(out, x)
    np.testing.assert_array_equal(decode(encode(np.float32(2.5), "float32")), np.float32(2.5))


def test_bfloat16_round_to_nearest_even() -> None:
    # bf16 keeps 7 mantissa bits: neighbours of 1.0 are 1 and 1 + 2^-7.
    x = np.array(
        [1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, 1.0, -2.0], dtype=np.float32
    )  # halfway->even 1.0; halfway->even 1+2^-6; above halfway->up; exact; exact
    out = decode(encode(x, "bfloat16"))
    np.testing.assert_array_equal(out, [1.0, 1 + 2**-6, 1 + 2**-7, 1.0, -2.0])
    # 1.0 is 0x3F80, little-endian on the wire.
    assert encode(np.array([1.0], np.float32), "bfloat16").payload == b"\x80\x3f"


def test_bfloat16_relative_error() -> None:
    x = _rand((1000,), scale=100.0)
    out = decode(encode(x, "bfloat16"))
    assert np.all(np.abs(out - x) <= 2.0**-8 * np.abs(x))


def test_int8_hand_example() -> None:
    # absmax 1.27 -> scale 0.01; q = round([-1.27, 0.5, 0.004, 1.27] / 0.01) = [-127, 50, 0, 127].
    x = np.array([-1.27, 0.5, 0.004, 1.27], np.float32)
    enc = encode(x, "int8")
    assert np.frombuffer(enc.payload, np.int8).tolist() == [-127, 50, 0, 127]
    assert np.frombuffer(enc.scales, "<f4")[0] == pytest.approx(0.01)
    np.testing.assert_allclose(decode(enc), [-1.27, 0.5, 0.0, 1.27], rtol=1e-6)


def test_int8_error_bound() -> None:
    x = _rand((33, 17), seed=1, scale=3.0)
    enc = encode(x, "int8")
    scale = float(np.frombuffer(enc.scales, "<f4")[0])
    assert scale == pytest.approx(np.abs(x).max() / 127, rel=1e-6)
    err = np.abs(decode(enc) - x)
    assert err.max() <= scale / 2 * (1 + 1e-5)


def test_int4_hand_example() -> None:
    # absmax 7 -> scale 1; q = [7, -7, 1, -1, 0]; nibbles (two's complement) 7, 9, 1, 15, 0, pad 0;
    # bytes = low | high << 4 = 0x97, 0xF1, 0x00.
    x = np.array([7.0, -7.0, 1.0, -1.0, 0.0], np.float32)
    enc = encode(x, "int4", block_size=64)
    assert enc.payload == bytes([0x97, 0xF1, 0x00])
    assert np.frombuffer(enc.scales, "<f4").tolist() == [1.0]
    assert enc.block_size == 64
    np.testing.assert_array_equal(decode(enc), x)


def test_int2_hand_example() -> None:
    # One block of 6: scale = absmax / 1 = 2; values round to -1, 0 or 1 (times 2), packed
    # four to a byte, lowest bits first: [1, 0, -1, 0] -> 0b00_11_00_01, [1, -1] -> 0b11_01.
    enc = encode(np.array([2.0, 0.4, -1.5, 0.9, 1.1, -2.0], np.float32), "int2", block_size=6)
    assert enc.payload == bytes([0b00110001, 0b1101])
    assert np.frombuffer(enc.scales, "<f4").tolist() == [2.0]
    np.testing.assert_array_equal(decode(enc), [2.0, 0.0, -2.0, 0.0, 2.0, -2.0])


def test_int4_blockwise_error_bound() -> None:
    # Three blocks of very different magnitude plus a one-element last block: each block's error is
    # bounded by its own scale / 2, so the small block is not drowned by the large one.
    bs = 16
    x = np.concatenate(
        [_rand((bs,), 1, 1e-3), _rand((bs,), 2, 10.0), _rand((bs,), 3, 1.0), _rand((1,), 4, 0.1)]
    ).reshape(7, 7)
    enc = encode(x, "int4", block_size=bs)
    scales = np.frombuffer(enc.scales, "<f4")
    assert scales.size == 4
    out = decode(enc)
    assert out.shape == (7, 7)
    flat_x, flat_out = x.reshape(-1), out.reshape(-1)
    for b, scale in enumerate(scales):
        block = slice(b * bs, (b + 1) * bs)
        assert scale == pytest.approx(np.abs(flat_x[block]).max() / 7, rel=1e-6)
        assert np.abs(flat_out[block] - flat_x[block]).max() <= scale / 2 * (1 + 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zeros_decode_to_zeros(dtype: WireDtype) -> None:
    for shape in [(0,), (1,), (3, 5), (130,)]:
        out = decode(encode(np.zeros(shape, np.float32), dtype, 64))
        assert out.shape == shape
        assert not np.any(out)
        assert np.all(np.isfinite(out))
    # An all-zero block next to a non-zero one (int4) or a zero tensor in a tree stays exact.
    x = np.concatenate([np.zeros(64, np.float32), np.ones(10, np.float32)])
    np.testing.assert_array_equal(decode(encode(x, dtype, 64))[:64], 0.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_refused(dtype: WireDtype, bad: float) -> None:
    x = np.array([1.0, bad, 2.0], np.float32)
    with pytest.raises(ValueError, match="refusing to encode non-finite"):
        encode(x, dtype)


def test_overflow_refused() -> None:
    # Finite in float64 but not in float32, and finite in float32 but rounding to inf in bf16.
    with pytest.raises(ValueError, match="non-finite"):
        encode(np.array([1e300]), "float32")
    with pytest.raises(ValueError, match="overflow bfloat16"):
        encode(np.array([3.4e38], np.float32), "bfloat16")


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="wire_dtype"):
        encode(np.ones(2), "fp8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="int4_block_size"):
        encode(np.ones(2), "int4", block_size=0)
    with pytest.raises(ValueError, match="num_elements"):
        wire_bytes(-1, "int8")
    truncated = dataclasses.replace(encode(np.ones(4), "int8"), payload=b"\x01")
    with pytest.raises(ValueError, match="expected"):
        decode(truncated)


def test_accepts_jax_arrays() -> None:
    x = jnp.arange(10, dtype=jnp.float32)
    np.testing.assert_array_equal(decode(encode(x, "float32")), np.arange(10, dtype=np.float32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_round_trip(dtype: WireDtype) -> None:
    values = {"blocks/0/q": _rand((8, 8), 5), "blocks/0/ln": _rand((8,), 6), "s": _rand((), 7)}
    enc = encode_tree(values, dtype, block_size=16)
    assert list(enc) == list(values)
    assert all(isinstance(e, Encoded) for e in enc.values())
    sizes = {k: v.size for k, v in values.items()}
    assert tree_bytes(enc) == tree_wire_bytes(sizes, dtype, 16)
    out = decode_tree(enc)
    for k, v in values.items():
        assert out[k].shape == v.shape and out[k].dtype == np.float32
        tol = {"float32": 0.0, "bfloat16": 2**-8, "int8": 1 / 127, "int4": 1 / 7, "int2": 1}[dtype]
        assert np.abs(out[k] - v).max() <= tol * np.abs(v).max() + 1e-7


def test_publish_dtype() -> None:
    assert publish_dtype("float32") == "float32"
    assert [publish_dtype(d) for d in ("bfloat16", "int8", "int4")] == ["bfloat16"] * 3


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_add_is_decode_plus_base_and_measures_the_distances(dtype: str) -> None:
    from ray_diloco.algorithm.chunks import CHUNK
    from ray_diloco.algorithm.wire import decode_add

    rng = np.random.default_rng(0)
    base = rng.normal(size=(2, CHUNK // 2 + 3)).astype(np.float32)
    anchor = base + 0.5
    enc = encode(rng.normal(0, 0.01, base.shape), dtype)
    theta, sq, own = decode_add(enc, base, anchor)
    expected = decode(enc) + base
    np.testing.assert_array_equal(theta, expected)
    assert theta.dtype == np.float32 and theta.shape == base.shape
    assert sq == pytest.approx(float(np.sum((anchor.astype(np.float64) - expected) ** 2)), rel=1e-5)
    # the learner's own update: the decoded delta alone
    assert own == pytest.approx(float(np.sum(decode(enc).astype(np.float64) ** 2)), rel=1e-5)
    assert decode_add(enc, base)[1] == 0.0
    with pytest.raises(ValueError, match="elements"):
        decode_add(enc, base[:1])


@pytest.mark.parametrize("dtype", ["int8", "int4", "int2"])
@pytest.mark.parametrize("block_size", [3, 64])
@pytest.mark.parametrize("kept", [np.float32, "bfloat16"])
def test_encode_difference_is_encode_then_decode_add_bit_for_bit(
    dtype: WireDtype, block_size: int, kept: object
) -> None:
    """What the synchronizer publishes in one fused pass (blockwise) is what a learner
    resolves from the difference it is sent: the same encoding, the same Q_v bits."""
    import ml_dtypes

    from ray_diloco.algorithm.chunks import CHUNK
    from ray_diloco.algorithm.wire import decode_add, encode_difference

    resolved = np.dtype(ml_dtypes.bfloat16 if kept == "bfloat16" else np.float32)
    rng = np.random.default_rng(1)
    for n, base_dtype in [(1, resolved), (5, np.float32), (2 * CHUNK + 37, resolved)]:
        base = rng.normal(size=n).astype(np.float32).astype(base_dtype)
        x = base.astype(np.float32) + rng.normal(0, 1e-2, n).astype(np.float32)
        x[: min(n, 2 * block_size)] = base[: min(n, 2 * block_size)]  # a zero difference block
        q = np.empty(n, resolved)
        enc = encode_difference(x, base, dtype, block_size, q)
        want = encode(x - base.astype(np.float32), dtype, block_size)
        assert enc == want
        assert q.dtype == resolved
        assert q.tobytes() == decode_add(want, base)[0].astype(resolved).tobytes()
    with pytest.raises(ValueError, match="refusing to encode non-finite"):
        encode_difference(np.array([1.0, np.nan]), np.zeros(2), dtype, block_size, q[:2])
