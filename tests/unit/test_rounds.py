"""The round state machine (docs/algorithm.md sections 5 and 7) on a hand-driven clock."""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ray_diloco.algorithm.round_types import ContributionMeta, RoundPolicy, Verdict
from ray_diloco.algorithm.rounds import RoundBook
from ray_diloco.config import DilocoConfig, SynchronizerConfig


def policy(**kw) -> RoundPolicy:
    base = dict(
        quorum_min=1,
        grace_fraction=0.5,
        grace_max_s=10.0,
        overlap_steps=2,
        late_policy="next_round",
        max_staleness_versions=2,
        norm_guard=10.0,
        norm_guard_warmup_rounds=3,
        heartbeat_timeout_s=5.0,
        step_time_ema=1.0,
    )
    base.update(kw)
    return RoundPolicy(**base)


def meta(learner, fragment=0, base=0, steps=4, tokens=400, inc=0, step=None) -> ContributionMeta:
    """`step`: the learner's inner step at the offer (default: `steps`, its first offer)."""
    return ContributionMeta(
        learner, inc, fragment, base, steps if step is None else step, steps, tokens
    )


def book_with(names, pol, step_time=1.0, num_fragments=1) -> RoundBook:
    book = RoundBook(pol, num_fragments=num_fragments)
    for n in names:
        book.register(n, 0, now=0.0)
        book.heartbeat(n, 0, now=0.0, step_time_s=step_time)
    return book


def merge_rounds(book: RoundBook, learner: str, steps: int, update_norm: float) -> None:
    """Four rounds of `learner` alone, each `steps` steps with this update norm, all merged."""
    for version in range(4):
        m = meta(learner, base=version, steps=steps, step=steps * (version + 1))
        assert book.offer(m, now=0, update_norm=update_norm) is Verdict.ACCEPTED
        (close,) = book.poll(now=20.0)
        book.commit(close, sync_time_s=0.0, now=20.0)


def test_grace_window_is_spent_slack_and_closes_on_expiry():
    # tau=2, slowest step 1 s, no sync time yet: quorum (K=1) reached at t=0.1 after the round
    # opened at t=0.1 -> slack = 2*1 - (0 + 0) = 2, grace = 0.5*2 = 1.0 s.
    book = book_with(["a", "b", "c"], policy())
    assert book.offer(meta("a"), now=0.1) is Verdict.ACCEPTED
    assert book.poll(now=1.0) == []
    assert book.next_deadline() == pytest.approx(1.1)
    (close,) = book.poll(now=1.1)
    assert close.grace_s == pytest.approx(1.0)
    assert [c.meta.learner for c in close.contributions] == ["a"]
    assert book.commit(close, sync_time_s=0.0, now=1.2) == []  # nothing dropped as late
    assert book.versions() == {0: 1}


def test_grace_window_is_timed_by_the_slowest_live_learner():
    # The window waits for the slowest learner's next offer: tau=2 of its 3 s steps, not of
    # the fast one's 1 s (slack 6, grace 3.0 where the fastest's step would give 1.0).
    book = book_with(["a", "b"], policy())
    book.heartbeat("b", 0, now=0.0, step_time_s=3.0)
    book.offer(meta("a"), now=0.0)
    assert book.slowest_step_time(now=0.0) == 3.0
    assert book.poll(now=2.9) == []
    (close,) = book.poll(now=3.0)
    assert close.grace_s == pytest.approx(3.0)


def test_round_closes_early_when_every_live_learner_is_in():
    book = book_with(["a", "b"], policy())
    book.offer(meta("a"), now=0.0)
    assert book.poll(now=0.2) == []
    book.offer(meta("b"), now=0.3)
    (close,) = book.poll(now=0.3)
    assert close.closed_s == 0.3 and len(close.contributions) == 2


def test_quorum_wait_and_sync_time_eat_the_slack():
    # K=2: opened at 0, quorum at 0.6 -> slack = 2*1 - (0.6 + 0.4) = 1.0 -> grace 0.5
    book = book_with(["a", "b", "c"], policy(quorum_min=2))
    book.sync_time_s = 0.4
    book.offer(meta("a"), now=0.0)
    assert book.poll(now=0.5) == []  # below quorum, however long it waits
    book.offer(meta("b"), now=0.6)
    assert book.poll(now=1.0) == []
    (close,) = book.poll(now=1.1)
    assert close.grace_s == pytest.approx(0.5)


