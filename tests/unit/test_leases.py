"""Data leases (algorithm/leases.py, LeaseReader in algorithm/lease_reader.py): any number of
learners over time read every token once, across joins, leaves, restarts and restores."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_diloco.algorithm.lease_reader import DataStarved, LeaseReader
from ray_diloco.algorithm.leases import DataPool, Lease
from ray_diloco.tasks.windows import TokenWindows


def test_configured_learners_read_their_own_part_contiguously() -> None:
    pool = DataPool(num_parts=2, lease_tokens=100)
    a, _ = pool.join("a", home=0)
    b, _ = pool.join("b", home=1)
    assert a == [Lease(0, 0, 200)] and b == [Lease(1, 0, 200)]  # two leases ahead, merged
    # topped up to two leases ahead again, from its own part
    assert pool.advance("a", 150) == [Lease(0, 200, 300), Lease(0, 300, 400)]
    assert pool.advance("a", 150) == []
    assert list(pool.holders["a"].leases) == [Lease(0, 0, 400)]  # one contiguous stream
    assert pool.check() == []


def test_a_joiner_takes_the_least_advanced_part_and_a_leaver_gives_back_its_rest() -> None:
    pool = DataPool(num_parts=2, lease_tokens=100)
    pool.join("a", home=0)
    pool.join("b", home=1)
    pool.advance("a", 200)  # part 0 is ahead (frontier 400 vs 200)
    c, offset = pool.join("c")
    assert c == [Lease(1, 200, 400)] and offset == 0
    back = pool.leave("b")  # b read nothing: both its leases go back
    assert back == [Lease(1, 0, 200)]
    assert pool.advance("c", 200) == [Lease(1, 0, 100), Lease(1, 100, 200)]  # given back first
    assert pool.check() == []


def test_a_restarted_learner_resumes_its_own_leases_at_its_cursor() -> None:
    pool = DataPool(num_parts=1, lease_tokens=100)
    pool.join("a", home=0)
    pool.advance("a", 130)
    leases, offset = pool.join("a", home=0)  # the next incarnation
    assert leases == [Lease(0, 0, 400)] and offset == 130
    assert pool.cursor("a") == 130 and pool.check() == []


def test_a_restore_never_hands_out_what_learners_hold_since_the_checkpoint() -> None:
    pool = DataPool(num_parts=1, lease_tokens=100)
    pool.join("a", home=0)
    saved = pool.state_dict()
    pool.advance("a", 150)  # a gets more leases after the checkpoint
    pool.advance("a", 250)
    held, offset = list(pool.holders["a"].leases), 250 - pool.holders["a"].base
    restored = DataPool(num_parts=1, lease_tokens=100)
    restored.load_state_dict(saved)
    restored.restore_mark(pool.frontier, list(pool.holders))  # the persisted mark
    restored.reclaim("a", held, offset, 250)
    restored.join("a")
    new, _ = restored.join("b")
    assert new[0].start >= pool.frontier[0]
    assert restored.check() == []


def test_ranges_leased_after_the_checkpoint_to_learners_that_died_are_read_again() -> None:
    """The whole run died: nobody reclaims what was leased after the checkpoint. Those ranges
    wait until every learner of the mark registered again, then go out first."""
    pool = DataPool(num_parts=2, lease_tokens=100)
    pool.join("a", home=0)
    pool.join("b", home=1)
    saved = pool.state_dict()
    pool.advance("a", 180)  # a leases [200, 400) of part 0 after the checkpoint
    restored = DataPool(num_parts=2, lease_tokens=100)
    restored.load_state_dict(saved)
    restored.restore_mark(pool.frontier, list(pool.holders))
    assert restored.doubtful == [Lease(0, 200, 400)] and restored.check() == []
    restored.join("a", home=0)  # restarted from the checkpoint: it holds [0, 200) again
    assert restored.doubtful and not restored.returned  # b may still hold them
    restored.join("b", home=1)
    assert not restored.doubtful and restored.returned == [Lease(0, 200, 400)]
    restored.advance("a", 150)
    assert list(restored.holders["a"].leases) == [Lease(0, 0, 400)]  # read again, not skipped
    assert restored.frontier[0] == 400 and not restored.returned
    assert restored.check() == []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("jarlsc"), st.integers(0, 4), st.integers(0, 250))))
def test_no_token_read_twice_and_none_lost_whatever_happens(ops) -> None:  # type: ignore[no-untyped-def]
    """Random joins (j), advances (a), restarts (r), leaves (l), save/restores (s) and
    checkpoints or synchronizer deaths (c; some learners survive it, the others restart) of five
    learners: the books always balance, and every learner's leases continue where it is."""
    pool = DataPool(num_parts=3, lease_tokens=64)
    saved = pool.state_dict()
    names = [f"n{i}" for i in range(5)]
    for op, who, amount in ops:
        name = names[who]
        known = name in pool.holders
        if op == "j" and not known:
            pool.join(name, home=who if who < 3 else None)
        elif op == "a" and known:
            holder = pool.holders[name]
            ahead = holder.base + sum(x.size for x in holder.leases) - holder.cursor
            pool.advance(name, holder.cursor + min(amount, ahead))
        elif op == "r" and known:
            leases, offset = pool.join(name)
            assert offset == pool.cursor(name) - pool.holders[name].base
            assert leases[0].start + offset <= leases[0].end
        elif op == "l" and known:
            pool.leave(name)
        elif op == "s":
            state = pool.state_dict()
            pool = DataPool(num_parts=3, lease_tokens=64)
            pool.load_state_dict(state)
        elif op == "c":  # a checkpoint, or the synchronizer dies and restores the last one
            saved = saved if amount % 3 else pool.state_dict()
            if amount % 3:
                restored = DataPool(num_parts=3, lease_tokens=64)
                restored.load_state_dict(saved)
                restored.restore_mark(pool.frontier, list(pool.holders))
                for i, (learner, holder) in enumerate(pool.holders.items()):
                    if (amount + i) % 2:  # it kept training and states what it holds
                        offset = holder.cursor - holder.base
                        restored.reclaim(learner, list(holder.leases), offset, holder.cursor)
                    restored.join(learner)  # survivors and restarted learners register
                assert not restored.doubtful, "every learner registered: nothing in doubt"
                pool = restored
        assert pool.check() == [], (op, name)


def test_reader_batches_across_leases_are_the_data_of_each_piece() -> None:
    stream = np.arange(10_000, dtype=np.uint16) % 251
    data = TokenWindows(lambda: (stream, stream), seq_len=4, eval_batches=1, eval_batch_size=2)
    # contiguous leases read as one stream: the batches a fixed part gives
    whole = LeaseReader(data, 2, 3, [Lease(1, 0, 24), Lease(1, 24, 48)], 0)
    fixed = data.batches(1, 2, 0, 3)
    for _ in range(4):
        (x, _), n = whole.next()
        (fx, _), _ = next(fixed)
        np.testing.assert_array_equal(x, fx)
    # a batch of 3 split over two leases of different parts: 2 examples, then 1
    split = LeaseReader(data, 2, 3, [Lease(0, 40, 48), Lease(1, 8, 100)], 0)
    (x, _), n = split.next()
    (a, _), _ = next(data.batches(0, 2, 40, 2))
    (b, _), _ = next(data.batches(1, 2, 8, 1))
    np.testing.assert_array_equal(x, np.concatenate([a, b]))
    assert n == 12 and split.ahead() == 100 - 8 - 4
    with pytest.raises(DataStarved):
        for _ in itertools.count():
            split.next()
