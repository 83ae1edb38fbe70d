"""Layer: algorithm (pure, no Ray, no arrays). Which synchronizer shard owns which fragments.

A run's synchronizer may be split into `synchronizer.num_shards` actors. Each owns a disjoint
set of fragments, balanced by bytes with greedy LPT (the largest fragment first, to the shard
holding the fewest elements so far; ties: lowest fragment index, lowest shard), so the merge
work and the memory of the global values, outer state and published versions are split
evenly. The result depends only on the fragment sizes and the shard count: every learner and
every shard computes the same owners from the fragment plan, with nothing to exchange.
Each shard checkpoints into its own directory (`shard_directory`).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from pathlib import Path


def shard_directory(run_dir: str | Path, shard: int) -> Path:
    """Where shard `shard` keeps its checkpoints (shard 0: where a lone synchronizer does)."""
    name = "synchronizer" if shard == 0 else f"synchronizer-shard{shard}"
    return Path(run_dir) / "checkpoints" / name


def assign_fragments(sizes: Sequence[int], num_shards: int) -> tuple[tuple[int, ...], ...]:
    """The fragments (ascending) each of `num_shards` shards owns; every shard owns one or
    more, so `num_shards` may not exceed the number of fragments."""
    if not 1 <= num_shards <= len(sizes):
        raise ValueError(
            f"assign_fragments: {num_shards} shards for {len(sizes)} fragments; every shard "
            "needs at least one fragment"
        )
    heap = [(0, s) for s in range(num_shards)]
    owned: list[list[int]] = [[] for _ in range(num_shards)]
    for p in sorted(range(len(sizes)), key=lambda p: (-sizes[p], p)):
        load, s = heapq.heappop(heap)
        owned[s].append(p)
        heapq.heappush(heap, (load + sizes[p], s))
    return tuple(tuple(sorted(fragments)) for fragments in owned)


def fragment_owners(sizes: Sequence[int], num_shards: int) -> list[int]:
    """`owners[p]`: the shard that owns fragment p."""
    owners = [0] * len(sizes)
    for s, fragments in enumerate(assign_fragments(sizes, num_shards)):
        for p in fragments:
            owners[p] = s
    return owners