def test_grace_is_capped_and_never_negative():
    book = book_with(["a", "b"], policy(grace_max_s=0.25), step_time=100.0)
    book.offer(meta("a"), now=0.0)
    assert book.poll(now=0.24) == []
    assert len(book.poll(now=0.25)) == 1
    slow_quorum = book_with(["a", "b", "c"], policy(quorum_min=2), step_time=0.1)
    slow_quorum.offer(meta("a"), now=0.0)
    slow_quorum.offer(meta("b"), now=3.0)  # slack = 0.2 - 3.0 < 0
    assert len(slow_quorum.poll(now=3.0)) == 1


@pytest.mark.parametrize("mode", ["decoupled", "synchronous"])
def test_k_is_never_above_the_live_learners_in_decoupled_mode(mode: str) -> None:
    # K = 2 of two learners; b dies (it stays in the run until a restart registers). A
    # decoupled round goes on with a alone once b's reports are older than the heartbeat
    # timeout; a synchronous round is a barrier and waits for b.
    pol = policy(quorum_min=2, everyone=mode == "synchronous", grace_max_s=0.0)
    book = RoundBook(pol, num_fragments=1, roster={"a", "b"})
    for n in ("a", "b"):
        book.register(n, 0, now=0.0)
    book.offer(meta("a"), now=1.0)
    book.heartbeat("a", 0, now=6.0, step_time_s=1.0)
    assert book.poll(now=4.0) == []  # b still live: K = 2
    closes = book.poll(now=6.0)  # b silent for more than heartbeat_timeout_s
    assert len(closes) == (1 if mode == "decoupled" else 0)
    assert book.quorum(now=6.0) == (1 if mode == "decoupled" else 2)
    book.register("b", 1, now=7.0)  # b's restart: it counts again
    assert book.quorum(now=7.0) == 2


def test_dead_learner_stops_counting_as_live():
    book = book_with(["a", "b"], policy(grace_max_s=100.0, grace_fraction=0.9), step_time=100.0)
    book.offer(meta("a"), now=1.0)
    book.heartbeat("a", 0, now=6.0, step_time_s=None)
    assert book.poll(now=4.0) == []  # b still live: wait out the grace window
    assert book.live(now=6.0) == {"a"}  # b silent for > heartbeat_timeout_s
    assert len(book.poll(now=6.0)) == 1


def test_synchronous_mode_is_a_barrier():
    pol = RoundPolicy.from_config(
        DilocoConfig(mode="synchronous", quorum_min=1), SynchronizerConfig(), num_learners=3
    )
    assert (pol.quorum_min, pol.grace_max_s) == (3, 0.0)
    book = book_with(["a", "b", "c"], pol)
    book.offer(meta("a"), now=0.0)
    book.offer(meta("b"), now=0.0)
    assert book.poll(now=1000.0) == []  # a barrier waits for everyone, dead or alive
    book.offer(meta("c"), now=1000.0)
    assert len(book.poll(now=1000.0)[0].contributions) == 3


def test_late_contribution_joins_the_next_round_with_staleness():
    book = book_with(["a", "b"], policy(grace_max_s=0.0))
    book.offer(meta("a"), now=0.0)
    (close,) = book.poll(now=0.0)
    book.offer(meta("b", base=0), now=0.1)  # arrives while round 0 is merging
    book.commit(close, sync_time_s=0.0, now=0.2)
    (close2,) = book.poll(now=0.2)
    assert [c.meta.learner for c in close2.contributions] == ["b"]
    assert close2.staleness == (1,) and close2.version == 2


def test_drop_policy_discards_late_contributions():
    book = book_with(["a", "b"], policy(grace_max_s=0.0, late_policy="drop"))
    book.offer(meta("a"), now=0.0)
    (close,) = book.poll(now=0.0)
    book.offer(meta("b", base=0), now=0.1)
    (late,) = book.commit(close, sync_time_s=0.0, now=0.2)
    assert late.meta.learner == "b"  # returned, so the caller counts it as refused
    assert book.poll(now=0.3) == []
    assert book.fragments[0].pending == {}


def test_replacement_keeps_tokens_exactly_once():
    book = book_with(["a", "b"], policy(quorum_min=2, max_staleness_versions=5))
    # same base: the newer counters already include the older entry's work
    book.offer(meta("a", steps=4, tokens=400), now=0.0)
    book.offer(meta("a", steps=8, tokens=800), now=1.0)
    assert book.fragments[0].pending["a"].num_tokens == 800
    # newer base: the learner's counters restarted, so the older entry's work is added
    book.fragments[0].version = 1
    book.offer(meta("a", base=1, steps=2, tokens=200, step=10), now=2.0)
    assert book.fragments[0].pending["a"].num_tokens == 1000
    assert book.fragments[0].pending["a"].num_steps == 10


