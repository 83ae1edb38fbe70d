"""Progress points (what the driver hands its display) and the displays that show them."""

from __future__ import annotations

import dataclasses
import io
from typing import Any

from rich.console import Console

from ray_diloco.control.events import LearnerState
from ray_diloco.control.protocol import (
    LearnerProgress,
    LearnerRow,
    SupervisorStatus,
    SynchronizerStatus,
)
from ray_diloco.observe.display import PlainDisplay, progress_display, render
from ray_diloco.observe.progress import ProgressTracker, booting
from ray_diloco.observe.report import progress_line
from tests.status_helpers import sync_status

REGIONS = {"us-0": "us-east", "eu-0": "eu-west"}


def statuses(
    tokens: int, steps: dict[str, int], merged: dict[str, int], states: dict[str, str]
) -> tuple[SynchronizerStatus, SupervisorStatus]:
    st = sync_status(
        tokens=tokens,
        heldout_loss=3.5 if tokens else None,
        rounds=sum(merged.values()),
        mean_contributors=1.5,
        live=["us-0"],
        bytes_up={"us-0": 10 * tokens},
        bytes_down={"us-0": 20 * tokens},
        learners={n: LearnerProgress(s, 0, None, None, 1, 0.0) for n, s in steps.items()},
        contributions_merged=merged,
    )
    sup = SupervisorStatus(
        goodput=0.5,
        uptime=0.9,
        learners={n: LearnerRow(LearnerState(s), 0, 0) for n, s in states.items()},
        recovery={"kill_host": {"recovery_s_median": 4.0}},
    )
    return st, sup


def test_rates_are_measured_over_a_recent_window_not_since_the_start():
    tracker = ProgressTracker(100_000, REGIONS)
    boot = {"us-0": "compiling", "eu-0": "starting"}
    p = tracker.point(0.0, *statuses(0, {}, {}, boot))
    assert booting(p) and p["eta_s"] is None and p["tokens_per_s"] == 0.0
    training = {"us-0": "training", "eu-0": "training"}
    tracker.point(30.0, *statuses(0, {"us-0": 0}, {}, training))  # 30 s of boot
    tracker.point(32.0, *statuses(2_000, {"us-0": 10}, {"us-0": 1}, training))
    p = tracker.point(34.0, *statuses(4_000, {"us-0": 20}, {"us-0": 1}, training))
    # a rate since the start would say 4000 / 34 s; the last 10 s say 1000 tokens/s
    assert not booting(p)
    assert p["tokens_per_s"] == 1_000.0
    assert p["eta_s"] == 96.0
    us = p["learners"]["us-0"]
    assert us["steps_per_s"] == 5.0 and us["region"] == "us-east"
    assert us["state"] == "training" and us["since"] == 30.0
    assert us["merged"] == 1 and us["last_merge_t"] == 32.0
    assert p["learners"]["eu-0"]["last_merge_t"] is None  # nothing of it merged yet


def test_the_first_rate_after_the_boot_leaves_the_boot_out():
    # Polled every second: 25 s of boot at 0 tokens, then 1000 tokens/s. Within the 10 s window
    # the boot's zeros said 300 tokens/s (an ETA three times too long); only its last poll, the
    # moment before training began, belongs in the rate.
    tracker = ProgressTracker(100_000, REGIONS)
    training = {"us-0": "training", "eu-0": "training"}
    for t in range(26):
        tracker.point(float(t), *statuses(0, {}, {}, {"us-0": "compiling", "eu-0": "compiling"}))
    for t, tokens in ((26, 1_000), (27, 2_000), (28, 3_000)):
        p = tracker.point(float(t), *statuses(tokens, {"us-0": t}, {}, training))
    assert p["tokens_per_s"] == 1_000.0 and p["eta_s"] == 97.0


def test_a_restarted_learner_shows_since_when_it_is_down():
    tracker = ProgressTracker(100_000, REGIONS)
    up = {"us-0": "training", "eu-0": "training"}
    tracker.point(10.0, *statuses(1_000, {"us-0": 5, "eu-0": 5}, {}, up))
    down = {"us-0": "training", "eu-0": "dead"}
    tracker.point(12.0, *statuses(1_500, {"us-0": 9, "eu-0": 5}, {}, down))
    p = tracker.point(14.0, *statuses(2_000, {"us-0": 13, "eu-0": 5}, {}, down))
    eu = p["learners"]["eu-0"]
    assert eu["state"] == "dead" and eu["since"] == 12.0 and eu["steps_per_s"] == 0.0


