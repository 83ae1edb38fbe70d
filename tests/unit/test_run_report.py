"""The run report: report.html and its pictures from a run dir, finished or still running."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ray_diloco.cli import main
from ray_diloco.config import build_config, dump_config
from ray_diloco.control.events import (
    FailureDetected,
    FailureKind,
    FaultInjected,
    HeldoutEvaluated,
    LearnerJoined,
    LearnerLeft,
    LearnerRejoined,
    LearnerRestarted,
    LearnerState,
    LearnerStateChanged,
    RoundClosed,
    RunStarted,
)
from ray_diloco.control.tape import EventTape
from ray_diloco.observe.record import ReportError, RunRecord
from ray_diloco.observe.run_report import REPORT_FILES, write_report

T, C, D, R = (
    LearnerState.TRAINING,
    LearnerState.COMPILING,
    LearnerState.DEAD,
    LearnerState.RESTARTING,
)


def make_run(run_dir: Path, finished: bool) -> None:
    cfg = build_config(
        {
            "name": "demo",
            "token_budget": 20_000,
            "learners": [
                {"name": "us-0", "region": "us-east", "batch_size": 8},
                {"name": "eu-0", "region": "eu-west", "batch_size": 8},
            ],
        }
    )
    dump_config(cfg, run_dir / "config.json")
    events = [
        RunStarted(0.5, "digest"),
        LearnerStateChanged(2.0, "us-0", 0, C),
        LearnerStateChanged(2.5, "eu-0", 0, C),
        LearnerStateChanged(6.0, "us-0", 0, T),
        LearnerStateChanged(6.5, "eu-0", 0, T),
        HeldoutEvaluated(5.0, 0, 0, 5.5),
        FaultInjected(12.0, "kill_host", "eu-0"),
        FailureDetected(12.4, "eu-0", FailureKind.CRASH, 0.4),
        LearnerStateChanged(12.4, "eu-0", 0, D),
        LearnerStateChanged(12.5, "eu-0", 0, R),
        LearnerRestarted(13.0, "eu-0", 1, 1, 0.6),
        LearnerStateChanged(13.0, "eu-0", 1, LearnerState.STARTING),
        LearnerStateChanged(15.0, "eu-0", 1, T),
        LearnerRejoined(16.0, "eu-0", 1, {0: 3}, 3.6),
    ]
    events += [RoundClosed(7.0 + i, i % 2, i // 2 + 1, 1 + i % 2, 800, 0.2, 0.1) for i in range(12)]
    events += [HeldoutEvaluated(8.0 + 3 * i, 2_000 * i, 2 * i, 4.0 - 0.4 * i) for i in range(4)]
    with EventTape(run_dir / "events.jsonl") as tape:
        for e in events:
            tape.append(e)
    points = [
        {
            "t": float(t),
            "tokens": 1_000 * t,
            "goodput": t / 40,
            "uptime": 1.0 if t > 7 else None,  # none before the first round (7 s)
            "bytes_up": {"us-0": 500 * t, "eu-0": 400 * t},
            "bytes_down": {"us-0": 900 * t, "eu-0": 900 * t},
            "learners": {
                "us-0": {"state": "training", "restarts": 0, "merged": t},
                "eu-0": {"state": "training", "restarts": 1, "merged": t // 2},
            },
        }
        for t in range(1, 19)
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(p) + "\n" for p in points))
    if finished:
        summary = {
            "wall_time_s": 18.5,
            "stop_reason": "token budget reached",
            "tokens": 20_000,
            "heldout_loss": 2.5,
            "rounds": 12,
            "mean_contributors": 1.5,
            "goodput": 0.41,
            "uptime": 0.97,
            "tokens_per_s": 1081.0,
            "bytes_total": 30_000,
            "bytes_per_token": 1.5,
            "num_failures": 1,
            "rejected": {"non_finite": 1},
            "bytes_per_link": {
                "us-0": {"up": 9_000, "down": 16_000},
                "eu-0": {"up": 7_000, "down": 16_000},
            },
        }
        (run_dir / "summary.json").write_text(json.dumps(summary))


@pytest.mark.parametrize("finished", [True, False], ids=["finished", "running"])
def test_report_is_one_self_contained_page_with_every_picture(
    tmp_path: Path, finished: bool, capsys: pytest.CaptureFixture[str]
):
    make_run(tmp_path, finished)
    if finished:
        assert write_report(tmp_path) == tmp_path / "report.html"
    else:  # `ray-diloco report RUN_DIR` on a running run
        assert main(["report", str(tmp_path)]) == 0
        assert "report.html" in capsys.readouterr().out
    path = tmp_path / "report.html"
    for name in REPORT_FILES:
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" or name.endswith(".html")
    page = path.read_text()
    assert page.count("data:image/png;base64,") == len(REPORT_FILES) - 1
    assert "src='http" not in page and "<script" not in page  # nothing to fetch
    assert "kill_host" in page and "eu-0 (eu-west)" in page
    assert ("Finished after 0:18" in page) == finished
    assert ("Not finished" in page) == (not finished)


def test_learner_timeline_comes_from_the_event_tape(tmp_path: Path):
    make_run(tmp_path, finished=True)
    spans = RunRecord.load(tmp_path).state_spans()
    eu = spans["eu-0"]
    # starting from the run's start, then as the tape says, to the end of the run
    assert eu[0] == ("starting", 0.5, 2.5)
    assert ("dead", 12.4, 12.5) in eu and ("restarting", 12.5, 13.0) in eu
    assert eu[-1] == ("training", 15.0, 18.5)
    total = sum(end - start for _, start, end in spans["us-0"])
    assert total == pytest.approx(18.0)


def test_report_of_a_dir_without_a_run_is_one_error_line(tmp_path: Path, capsys):
    with pytest.raises(ReportError):
        write_report(tmp_path)
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "events.jsonl" in err


def test_a_learner_that_joined_and_left_is_in_the_report(tmp_path: Path):
    """`ray-diloco scale --add`: the joiner is not in config.json, only on the tape; its row,
    region and timeline (from its join, not the run's start) come from there, and a failure
    of it is drawn on its row instead of failing the report."""
    make_run(tmp_path, finished=True)
    joined = [
        LearnerJoined(9.0, "ap-0", "ap-south", "cpu", "requested"),
        LearnerStateChanged(9.0, "ap-0", 0, LearnerState.STARTING),
        LearnerStateChanged(10.0, "ap-0", 0, T),
        FailureDetected(11.0, "ap-0", FailureKind.CRASH, 0.2),
        LearnerStateChanged(11.0, "ap-0", 0, D),
        LearnerStateChanged(11.5, "ap-0", 1, T),
        LearnerStateChanged(14.0, "ap-0", 1, LearnerState.LEFT),
        LearnerLeft(14.0, "ap-0", "requested", 512),
    ]
    with EventTape(tmp_path / "events.jsonl") as tape:
        for e in joined:
            tape.append(e)
    rec = RunRecord.load(tmp_path)
    assert rec.learner_names == ["us-0", "eu-0", "ap-0"]
    assert rec.label("ap-0") == "ap-0 (ap-south)"
    spans = rec.state_spans()["ap-0"]
    assert spans[0] == ("starting", 9.0, 10.0)
    assert spans[-1] == ("left", 14.0, 18.5)
    write_report(tmp_path)
    assert "ap-0 (ap-south)" in (tmp_path / "report.html").read_text()