def test_replacement_on_the_same_base_keeps_work_carried_from_an_older_base():
    # The other order: an entry on base 0 absorbed into an offer on base 1 must survive a
    # third offer on base 1 replacing that one (its counters start at base 1).
    book = book_with(["a", "b"], policy(quorum_min=2, max_staleness_versions=5))
    book.offer(meta("a", steps=4, tokens=400), now=0.0)
    book.fragments[0].version = 1
    book.offer(meta("a", base=1, steps=2, tokens=200, step=6), now=1.0)
    book.offer(meta("a", base=1, steps=6, tokens=600, step=10), now=2.0)
    entry = book.fragments[0].pending["a"]
    assert (entry.num_steps, entry.num_tokens) == (10, 1000)
    # and through a round that merged it and aborted while a newer offer on base 1 came
    book = book_with(["a"], policy(grace_max_s=0.0, max_staleness_versions=5))
    book.offer(meta("a", steps=4, tokens=400), now=0.0)
    book.fragments[0].version = 1
    book.offer(meta("a", base=1, steps=2, tokens=200, step=6), now=1.0)
    (close,) = book.poll(now=1.0)
    book.offer(meta("a", base=1, steps=7, tokens=700, step=11), now=2.0)
    book.abort(close, now=2.5)
    assert book.fragments[0].pending["a"].num_tokens == 1100
    book.offer(meta("a", base=1, steps=8, tokens=800, step=12), now=3.0)
    entry = book.fragments[0].pending["a"]
    assert (entry.num_steps, entry.num_tokens) == (12, 1200)


_EVENTS = st.lists(
    st.one_of(
        st.tuples(st.just("offer"), st.integers(1, 5)),  # train n steps, then offer
        st.sampled_from([("adopt", 0), ("poll", 0), ("commit", 0), ("abort", 0)]),
    ),
    max_size=30,
)


@settings(max_examples=400, deadline=None)
@given(_EVENTS)
@example(  # the order that lost tokens: base 0 pending, absorbed at base 1, replaced
    [
        ("offer", 4),
        ("poll", 0),
        ("offer", 2),
        ("commit", 0),
        ("adopt", 0),
        ("offer", 2),
        ("offer", 4),
    ]
)
def test_every_offered_token_is_merged_or_pending_exactly_once(events) -> None:
    """Any order of offers, adoptions of new versions and rounds that commit or abort: the
    tokens merged plus the tokens pending are, for each base the learner held, the counters of
    its last offer on that base (what it trained and offered), never more or less."""
    book = book_with(["a"], policy(grace_max_s=0.0, max_staleness_versions=1000))
    base, since_base, step = 0, 0, 0
    last_offer: dict[int, int] = {}
    merged, merging = 0, None
    for t, (kind, n) in enumerate(events):
        now = float(t)
        if kind == "offer":
            since_base += n
            step += n
            m = meta("a", base=base, steps=since_base, tokens=100 * since_base, step=step)
            assert book.offer(m, now=now) is Verdict.ACCEPTED
            last_offer[base] = since_base
        elif kind == "adopt" and base < book.fragments[0].version:
            base, since_base = book.fragments[0].version, 0
        elif kind == "poll" and merging is None:
            merging = next(iter(book.poll(now=now)), None)
        elif kind == "commit" and merging is not None:
            merged += merging.num_tokens
            book.commit(merging, sync_time_s=0.0, now=now)
            merging = None
        elif kind == "abort" and merging is not None:
            book.abort(merging, now=now)
            merging = None
    if merging is not None:
        book.abort(merging, now=float(len(events)))
    pending = sum(e.num_tokens for e in book.fragments[0].pending.values())
    assert merged + pending == 100 * sum(last_offer.values())


