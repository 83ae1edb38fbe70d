"""Unit tests for algorithm/fragments.py (docs/algorithm.md section 3)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from ray_diloco.algorithm.fragments import (
    FragmentPlan,
    due_fragments,
    fragment_offset,
    plan_fragments,
    slice_fragment,
)


def _sizes(n: int, seed: int = 0) -> dict[str, int]:
    rng = random.Random(seed)
    return {f"leaf/{i}": rng.randint(1, 10_000) for i in range(n)}


@pytest.mark.parametrize("num_fragments", [1, 2, 5, 12])
def test_fragments_cover_every_leaf_exactly_once(num_fragments: int) -> None:
    sizes = _sizes(12)
    plan = plan_fragments(sizes, num_fragments, ["leaf/0"])
    assert plan.num_fragments == num_fragments
    assert sorted(plan.paths) == sorted(sizes)
    assert len(plan.paths) == len(set(plan.paths))
    assert all(plan.fragments)  # no empty fragment when leaves >= fragments
    assert plan.sizes == tuple(sum(sizes[k] for k in frag) for frag in plan.fragments)
    assert plan.embedding == frozenset({"leaf/0"})
    for p, frag in enumerate(plan.fragments):
        for path in frag:
            assert plan.fragment_of(path) == p


def test_leaves_keep_model_order_inside_a_fragment() -> None:
    sizes = {"z": 5, "a": 5, "m": 5, "b": 1}
    plan = plan_fragments(sizes, 2)
    order = list(sizes)
    for frag in plan.fragments:
        assert list(frag) == sorted(frag, key=order.index)


def test_equal_leaves_are_balanced_exactly() -> None:
    plan = plan_fragments({f"w{i}": 100 for i in range(24)}, 6)
    assert set(plan.sizes) == {400}
    plan = plan_fragments({f"w{i}": 100 for i in range(25)}, 6)
    assert max(plan.sizes) - min(plan.sizes) == 100


def test_lpt_balance_on_transformer_like_sizes() -> None:
    # 4 blocks of (norm, q, k, v, o, up, down, norm) plus embeddings: LPT keeps fragments within
    # one largest leaf of each other.
    d, f, v = 96, 384, 256
    sizes = {"embed/token": v * d, "embed/pos": 64 * d, "final_norm": d, "unembed": d * v}
    for b in range(4):
        for name, n in [("ln1", d), ("q", d * d), ("k", d * d), ("v", d * d), ("o", d * d)]:
            sizes[f"blocks/{b}/{name}"] = n
        sizes[f"blocks/{b}/up"] = d * f
        sizes[f"blocks/{b}/down"] = f * d
        sizes[f"blocks/{b}/ln2"] = d
    plan = plan_fragments(sizes, 8)
    assert max(plan.sizes) - min(plan.sizes) <= max(sizes.values())
    assert max(plan.sizes) / min(plan.sizes) < 1.5


def test_lpt_hand_example() -> None:
    # Largest first: c=7, a=5, b=4, d=3, e=1. Totals (frag0, frag1) after each placement:
    # c->0 (7, 0); a->1 (7, 5); b->1 (7, 9); d->0 (10, 9); e->1 (10, 10).
    plan = plan_fragments({"a": 5, "b": 4, "c": 7, "d": 3, "e": 1}, 2)
    assert plan.fragments == (("c", "d"), ("a", "b", "e"))
    assert plan.sizes == (10, 10)


def test_ties_are_broken_by_path_not_dict_order() -> None:
    sizes = _sizes(30, seed=3) | {f"tie/{i}": 500 for i in range(6)}
    shuffled = list(sizes.items())
    random.Random(1).shuffle(shuffled)
    a = plan_fragments(sizes, 7)
    b = plan_fragments(dict(shuffled), 7)
    assert [set(f) for f in a.fragments] == [set(f) for f in b.fragments]
    assert a == plan_fragments(dict(sizes), 7)  # deterministic, and plans compare by value


def test_too_many_fragments_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"diloco\.num_fragments"):
        plan_fragments({"a": 1, "b": 2}, 3)
    with pytest.raises(ValueError, match=r"diloco\.num_fragments"):
        plan_fragments({"a": 1}, 0)


def test_unknown_embedding_path_rejected() -> None:
    with pytest.raises(ValueError, match="not parameter leaves"):
        plan_fragments({"a": 1, "b": 2}, 1, ["embed"])


def test_fragment_of_unknown_path() -> None:
    plan = plan_fragments({"a": 1}, 1)
    with pytest.raises(KeyError, match="'x'"):
        plan.fragment_of("x")


def test_plan_rejects_overlapping_fragments() -> None:
    with pytest.raises(ValueError, match="in fragments 0 and 1"):
        FragmentPlan((("a",), ("a",)), (1, 1), frozenset())


def test_offsets() -> None:
    assert [fragment_offset(p, 24, 24) for p in range(24)] == list(range(24))
    assert [fragment_offset(p, 10, 4) for p in range(4)] == [0, 2, 5, 7]
    assert fragment_offset(0, 7, 1) == 0


def test_p_equals_h_one_fragment_per_step() -> None:
    h = 24
    window = [due_fragments(t, h, h) for t in range(1, h + 1)]
    assert all(len(due) == 1 for due in window)
    assert sorted(due[0] for due in window) == list(range(h))
    # Periodic: the next window repeats the same sequence.
    assert window == [due_fragments(t, h, h) for t in range(h + 1, 2 * h + 1)]


def test_p_equals_one_syncs_every_h_steps() -> None:
    h = 5
    due_steps = [t for t in range(1, 31) if due_fragments(t, h, 1)]
    assert due_steps == [5, 10, 15, 20, 25, 30]
    assert due_fragments(10, h, 1) == [0]


@pytest.mark.parametrize(("h", "p"), [(10, 4), (24, 6), (7, 7), (9, 2)])
def test_every_fragment_due_once_per_window(h: int, p: int) -> None:
    for start in (1, 3 * h + 2):
        counts = np.zeros(p, dtype=int)
        for t in range(start, start + h):
            for q in due_fragments(t, h, p):
                counts[q] += 1
        assert counts.tolist() == [1] * p


def test_due_fragments_rejects_step_zero() -> None:
    with pytest.raises(ValueError, match="completed inner steps"):
        due_fragments(0, 4, 2)


def test_slice_fragment() -> None:
    params = {"a": np.zeros(3), "b": np.ones(2), "c": np.full(4, 2.0)}
    plan = plan_fragments({"a": 3, "b": 2, "c": 4}, 2)
    assert plan.fragments == (("c",), ("a", "b"))
    part = slice_fragment(params, plan, 1)
    assert list(part) == ["a", "b"]
    assert part["a"] is params["a"]
    with pytest.raises(KeyError, match="lack leaves"):
        slice_fragment({"a": 1}, plan, 1)
    with pytest.raises(ValueError, match="out of range"):
        slice_fragment(params, plan, 2)
