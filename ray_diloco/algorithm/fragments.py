"""Layer: algorithm (pure, no Ray). Splits the flat parameter dict into P disjoint fragments
and decides which fragments are due at an inner step. Implements docs/algorithm.md section 3.

Parameters are a flat dict keyed by "/"-joined leaf paths (docs/contracts.md). A leaf is never
split: fragments are sets of whole leaves, balanced by greedy LPT (largest leaf first to the
currently smallest fragment). Embedding leaves are flagged in the plan because they merge with a
plain weighted mean instead of RDA (section 6).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

V = TypeVar("V")


@dataclass(frozen=True)
class FragmentPlan:
    """The fragments of a parameter dict: `fragments[p]` lists the leaf paths of fragment p
    (in the order of the `leaf_sizes` dict given to `plan_fragments`, i.e. model order),
    `sizes[p]` its number of elements, `embedding` the paths flagged as embeddings."""

    fragments: tuple[tuple[str, ...], ...]
    sizes: tuple[int, ...]
    embedding: frozenset[str]
    # Reverse index path -> fragment, built once; excluded from equality and repr because it is
    # derived from `fragments`.
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.fragments):
            raise ValueError(
                f"FragmentPlan: {len(self.fragments)} fragments but {len(self.sizes)} sizes"
            )
        index: dict[str, int] = {}
        for p, paths in enumerate(self.fragments):
            for path in paths:
                if path in index:
                    raise ValueError(
                        f"FragmentPlan: leaf {path!r} is in fragments {index[path]} and {p}"
                    )
                index[path] = p
        unknown = self.embedding - index.keys()
        if unknown:
            raise ValueError(
                f"FragmentPlan: embedding paths not in any fragment: {sorted(unknown)}"
            )
        # Frozen dataclass: the derived index is set once here, never mutated afterwards.
        object.__setattr__(self, "_index", index)

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    @property
    def paths(self) -> tuple[str, ...]:
        """Every leaf path, fragment by fragment."""
        return tuple(path for paths in self.fragments for path in paths)

    def fragment_of(self, path: str) -> int:
        """The fragment that holds leaf `path` (KeyError if the plan does not know it)."""
        try:
            return self._index[path]
        except KeyError:
            raise KeyError(f"leaf {path!r} is in no fragment of this plan") from None

    def is_embedding(self, path: str) -> bool:
        return path in self.embedding


def plan_fragments(
    leaf_sizes: Mapping[str, int], num_fragments: int, embedding_paths: Iterable[str] = ()
) -> FragmentPlan:
    """Balanced tensor fragmentation (section 3): greedy LPT over whole leaves.

    Leaves are taken largest first (ties: path, ascending) and each goes to the fragment with the
    fewest elements so far (ties: lowest fragment index), so the result depends only on the sizes
    and names, never on dict order. Inside a fragment, leaves keep the order of `leaf_sizes`.
    """
    if num_fragments < 1:
        raise ValueError(f"diloco.num_fragments={num_fragments} must be >= 1")
    if len(leaf_sizes) < num_fragments:
        raise ValueError(
            f"diloco.num_fragments={num_fragments} exceeds the {len(leaf_sizes)} parameter "
            f"leaves (a leaf is never split); set diloco.num_fragments to at most {len(leaf_sizes)}"
        )
    negative = {path: n for path, n in leaf_sizes.items() if n < 0}
    if negative:
        raise ValueError(f"leaf sizes must be >= 0, got {negative}")
    embedding = frozenset(embedding_paths)
    unknown = embedding - leaf_sizes.keys()
    if unknown:
        raise ValueError(f"embedding paths are not parameter leaves: {sorted(unknown)}")

    # Heap of (elements so far, fragment index): pops the smallest, lowest index first.
    heap = [(0, p) for p in range(num_fragments)]
    owner: dict[str, int] = {}
    for path, size in sorted(leaf_sizes.items(), key=lambda item: (-item[1], item[0])):
        total, p = heapq.heappop(heap)
        owner[path] = p
        heapq.heappush(heap, (total + size, p))

    members: list[list[str]] = [[] for _ in range(num_fragments)]
    for path in leaf_sizes:  # model order inside each fragment
        members[owner[path]].append(path)
    sizes = tuple(sum(leaf_sizes[path] for path in paths) for paths in members)
    return FragmentPlan(tuple(tuple(m) for m in members), sizes, embedding)


def _check_schedule(sync_every: int, num_fragments: int) -> None:
    if sync_every < 1:
        raise ValueError(f"diloco.sync_every={sync_every} must be >= 1")
    if num_fragments < 1:
        raise ValueError(f"diloco.num_fragments={num_fragments} must be >= 1")


def fragment_offset(p: int, sync_every: int, num_fragments: int) -> int:
    """Schedule offset of fragment p: `(p * H) // P`, spreading the P fragments over a window."""
    _check_schedule(sync_every, num_fragments)
    if not 0 <= p < num_fragments:
        raise ValueError(f"fragment {p} out of range [0, {num_fragments})")
    return (p * sync_every) // num_fragments


def due_fragments(step: int, sync_every: int, num_fragments: int) -> list[int]:
    """Fragments due after `step` completed inner steps (step >= 1), ascending:
    those p with `(step + offset_p) % sync_every == 0`."""
    _check_schedule(sync_every, num_fragments)
    if step < 1:
        raise ValueError(f"step={step}: due_fragments counts completed inner steps, >= 1")
    return [
        p
        for p in range(num_fragments)
        if (step + fragment_offset(p, sync_every, num_fragments)) % sync_every == 0
    ]


def slice_fragment(params: Mapping[str, V], plan: FragmentPlan, p: int) -> dict[str, V]:
    """The leaves of fragment p, in plan order (KeyError names a leaf missing from params)."""
    if not 0 <= p < plan.num_fragments:
        raise ValueError(f"fragment {p} out of range [0, {plan.num_fragments})")
    missing = [path for path in plan.fragments[p] if path not in params]
    if missing:
        raise KeyError(f"fragment {p}: params lack leaves {missing}")
    return {path: params[path] for path in plan.fragments[p]}