def test_fencing_rejects_old_incarnations_and_stale_versions():
    book = book_with(["a"], policy(max_staleness_versions=2))
    book.register("a", 1, now=0.0)
    assert book.offer(meta("a", inc=0), now=0.0) is Verdict.OLD_INCARNATION
    assert book.offer(meta("zz"), now=0.0) is Verdict.UNKNOWN_LEARNER
    book.fragments[0].version = 3
    assert book.offer(meta("a", base=0, inc=1), now=0.0) is Verdict.STALE_VERSION
    assert book.offer(meta("a", base=4, inc=1), now=0.0) is Verdict.FUTURE_VERSION
    # a NaN is reported as one however stale: the learner's state may be corrupt
    assert book.offer(meta("a", base=0, inc=1), now=0.0, finite=False) is Verdict.NON_FINITE
    assert book.offer(meta("a", base=1, inc=1), now=0.0) is Verdict.ACCEPTED
    with pytest.raises(ValueError, match="incarnation 0 is older"):
        book.register("a", 0, now=0.0)
    assert not book.heartbeat("a", 0, now=1.0, step_time_s=1.0)


def test_numerical_guards():
    book = book_with(["a"], policy(norm_guard=10.0, norm_guard_warmup_rounds=3))
    assert book.offer(meta("a"), now=0, finite=False) is Verdict.NON_FINITE
    assert book.offer(meta("a"), now=0, update_norm=float("nan")) is Verdict.NON_FINITE
    # before the warm-up (3 closed rounds) any norm passes; afterwards 10x the median of the
    # per-step norms (update norm / steps) is rejected
    for version, n in enumerate((4.0, 8.0, 200.0)):  # per step: 1, 2, 50
        m = meta("a", base=version, step=4 * (version + 1))
        assert book.offer(m, now=0, update_norm=n) is Verdict.ACCEPTED
        (close,) = book.poll(now=20.0)
        book.commit(close, sync_time_s=0.0, now=20.0)
    assert book.offer(meta("a", base=3, step=16), now=0, update_norm=4e6) is Verdict.NORM_OUTLIER
    assert book.offer(meta("a", base=3, step=16), now=0, update_norm=79.6) is Verdict.ACCEPTED
    assert book.offer(meta("a", base=3, steps=0, step=20), now=0) is Verdict.EMPTY


def test_norm_guard_judges_the_update_per_step():
    # A long contribution has a longer update by construction: 100 steps of the usual
    # per-step size pass; a 1e4x corrupted short one does not.
    book = book_with(["a"], policy(norm_guard_warmup_rounds=1, max_staleness_versions=50))
    merge_rounds(book, "a", steps=5, update_norm=5.0)  # 1 per step
    long = meta("a", base=4, steps=100, step=120)
    assert book.offer(long, now=0, update_norm=100.0 * 5) is Verdict.ACCEPTED  # 5 per step
    huge = meta("a", base=4, steps=2, step=122)
    assert book.offer(huge, now=0, update_norm=2e4) is Verdict.NORM_OUTLIER


def test_norm_guard_arms_after_the_inner_warmup():
    # Updates during the inner learning-rate warm-up are small and neither judged nor kept:
    # the first full-rate update is not refused against them.
    pol = policy(norm_guard_warmup_rounds=1, inner_warmup_steps=20, max_staleness_versions=50)
    book = book_with(["a"], pol)
    merge_rounds(book, "a", steps=4, update_norm=0.04)  # steps 1..16: inside the warm-up
    assert list(book.fragments[0].norms.everyone) == []
    straddles = meta("a", base=4, steps=8, step=24)  # steps 17..24: partly in the warm-up
    assert book.offer(straddles, now=0, update_norm=80.0) is Verdict.ACCEPTED
    after = meta("a", base=4, steps=4, step=28)  # steps 25..28, history still empty
    assert book.offer(after, now=0, update_norm=40.0) is Verdict.ACCEPTED
    assert list(book.fragments[0].norms.everyone) == [10.0]
    corrupt = meta("a", base=4, steps=4, step=32)
    assert book.offer(corrupt, now=0, update_norm=40.0 * 1e3) is Verdict.NORM_OUTLIER


