"""The method's variants (algorithm/variants.py): one function per config choice, hand values."""

from __future__ import annotations

from typing import get_args

import numpy as np
import pytest

from ray_diloco.algorithm import variants, wire
from ray_diloco.algorithm.rounds import LATE_POLICIES
from ray_diloco.algorithm.stream_merge import Streamed, stream_outer_gradient
from ray_diloco.config import DilocoConfig


@pytest.mark.parametrize(
    ("field", "table"),
    [
        ("round_step", variants.ROUND_STEPS),
        ("accelerate", variants.ACCELERATE),
        ("outer_anchor", variants.ANCHORS),
        ("publish_to", variants.PUBLISH_TO),
        ("late_policy", LATE_POLICIES),
        ("schedule", variants.SCHEDULES),
    ],
)
def test_every_config_choice_has_its_rule(field: str, table: dict) -> None:
    assert set(get_args(DilocoConfig.model_fields[field].annotation)) == set(table)


@pytest.mark.parametrize(
    ("name", "one_of_four", "all_four"),
    [
        ("full", (1.0, 1.0), (1.0, 1.0)),
        ("share", (0.25, 1.0), (1.0, 1.0)),
        ("fraction", (1.0, 0.25), (1.0, 1.0)),
        ("sqrt", (1.0, 0.5), (1.0, 1.0)),
        ("sqrt_each", (1.0, 0.5), (1.0, 1.0)),
    ],
)
def test_round_steps_hand_values(name: str, one_of_four: tuple, all_four: tuple) -> None:
    step = variants.ROUND_STEPS[name]
    assert step(1, 4) == pytest.approx(one_of_four)
    assert step(4, 4) == pytest.approx(all_four)
    # a merged learner that left no longer counts in the run: never more than one step
    assert step(5, 4) == pytest.approx(all_four)


def test_sqrt_each_depends_on_learners_merged_not_on_rounds() -> None:
    # two learners of 4 in one round: 2/sqrt(4) = 1 step; with sqrt, sqrt(0.5) = 0.71
    assert variants.step_sqrt_each(2, 4) == (1.0, 1.0)
    assert variants.step_sqrt(2, 4)[1] == pytest.approx(0.5**0.5)


def test_accelerate_window_takes_one_window_of_the_merged_work() -> None:
    H = 8
    assert variants.accelerate_window([1.0, 1.0], [8, 8], H) == 1.0
    assert variants.accelerate_window([1.0, 1.0], [16, 16], H) == 0.5
    # weighted by the merge weights: (3 x 8 + 1 x 40) / 4 = 16 steps on average, 2 windows
    assert variants.accelerate_window([3.0, 1.0], [8, 40], H) == 0.5
    assert variants.accelerate_all([1.0], [800], H) == 1.0


def test_anchors() -> None:
    g = {"w": np.array([1.0, 1.0], np.float32)}
    held_at = {"w": np.array([0.0, 0.0], np.float32)}
    current, base = variants.ANCHORS["current"], variants.ANCHORS["base"]
    assert current.moved_from(held_at, g) is None
    assert base.moved_from(held_at, g) is held_at  # G moved since: the update moves with it
    assert base.moved_from(g, g) is None  # held against this very G: nothing moved
    assert current.start(g, held_at) is held_at and base.start(g, held_at) is g


def test_recipients() -> None:
    live = ["a", "b", "c"]
    assert variants.to_all({"b"}, live) == live
    assert variants.to_contributors({"b", "x"}, live) == ["b"]


def test_sqrt_each_is_one_over_sqrt_learners_a_learner() -> None:
    assert variants.step_sqrt_each(1, 8)[1] == pytest.approx(8**-0.5)


def test_accelerate_window_edges() -> None:
    H = 8
    assert variants.accelerate_window([0.5, 0.5], [16, 16], H) == 0.5  # weights of any scale
    assert variants.accelerate_window([0.0], [8], H) == 1.0  # no weight: nothing to throttle
    assert variants.accelerate_window([1.0], [4], H) == 1.0  # under one window: all of it
    with pytest.raises(ValueError):
        variants.accelerate_window([1.0, 1.0], [8], H)


def test_a_base_anchored_contribution_is_g_plus_its_own_update() -> None:
    g = {"w": np.array([1.0, 1.0], np.float32)}
    held_at = {"w": np.array([0.25, -0.5], np.float32)}
    update = np.array([0.25, 0.25], np.float32)  # theta - held_at: the learner's own
    moved = variants.ANCHORS["base"].moved_from(held_at, g)
    c = Streamed({"w": wire.encode(update, "float32")}, held_at, moved)
    ((grad, scale),) = stream_outer_gradient(g, [(c, 1.0)], method="mean").values()
    np.testing.assert_array_equal(grad * scale, -update)  # G - (G + its own update)


def test_variants_are_chosen_from_the_config() -> None:
    d = DilocoConfig(
        round_step="fraction", accelerate="all", outer_anchor="base", publish_to="contributors"
    )
    v = variants.Variants.of(d)
    assert v.round_step is variants.step_fraction and v.accelerate is variants.accelerate_all
    assert v.anchor is variants.ANCHORS["base"] and v.recipients is variants.to_contributors
    assert variants.scaled({"a": 2.0, "b": 4.0}, 0.5) == {"a": 1.0, "b": 2.0}


def test_the_pull_clock_pulls_each_fragment_once_a_window_on_the_leading_count():
    # H = P = 8: fragment p is due where (step + p) % 8 == 0, fragment 7 first at step 1
    clock = variants.PullClock(8, 8, range(8))
    assert [clock.reported(step) for step in range(1, 8)] == [[7], [6], [5], [4], [3], [2], [1]]
    assert clock.reported(7) == []  # a second learner at the same step: pulled already
    assert clock.reported(5) == []  # one behind: the leader pulled its fragments already
    assert clock.reported(8) == [0]
    assert clock.reported(9) == [7]  # fragment 7's next window
    # a leader that skipped steps (its reports were lost) pulls all that fell due meanwhile,
    # each then next due after the step it reported
    assert clock.reported(18) == list(range(8))
    assert clock.next[0] == 24 and clock.next[6] == 26 and clock.next[7] == 25


def test_a_shard_pulls_only_its_own_fragments():
    clock = variants.PullClock(8, 4, [1, 3])  # offsets 2 and 6: due at 6 and 2 (mod 8)
    assert clock.reported(2) == [3]
    assert clock.reported(4) == []  # fragment 2 is due here, on another shard
    assert clock.reported(6) == [1]
    assert clock.reported(8) == []  # fragment 0 is due here, on another shard
    assert clock.reported(10) == [3]


def test_offers_on_its_own_count_pull_nothing():
    d = DilocoConfig(schedule="offer")
    assert isinstance(variants.schedule(d, range(24)), variants.OwnCount)
    assert variants.schedule(d, range(24)).reported(24) == []
    pulled = variants.schedule(DilocoConfig(), range(24))  # the default
    assert pulled.reported(1) == [23]  # offset 23: due at step 1
