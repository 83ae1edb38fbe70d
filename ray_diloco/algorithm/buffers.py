"""Layer: algorithm (pure, no Ray). Fragment-sized arrays handed out again once nothing refers
to them.

Every round the synchronizer writes a fragment's merged gradient and its new global value,
hundreds of megabytes each at a billion parameters. A fresh array that large comes from the
operating system, and its first touch faults in every page of it (the kernel zeroes and maps
it, and compacts memory when it hands out huge pages): measured at 1B parameters, a fifth of a
round's CPU time, and the round's most variable part. A buffer that served an earlier round and
is no longer referenced costs none of that.

Whether a buffer is still referenced is exact, not guessed: an array handed out is a view of
a buffer this pool owns, and CPython counts every view's reference to its buffer
(`ndarray.base`; a view of a view refers to the same buffer, and so does anything that
exports its memory), so a buffer whose only references are the pool's is unused. A value kept
in the published history, an offer anchored at an old value, a checkpoint being written from
one: each keeps its buffer out of reuse for as long as it holds on.

Unused buffers beyond `limit_bytes` in all are let go, those of other sizes than the one asked
for first, so what the pool keeps unused is bounded (the synchronizer sets it to one round's
need: docs/synchronizer-memory.md counts it as working memory).
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Sequence

import numpy as np
from numpy.typing import DTypeLike

from ray_diloco.algorithm.chunks import F32

# sys.getrefcount(owned[i]) of a buffer nobody else refers to: the list's reference and the
# call's argument.
_UNUSED = 2


class Buffers:
    """A pool of buffers by (elements, dtype): `empty` gives an uninitialised array of any
    shape, reusing an unused buffer of the same size when there is one; `limit_bytes` bounds
    the bytes of the unused ones it keeps."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._owned: dict[tuple[int, np.dtype], list[np.ndarray]] = {}
        self._lock = threading.Lock()  # two rounds merging at once must not share a buffer
        self.reused = 0
        self.allocated = 0

    def empty(self, shape: Sequence[int] | int, dtype: DTypeLike = F32) -> np.ndarray:
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        key = (math.prod(shape), np.dtype(dtype))
        with self._lock:
            owned = self._owned.setdefault(key, [])
            free = self._unused(owned)
            if free:
                self.reused += 1
                buf = owned[free[0]]
            else:
                self.allocated += 1
                buf = np.empty(key[0], key[1])
                owned.append(buf)
            view = buf[:].reshape(shape)
            self._trim(keep=key)
        return view

    def _unused(self, owned: list[np.ndarray]) -> list[int]:
        return [i for i in range(len(owned)) if sys.getrefcount(owned[i]) == _UNUSED]

    def _trim(self, keep: tuple[int, np.dtype]) -> None:
        """Let unused buffers go until those kept fit `limit_bytes`: other sizes first, then
        the newest of `keep`'s (the array just handed out is referenced, so never one)."""
        over = self.nbytes_unused() - self.limit_bytes
        for key in sorted(self._owned, key=lambda k: k == keep):
            owned = self._owned[key]
            for i in reversed(self._unused(owned)):
                if over <= 0:
                    return
                over -= owned[i].nbytes
                del owned[i]

    def nbytes_unused(self) -> int:
        """Bytes of the buffers nobody refers to now: what the pool keeps beyond the state."""
        return sum(owned[i].nbytes for owned in self._owned.values() for i in self._unused(owned))