def test_norm_guard_judges_a_learner_against_its_own_history():
    # A learner whose Adam moments have settled steps little; one that joined late (fresh
    # moments) steps many times farther. Against the fragment's median the latecomer's every
    # offer was refused (the custom task on Ray); each is judged against its own history now,
    # and a newcomer, until it has 3 norms of its own, against the others' with the guard
    # squared, which still refuses a corrupted update.
    book = book_with(["a"], policy(norm_guard_warmup_rounds=1, max_staleness_versions=50))
    merge_rounds(book, "a", steps=4, update_norm=0.4)  # 0.1 per step
    book.register("late", 0, now=0.0)
    for i in range(3):  # 30x a's steps: within 10^2 of a's median
        m = meta("late", base=4, steps=4, step=4 * (i + 1))
        assert book.offer(m, now=0, update_norm=12.0) is Verdict.ACCEPTED
    assert book.offer(meta("late", base=4, steps=4, step=16), now=0, update_norm=1.2e5) is (
        Verdict.NORM_OUTLIER
    )
    assert book.offer(meta("late", base=4, steps=4, step=20), now=0, update_norm=16.0) is (
        Verdict.ACCEPTED
    )
    # a at 20x its own steps is refused, though the fragment's median (now the latecomer's
    # 3 per step) would pass it
    assert book.offer(meta("a", base=4, steps=4, step=20), now=0, update_norm=8.0) is (
        Verdict.NORM_OUTLIER
    )
    # a synchronizer restart keeps every learner's history (as JSON in the checkpoint)
    restored = RoundBook(book.policy, num_fragments=1)
    restored.load_state_dict(json.loads(json.dumps(book.state_dict())), now=0.0)
    assert restored.fragments[0].norms.own == book.fragments[0].norms.own
    assert list(restored.fragments[0].norms.own["late"]) == [3.0, 3.0, 3.0, 4.0]
    # a restarted learner has fresh moments again: its history starts over
    book.register("late", 1, now=0.0)
    assert "late" not in book.fragments[0].norms.own


def test_norm_guard_warm_up_counts_rounds_not_contributions():
    # Four learners fill the norm history in one round; round 2's norms are still far larger
    # (the inner learning rate warms up). Before the warm-up is over, all of them are accepted.
    book = book_with(["a", "b", "c", "d"], policy(norm_guard_warmup_rounds=2))
    for n in "abcd":
        assert book.offer(meta(n), now=0, update_norm=0.01) is Verdict.ACCEPTED
    (close,) = book.poll(now=0.0)
    book.commit(close, sync_time_s=0.0, now=0.0)
    for n in "abcd":
        assert book.offer(meta(n, base=1, step=8), now=0, update_norm=1.0) is Verdict.ACCEPTED


def test_offer_no_newer_than_a_pending_one_is_a_replay():
    book = book_with(["a", "b"], policy(quorum_min=2))
    assert book.offer(meta("a", steps=8, tokens=800), now=0.0) is Verdict.ACCEPTED
    # an older offer arriving after a newer one (reordered) would replace it and lose work
    assert book.offer(meta("a", steps=4, tokens=400), now=0.1) is Verdict.REPLAYED
    assert book.fragments[0].pending["a"].num_tokens == 800


def test_implausible_counters_are_refused():
    book = RoundBook(policy(), num_fragments=1)
    book.register("a", 0, now=0.0, tokens_per_step=100)
    book.register("b", 0, now=0.0)  # its batch unknown: only its steps are checked
    # more steps since the base than the learner took in all
    assert book.offer(meta("a", steps=4, step=3), now=0.0) is Verdict.IMPLAUSIBLE
    assert book.offer(meta("b", steps=4, step=3), now=0.0) is Verdict.IMPLAUSIBLE
    # more tokens than 4 steps of 100 tokens can read
    assert book.offer(meta("a", steps=4, tokens=401), now=0.0) is Verdict.IMPLAUSIBLE
    assert book.offer(meta("b", steps=4, tokens=10**12), now=0.0) is Verdict.ACCEPTED
    assert book.offer(meta("a", steps=4, tokens=400), now=0.0) is Verdict.ACCEPTED
    # more work than the run's budget and the step that crosses it: tokens, or steps of a
    # known batch (b's is unknown: no step is allowed for)
    book = RoundBook(policy(max_tokens=10_000), num_fragments=1)
    book.register("a", 0, now=0.0, tokens_per_step=100)
    book.register("b", 0, now=0.0)
    assert book.offer(meta("b", steps=4, tokens=10_001), now=0.0) is Verdict.IMPLAUSIBLE
    assert book.offer(meta("a", steps=102, tokens=400), now=0.0) is Verdict.IMPLAUSIBLE
    assert book.offer(meta("a", steps=101, tokens=10_100), now=0.0) is Verdict.ACCEPTED


