"""Layer: algorithm (pure, no Ray). Passes over large float32 arrays a cache-sized chunk at a
time: the synchronizer's merge, outer step and wire checks walk whole fragments (up to
gigabytes), and NumPy expressions over whole arrays would allocate a temporary of the array's
size per operation and stream it through memory once per operation. A chunk of `CHUNK`
elements stays in the core's cache while every operation of the pass runs over it.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from numpy.typing import ArrayLike

CHUNK = 1 << 16  # elements per pass: 256 KiB of float32, well inside a core's L2 cache
F32 = np.float32
BF16 = np.dtype(ml_dtypes.bfloat16)


def flat32(x: ArrayLike) -> np.ndarray:
    """A flat float32 view of `x` (a copy only when it is not contiguous float32)."""
    return np.ascontiguousarray(x, dtype=F32).reshape(-1)


def flat_kept(x: ArrayLike) -> np.ndarray:
    """A flat view of a kept array: bfloat16 as it is kept (a published version, read a chunk
    at a time by `wide`), anything else as float32 (`flat32`)."""
    a = np.asarray(x)
    return a.reshape(-1) if a.dtype == BF16 else flat32(a)


def wide(a: np.ndarray, s: int, e: int, scratch: np.ndarray) -> np.ndarray:
    """Elements s:e of `a` (a `flat_kept` array) in float32: a bfloat16 widened exactly (the top
    half of its float32) into `scratch`, a float32 one as a view."""
    if a.dtype != BF16:
        return a[s:e]
    out = scratch[: e - s]
    np.left_shift(a[s:e].view(np.uint16), 16, out=out.view(np.uint32), dtype=np.uint32)
    return out


def sq_distance(g: ArrayLike | None, x: ArrayLike) -> float:
    """`||g - x||^2` (`||x||^2` when `g` is None) in float64, each chunk summed in float32.
    NaN or inf when either holds one (or a square overflows float32, above ~1.8e19)."""
    xf = flat32(x)
    gf = None if g is None else flat32(g)
    if gf is not None and gf.size != xf.size:
        raise ValueError(f"sq_distance: sizes {gf.size} and {xf.size} differ")
    tmp = np.empty(min(CHUNK, xf.size), F32)
    total = 0.0
    with np.errstate(over="ignore", invalid="ignore"):  # the caller reads the non-finite sum
        for s in range(0, xf.size, CHUNK):
            e = min(s + CHUNK, xf.size)
            c = xf[s:e] if gf is None else np.subtract(gf[s:e], xf[s:e], out=tmp[: e - s])
            total += float(np.dot(c, c))
    return total
