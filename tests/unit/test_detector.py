"""Load-adapted failure-detection timeouts (control/detector.py) on a hand-driven clock."""

from __future__ import annotations

import pytest

from ray_diloco.control.detector import MIN_GAPS, WINDOW, Cadence


def beats(c: Cadence, start: float, gap: float, count: int) -> float:
    t = start
    for _ in range(count):
        c.arrived(t)
        t += gap
    return t - gap


def test_the_floor_holds_until_enough_gaps_are_known_and_while_answers_come_fast() -> None:
    c = Cadence(floor_s=2.0, factor=3.0, ceiling_s=30.0)
    beats(c, 0.0, 5.0, MIN_GAPS)  # MIN_GAPS arrivals: one gap short
    assert c.timeout_s() == 2.0
    fast = Cadence(2.0, 3.0, 30.0)
    beats(fast, 0.0, 0.25, 200)  # an idle machine: 3 x 0.25 s is below the floor
    assert fast.timeout_s() == 2.0


def test_slow_answers_stretch_the_timeout_up_to_the_ceiling() -> None:
    c = Cadence(2.0, 3.0, 30.0)
    beats(c, 0.0, 1.5, 50)  # a busy machine: answers 1.5 s apart
    assert c.timeout_s() == pytest.approx(4.5)
    beats(c, 100.0, 20.0, WINDOW + 1)
    assert c.timeout_s() == 30.0


def test_one_stall_among_many_answers_is_ignored_two_are_not() -> None:
    c = Cadence(2.0, 3.0, 30.0)
    t = beats(c, 0.0, 0.25, WINDOW)
    c.arrived(t + 4.0)  # one 4 s stall in the window
    assert c.timeout_s() == 2.0
    c.arrived(t + 8.0)  # a second one: this machine stalls
    assert c.timeout_s() == pytest.approx(12.0)


def test_old_gaps_age_out_of_the_window() -> None:
    c = Cadence(2.0, 3.0, 30.0)
    beats(c, 0.0, 2.0, 20)
    assert c.timeout_s() == 6.0
    beats(c, 100.0, 0.25, WINDOW + 1)  # the load went away
    assert c.timeout_s() == 2.0


def test_no_gap_is_learned_across_a_restart() -> None:
    c = Cadence(2.0, 3.0, 30.0, min_gaps=1)
    c.arrived(0.0)
    c.forget_last()
    c.arrived(500.0)  # the restart took long: that is no gap between answers
    assert list(c.gaps) == [] and c.timeout_s() == 2.0


def test_boot_durations_are_learned_directly() -> None:
    boots = Cadence(60.0, 2.0, 3600.0, min_gaps=1)
    boots.add_gap(20.0)
    assert boots.timeout_s() == 60.0
    boots.add_gap(45.0)  # a boot under load: the next one gets twice as long
    assert boots.timeout_s() == 90.0


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="floor"):
        Cadence(5.0, 3.0, 2.0)
    with pytest.raises(ValueError, match="factor"):
        Cadence(2.0, 0.5, 30.0)