def test_replayed_contribution_is_refused():
    book = book_with(["a"], policy(grace_max_s=0.0, max_staleness_versions=5))
    first = meta("a", steps=4, tokens=400, step=4)
    assert book.offer(first, now=0.0) is Verdict.ACCEPTED
    (close,) = book.poll(now=0.0)
    book.commit(close, sync_time_s=0.0, now=0.0)
    assert book.offer(meta("a", base=1, steps=2, step=6), now=0.1) is Verdict.ACCEPTED
    (close,) = book.poll(now=0.1)
    book.commit(close, sync_time_s=0.0, now=0.1)
    # the first offer again (its base is old but within the staleness bound): a replay
    assert book.offer(first, now=0.2) is Verdict.REPLAYED
    assert book.fragments[0].pending == {}


def test_new_incarnation_keeps_the_old_pending_entry_apart():
    # The old process is fenced (its later offers are refused), but what it offered before is
    # accepted work and merges with its round. Its counters do not pass into the new
    # incarnation's entry, whose payload does not hold that work.
    book = book_with(["a", "b"], policy(quorum_min=2, max_staleness_versions=5, grace_max_s=0))
    old = meta("a", steps=4, tokens=400)
    book.offer(old, now=0.0)
    assert book.register("a", 1, now=1.0) == {0: 0}
    assert "a" not in book.fragments[0].pending and book.fragments[0].opened_s == 0.0
    assert book.offer(meta("a", steps=8, step=9), now=1.1) is Verdict.OLD_INCARNATION
    book.register("a", 1, now=1.5)  # the same incarnation again: nothing changes
    assert book.offer(meta("a", steps=2, tokens=200, inc=1), now=2.0) is Verdict.ACCEPTED
    entry = book.fragments[0].pending["a"]
    assert (entry.meta.incarnation, entry.num_steps, entry.num_tokens) == (1, 2, 200)
    # "a" counts once toward K = 2: the round waits for b
    assert book.poll(now=3.0) == []
    book.offer(meta("b"), now=3.0)
    (close,) = book.poll(now=3.0)
    got = [(c.meta.learner, c.meta.incarnation, c.num_tokens) for c in close.contributions]
    assert sorted(got) == [("a", 0, 400), ("a", 1, 200), ("b", 0, 400)]
    book.commit(close, sync_time_s=0.0, now=3.0)
    # only the live incarnation's counters are remembered against a replay
    assert book.fragments[0].merged["a"] == (0, 2, 200)
    assert book.fragments[0].kept == []


def test_a_leave_lets_a_round_of_kept_work_reach_its_quorum_at_once():
    book = RoundBook(policy(quorum_min=2), num_fragments=1, roster={"a", "b"})
    for n in ("a", "b"):
        book.register(n, 0, now=0.0)
    book.offer(meta("a"), now=0.5)
    book.register("a", 1, now=1.0)  # a's entry is kept apart; the round waits for b
    assert book.fragments[0].quorum_s is None
    book.leave("b", now=2.0)  # K falls to the one learner left
    assert book.fragments[0].quorum_s == 2.0


def test_a_learner_that_left_is_neither_live_nor_in_the_run():
    book = RoundBook(policy(quorum_min=3), num_fragments=1, roster={"a", "b", "c"})
    for n in ("a", "b", "c"):
        book.register(n, 0, now=0.0)
    assert book.quorum(now=0.0) == 3
    book.leave("c", now=1.0)
    assert book.live(now=1.0) == {"a", "b"}  # at once, not a heartbeat timeout later
    assert book.roster == {"a", "b"} and book.quorum(now=1.0) == 2
    # its reports no longer count, and a round of the two left closes without waiting for it
    assert not book.heartbeat("c", 0, now=1.5, step_time_s=1.0)
    book.offer(meta("a"), now=2.0)
    book.offer(meta("b"), now=2.0)
    (close,) = book.poll(now=2.0)
    assert close.learners == 2


def test_the_norm_guard_is_not_armed_before_its_warm_up_rounds():
    book = book_with(["a"], policy(norm_guard_warmup_rounds=3, grace_max_s=0.0))
    assert book.offer(meta("a", steps=4, step=4), now=0.0, update_norm=1.0) is Verdict.ACCEPTED
    (close,) = book.poll(now=0.0)
    book.commit(close, sync_time_s=0.0, now=0.0)  # one round of three: not armed yet
    huge = meta("a", base=1, steps=4, step=8)
    assert book.offer(huge, now=1.0, update_norm=1e6) is Verdict.ACCEPTED


def test_next_deadline_skips_fragments_without_a_quorum():
    book = book_with(["a", "b"], policy(), num_fragments=3)
    assert book.next_deadline() is None
    book.offer(meta("a", fragment=1), now=0.5)  # grace 0.5 x 2 x 1 s = 1.0
    assert book.next_deadline() == pytest.approx(1.5)