def test_a_learner_that_joins_the_running_job_is_shown_and_so_is_its_leave():
    """`ray-diloco scale --add`: the tracker knows the config's learners; a joiner appears
    from the first poll whose supervisor status names it, with the region it names."""
    tracker = ProgressTracker(100_000, REGIONS)
    up = {"us-0": "training", "eu-0": "training"}
    tracker.point(10.0, *statuses(1_000, {"us-0": 5, "eu-0": 5}, {}, up))
    st, sup = statuses(1_500, {"us-0": 9, "eu-0": 9, "ap-0": 2}, {"ap-0": 1}, up)
    sup.learners["ap-0"] = LearnerRow(LearnerState.TRAINING, 0, 0, region="ap-south")
    p = tracker.point(12.0, st, sup)
    assert list(p["learners"]) == ["us-0", "eu-0", "ap-0"]
    ap = p["learners"]["ap-0"]
    assert ap["region"] == "ap-south" and ap["state"] == "training" and ap["merged"] == 1
    assert "training 3" in progress_line(p, 100_000)
    sup.learners["ap-0"] = LearnerRow(LearnerState.LEFT, 0, 0, region="ap-south")
    p = tracker.point(14.0, st, sup)
    assert "training 2, left 1 (ap-0)" in progress_line(p, 100_000)
    assert "ap-south" in _text(render(p, "run local"))


def test_live_view_says_learners_are_starting_instead_of_rows_of_zeros():
    tracker = ProgressTracker(600_000, REGIONS, "http://127.0.0.1:8265")
    p = tracker.point(12.0, *statuses(0, {}, {}, {"us-0": "compiling", "eu-0": "starting"}))
    text = _text(render(p, "run local"))
    assert "starting learners (compiling)" in text and "http://127.0.0.1:8265" in text
    assert "compiling" in text and "eu-west" in text and "%" not in text


def test_live_view_shows_the_budget_bar_and_a_row_per_learner():
    tracker = ProgressTracker(600_000, REGIONS)
    up = {"us-0": "training", "eu-0": "restarting"}
    tracker.point(50.0, *statuses(290_000, {"us-0": 100}, {"us-0": 3}, up))
    st, sup = statuses(300_000, {"us-0": 110}, {"us-0": 4}, up)
    # One fragment; us-0 trained 1,000 tokens, 250 of them merged.
    trained = {"us-0": LearnerProgress(110, 1000, None, None, 1, 0.0)}
    st = dataclasses.replace(st, versions={0: 4}, learners=trained, tokens_merged={"us-0": 250})
    p = tracker.point(52.0, st, sup)
    assert p["learners"]["us-0"]["merged_share"] == 0.25
    text = _text(render(p, "run local"))
    assert "4 · 25%" in text  # contributions merged and the share of its tokens they carried
    assert "50%" in text and "300k/600k tokens" in text and "5k tok/s" in text
    assert "ETA 1:00" in text and "held-out loss 3.5000" in text and "goodput 0.500" in text
    assert "restarting" in text and "5.0" in text  # eu-0's state, us-0's steps/s


def test_plain_lines_come_every_n_seconds_and_at_once_when_a_learner_goes_down():
    lines: list[str] = []
    display = PlainDisplay(10.0, lines.append)
    tracker = ProgressTracker(100_000, REGIONS)
    up = {"us-0": "training", "eu-0": "training"}
    for t in (0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0):
        display(tracker.point(t, *statuses(int(100 * t), {}, {}, up)))
    assert len(lines) == 2  # t=0 and t=10
    display(tracker.point(13.0, *statuses(1_300, {}, {}, {**up, "eu-0": "dead"})))
    assert len(lines) == 3 and "down 1 (eu-0)" in lines[-1]
    display.close()
    assert len(lines) == 3  # the last point was printed already


def test_the_display_falls_back_to_plain_lines_when_not_a_terminal():
    out = io.StringIO()
    tracker = ProgressTracker(100_000, REGIONS)
    with progress_display("run local", 10.0, file=out) as show:
        show(tracker.point(1.0, *statuses(0, {}, {}, {"us-0": "compiling", "eu-0": "starting"})))
    assert out.getvalue().startswith("t=0:01  starting learners (compiling): compiling 1 (us-0)")
    assert "\x1b[" not in out.getvalue()  # no escape codes in a pipe


def test_progress_line_shows_goodput_uptime_restarts_and_recovery():
    point = {
        "tokens": 120_000,
        "t": 42.0,
        "rounds": 17,
        "goodput": 0.8123,
        "uptime": 1.0,
        "restarts": {"a": 0, "b": 2},
        "recovery": {"kill_host": 6.25, "straggler": None},
    }
    line = progress_line(point, 1_000_000)
    assert "tokens 120k/1M" in line and "goodput 0.812" in line and "uptime 1.000" in line
    assert "restarts b:2" in line and "a:0" not in line
    assert "recovered in [kill_host:6.2s]" in line and "straggler" not in line
    # Before the first round the supervisor has no uptime yet (None): none shown, not 0.
    assert "uptime" not in progress_line({**point, "rounds": 0, "uptime": None}, 1_000_000)


def _text(renderable: Any) -> str:
    console = Console(file=io.StringIO(), width=140, record=True)
    console.print(renderable)
    return console.export_text()
