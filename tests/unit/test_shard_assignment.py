"""Synchronizer shards (algorithm/shards.py): fragments split by balanced bytes."""

from __future__ import annotations

import pytest

from ray_diloco.algorithm.shards import assign_fragments, fragment_owners


def test_one_shard_owns_everything() -> None:
    assert assign_fragments([5, 3, 9], 1) == ((0, 1, 2),)
    assert fragment_owners([5, 3, 9], 1) == [0, 0, 0]


def test_balanced_by_bytes_disjoint_and_complete() -> None:
    # LPT: 9 -> shard 0, 7 -> shard 1, 5 -> shard 1 (7 < 9), 4 -> shard 0 (9 < 12),
    # 3 -> shard 1 (12 < 13).
    sizes = [5, 7, 9, 4, 3]
    assert assign_fragments(sizes, 2) == ((2, 3), (0, 1, 4))
    owned = [sum(sizes[p] for p in frags) for frags in assign_fragments(sizes, 2)]
    assert owned == [13, 15]
    assert fragment_owners(sizes, 2) == [1, 1, 0, 0, 1]


def test_equal_fragments_round_robin_and_every_shard_owns_one() -> None:
    shards = assign_fragments([10] * 6, 4)
    assert shards == ((0, 4), (1, 5), (2,), (3,))
    assert sorted(p for frags in shards for p in frags) == list(range(6))


def test_more_shards_than_fragments_refused() -> None:
    with pytest.raises(ValueError, match="at least one fragment"):
        assign_fragments([1, 2], 3)