def test_a_restart_during_a_merge_that_fails_keeps_the_old_work_apart():
    book = book_with(["a"], policy(grace_max_s=0.0))
    book.offer(meta("a", steps=4, tokens=400), now=0.0)
    (close,) = book.poll(now=0.0)
    book.register("a", 1, now=0.1)
    book.abort(close, now=0.2)
    assert book.fragments[0].pending == {}
    (again,) = book.poll(now=0.2)  # a counts as in through its kept entry
    assert [(c.meta.incarnation, c.num_tokens) for c in again.contributions] == [(0, 400)]


def test_offer_again_on_the_same_base_counts_only_new_work():
    # A learner offers p on base 0, its round merges, and it offers p again before version 1
    # reached it: its counters (since base 0) still include the merged work.
    book = book_with(["a"], policy(grace_max_s=0.0))
    book.offer(meta("a", steps=4, tokens=400), now=0.0)
    (first,) = book.poll(now=0.0)
    assert book.offer(meta("a", steps=6, tokens=600), now=0.1) is Verdict.ACCEPTED
    book.commit(first, sync_time_s=0.0, now=0.1)
    (second,) = book.poll(now=0.2)
    (c,) = second.contributions
    assert (c.num_steps, c.num_tokens) == (2, 200)
    book.commit(second, sync_time_s=0.0, now=0.2)
    # the same offer again is a replay of merged work
    assert book.offer(meta("a", steps=6, tokens=600), now=0.3) is Verdict.REPLAYED
    assert book.offer(meta("a", steps=6, tokens=600, step=7), now=0.3) is Verdict.EMPTY
    # on the new base the counters start afresh; a new incarnation forgets the old record
    m = meta("a", base=2, steps=1, tokens=100, step=8)
    assert book.offer(m, now=0.3) is Verdict.ACCEPTED
    book.register("a", 1, now=0.4)
    assert book.offer(meta("a", base=2, steps=1, tokens=100, inc=1), now=0.4) is Verdict.ACCEPTED


def test_abort_gives_back_work_counted_as_merged():
    book = book_with(["a"], policy(grace_max_s=0.0))
    book.offer(meta("a", steps=4, tokens=400), now=0.0)
    (close,) = book.poll(now=0.0)
    book.offer(meta("a", steps=6, tokens=600), now=0.1)  # counted as 2 new steps
    book.abort(close, now=0.2)
    (again,) = book.poll(now=0.2)
    (c,) = again.contributions
    assert (c.num_steps, c.num_tokens) == (6, 600)


def test_abort_returns_contributions_and_state_round_trips():
    book = book_with(["a", "b"], policy(grace_max_s=0.0), num_fragments=2)
    book.offer(meta("a", fragment=1), now=0.0)
    (close,) = book.poll(now=0.0)
    book.abort(close, now=0.1)
    (again,) = book.poll(now=0.1)
    assert again.contributions == close.contributions
    book.commit(again, sync_time_s=0.2, now=0.3)
    restored = RoundBook(book.policy, num_fragments=2)
    restored.load_state_dict(book.state_dict(), now=5.0)
    assert restored.versions() == {0: 0, 1: 1}
    assert restored.live(now=5.0) == set()  # must re-register after a restart
    restored.register("a", 0, now=5.0)
    assert restored.live(now=5.0) == {"a"}


def test_the_roster_survives_a_restart_and_a_checkpoint_must_match_the_fragments():
    book = RoundBook(policy(quorum_min=2), num_fragments=1, roster={"a", "b", "c"})
    for n in ("a", "b", "c"):
        book.register(n, 0, now=0.0)
    book.leave("c", now=1.0)
    state = json.loads(json.dumps(book.state_dict()))
    # the restarted synchronizer starts from the job's learners; the checkpoint knows c left
    restored = RoundBook(book.policy, num_fragments=1, roster={"a", "b", "c"})
    restored.load_state_dict(state, now=2.0)
    assert restored.roster == {"a", "b"}
    # a run without a roster (decoupled, open membership) keeps none
    open_book = RoundBook(book.policy, num_fragments=1)
    open_book.load_state_dict(state, now=2.0)
    assert open_book.roster is None
    with pytest.raises(ValueError):
        RoundBook(book.policy, num_fragments=2).load_state_dict(state, now=2.0)


