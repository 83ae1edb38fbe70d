"""Unit tests for algorithm/buffers.py: a buffer is handed out again only once nothing refers
to it, whatever refers to it, and the pool keeps no more unused bytes than its limit."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from ray_diloco.algorithm.buffers import Buffers


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


@pytest.mark.parametrize(
    "hold",
    [
        lambda a: a.reshape(-1)[10:],  # a view of the view
        memoryview,  # an export of its memory
        lambda a: {"anchor": a.T},  # a container's view
    ],
)
def test_a_released_buffer_is_reused_and_a_referenced_one_never(
    hold: Callable[[np.ndarray], object],
) -> None:
    pool = Buffers(limit_bytes=1 << 20)
    a = pool.empty((4, 25))
    first = _address(a)
    holder = hold(a)
    del a
    assert all(_address(pool.empty(100)) != first for _ in range(3))
    del holder
    again = pool.empty((10, 10), np.float32)
    assert _address(again) == first and again.shape == (10, 10)
    assert pool.allocated == 2  # the first, and the one handed out while the first was held
    assert pool.empty(100, np.float64).dtype == np.float64  # another dtype: its own buffer
    assert pool.allocated == 3


def test_unused_buffers_beyond_the_limit_are_let_go_other_sizes_first() -> None:
    pool = Buffers(limit_bytes=400)
    arrays = [pool.empty(100), pool.empty(100), pool.empty(10)]  # float32: 400, 400, 40 B
    del arrays
    assert pool.nbytes_unused() == 840  # nothing asked for since they were released
    held = pool.empty(100)  # one of the large ones again; the small one is let go first
    assert pool.reused == 1 and pool.nbytes_unused() == 400
    small = pool.empty(10)
    assert pool.allocated == 4 and pool.nbytes_unused() == 400
    del held, small
    pool.empty(7)  # a third size: both 100s and the 10 unused, 840 + 28 B, down to 400
    assert pool.nbytes_unused() <= 400