def test_an_abort_carries_all_of_its_work_into_a_newer_base_offer():
    # a's offer on base 0 merges into version 2; meanwhile a took version 1 and offered 3 steps
    # on it. The merge fails: all 4 of the aborted offer's steps are carried by the base-1 entry,
    # so a later base-1 offer (5 steps since base 1) stands for 9.
    book = book_with(["a"], policy(grace_max_s=0.0, max_staleness_versions=5))
    book.fragments[0].version = 1
    book.offer(meta("a", base=0, steps=4, tokens=400, step=4), now=0.0)
    (close,) = book.poll(now=0.0)
    book.offer(meta("a", base=1, steps=3, tokens=300, step=7), now=0.5)
    book.abort(close, now=1.0)
    entry = book.fragments[0].pending["a"]
    assert (entry.num_steps, entry.num_tokens) == (7, 700)
    book.offer(meta("a", base=1, steps=5, tokens=500, step=9), now=2.0)
    entry = book.fragments[0].pending["a"]
    assert (entry.num_steps, entry.num_tokens) == (9, 900)


def test_an_abort_puts_back_every_contribution_after_a_restarted_one():
    book = book_with(["a", "b"], policy(quorum_min=2, grace_max_s=0.0))
    book.offer(meta("a"), now=0.0)
    book.offer(meta("b"), now=0.0)
    (close,) = book.poll(now=0.0)
    assert [c.meta.learner for c in close.contributions] == ["a", "b"]
    book.register("a", 1, now=0.5)  # a restarted while its work merged
    book.abort(close, now=1.0)
    frag = book.fragments[0]
    assert [e.meta.learner for e in frag.kept] == ["a"]
    assert list(frag.pending) == ["b"]


def test_a_fragment_merging_closes_no_second_round():
    book = book_with(["a", "b"], policy(grace_max_s=0.0))
    book.offer(meta("a"), now=0.0)
    (close,) = book.poll(now=0.0)
    assert book.fragments[0].merging
    book.offer(meta("b"), now=0.1)  # waits for the merge to commit
    assert book.poll(now=0.2) == []
    book.commit(close, sync_time_s=0.0, now=0.3)
    (again,) = book.poll(now=0.3)
    assert [c.meta.learner for c in again.contributions] == ["b"]


def test_the_final_rounds_close_whatever_the_quorum_and_merge_everyone_held():
    # K = 3 of 3 live learners: two offered fragment 1, one offered fragment 2, and nobody
    # else will (the run's end). `poll` holds both rounds; `close_all` closes each with all
    # its held work, once, and leaves nothing open.
    book = book_with(["a", "b", "c"], policy(quorum_min=3), num_fragments=3)
    assert book.offer(meta("a", fragment=1), now=1.0) is Verdict.ACCEPTED
    assert book.offer(meta("b", fragment=1, steps=2, tokens=200), now=1.0) is Verdict.ACCEPTED
    assert book.offer(meta("c", fragment=2), now=1.0) is Verdict.ACCEPTED
    assert book.poll(now=1.5) == []
    assert book.open_work()
    closes = {c.fragment: c for c in book.close_all(now=2.0)}
    assert sorted(closes) == [1, 2]  # fragment 0 holds nothing: no empty round
    assert [e.meta.learner for e in closes[1].contributions] == ["a", "b"]
    assert closes[1].num_tokens == 600 and closes[2].num_tokens == 400
    assert closes[1].learners == 3 and closes[1].grace_s == 0.0
    assert closes[1].quorum_s == closes[1].closed_s == 2.0
    assert book.open_work()  # merging until committed
    assert book.close_all(now=2.0) == []  # a merging round is not closed twice
    for c in closes.values():
        book.commit(c, sync_time_s=0.0, now=2.0)
    assert not book.open_work()
    assert book.versions() == {0: 0, 1: 1, 2: 1}


def test_the_final_rounds_take_work_of_a_replaced_incarnation_but_not_a_held_fragment():
    book = book_with(["a", "b"], policy(quorum_min=2), num_fragments=2)
    assert book.offer(meta("a", fragment=0), now=1.0) is Verdict.ACCEPTED
    book.register("a", 1, now=1.5)  # restarted: its offer is kept, not pending
    assert book.offer(meta("b", fragment=1), now=1.5) is Verdict.ACCEPTED
    book.held.add(1)  # being recovered after a synchronizer restart: no round closes
    (close,) = book.close_all(now=2.0)
    assert close.fragment == 0 and [e.meta.incarnation for e in close.contributions] == [0]
