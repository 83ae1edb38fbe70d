"""What the run report and the terminal show: one summary (the same rows, with units) in both,
the "slow" flag only for a learner slower than its configured speed by SLOW_MARGIN for
SLOW_FOR_S, goodput over a window, link rates against the link's capacity, the grace panel only
when grace is on, the training curves and the config on the page."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ray_diloco.control.events import LearnerState
from ray_diloco.control.protocol import LearnerProgress, LearnerRow, SupervisorStatus
from ray_diloco.observe import run_plots
from ray_diloco.observe.display import render
from ray_diloco.observe.progress import SLOW_FOR_S, SLOW_MARGIN, ProgressTracker
from ray_diloco.observe.record import RunRecord
from ray_diloco.observe.report import summary_rows, summary_table
from ray_diloco.observe.run_report import render_html, write_report
from tests.status_helpers import sync_status
from tests.unit.test_run_report import make_run


def _slow_flags(rates: dict[str, list[float]], speeds: dict[str, float]) -> list[dict[str, bool]]:
    """One poll every 2 s; `rates[name][i]` steps/s of learner `name` before poll i."""
    tracker = ProgressTracker(10**9, dict.fromkeys(rates, "local"), speeds=speeds)
    steps = dict.fromkeys(rates, 0.0)
    flags = []
    for i in range(len(next(iter(rates.values())))):
        for name in rates:
            steps[name] += 2.0 * rates[name][i]
        st = sync_status(
            learners={n: LearnerProgress(int(s), 0, None, None, i, 0.0) for n, s in steps.items()}
        )
        training = {n: LearnerRow(LearnerState.TRAINING, 0, 0) for n in rates}
        point = tracker.point(2.0 * i, st, SupervisorStatus(learners=training))
        flags.append({n: ls["slow"] for n, ls in point["learners"].items()})
    return flags


def test_slow_means_slower_than_its_configured_speed_for_a_while() -> None:
    assert SLOW_MARGIN == 0.3 and SLOW_FOR_S == 20.0  # what the display's docs state
    polls = 40  # 80 s
    # b runs at half the pace, as configured (speed 0.5); c halves its pace from poll 15 on
    # (30 s); d dips for one poll only, as a busy machine makes it.
    rates = {
        "a": [10.0] * polls,
        "b": [5.0] * polls,
        "c": [10.0] * 15 + [5.0] * (polls - 15),
        "d": [10.0] * 20 + [2.0] + [10.0] * (polls - 21),
    }
    flags = _slow_flags(rates, {"b": 0.5})
    assert not any(f["a"] or f["b"] or f["d"] for f in flags)
    slow_c = [i for i, f in enumerate(flags) if f["c"]]
    # Its pace over the last SLOW_FOR_S (10 polls) with k of them slow: 10 - 0.5 k steps/s,
    # below 0.7 x 10 from k = 7 on, the 7th slow poll: poll 21 (42 s of run time).
    assert slow_c == list(range(21, polls))


def test_the_display_shows_slow_only_from_the_flag() -> None:
    point = {
        "t": 30.0,
        "tokens": 10,
        "budget": 100,
        "learners": {
            "a": {"state": "training", "degraded": ["no_contributions"], "slow": False},
            "b": {"state": "training", "degraded": [], "slow": True},
        },
    }
    from rich.console import Console

    console = Console(width=160, record=True)
    console.print(render(point, "title"))
    rows = {line.split()[0]: line for line in console.export_text().splitlines() if line}
    assert "(slow)" not in rows["a"] and "training (slow)" in rows["b"]


def test_the_terminal_and_the_report_show_the_same_summary_rows(tmp_path: Path) -> None:
    make_run(tmp_path, finished=True)
    summary = json.loads((tmp_path / "summary.json").read_text())
    summary["token_budget"] = 20_000
    summary["final_rounds"] = {
        "rounds": 12,
        "heldout_loss_before": 2.66291,
        "merged_share_before": 0.89,
    }
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    rows = summary_rows(summary)
    table = summary_table(summary)
    rec = RunRecord.load(tmp_path)
    page = render_html(rec, {})
    for measure, value in rows:
        assert f"| {measure} | {value} |" in table
        assert f"<td>{measure}</td><td>{value}</td>" in page
    shown = dict(rows)
    assert shown["tokens trained"] == "20k of 20k tokens"
    assert shown["bytes moved (up + down)"] == "30kB (1.5 B/token)"
    assert shown["goodput"] == "41.0%" and shown["wall time"] == "0:18 (18.5 s)"
    assert shown["final rounds (unsent work)"] == (
        "12; at the budget held-out 2.6629, 89.0% merged"
    )
    assert "<summary>config.json</summary>" in page and "K (quorum)" in page


def test_goodput_is_windowed_and_links_are_rates_against_capacity(tmp_path: Path) -> None:
    make_run(tmp_path, finished=True)
    rec = RunRecord.load(tmp_path)
    windowed = dict(rec.windowed_goodput(3.0, samples=37))
    # eu-0 is dead and restarting from 12.4 to 13 s, then starting until 15 s: the window
    # ending at 15 s holds it; the one ending at 18.5 s (both train from 15 s on) does not.
    assert windowed[15.0] < 0.8 and windowed[18.5] == pytest.approx(1.0)
    rates = rec.link_rates()
    # 500 bytes/s up from us-0 (us-east), 900 down; eu-west's one learner 400 up
    assert {r for _, r in rates["us-east"]["up"]} == {8 * 500.0}
    assert {r for _, r in rates["eu-west"]["down"]} == {8 * 900.0}
    config = json.loads((tmp_path / "config.json").read_text())
    config["links"] = {"eu-west": {"bandwidth_gbps": 1.0, "latency_ms": 0}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    fig = run_plots.links(RunRecord.load(tmp_path))
    ax = fig.axes[0]
    assert 1000.0 in {line.get_ydata()[0] for line in ax.get_lines() if line.get_linestyle() == ":"}
    assert ax.get_ylabel() == "Mbit/s"


def test_the_grace_panel_is_drawn_only_with_a_grace_window(tmp_path: Path) -> None:
    make_run(tmp_path, finished=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["diloco"]["grace_fraction"] = 0.5
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert len(run_plots.rounds(RunRecord.load(tmp_path)).axes) == 2
    config["diloco"]["grace_fraction"] = 0  # the default
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert len(run_plots.rounds(RunRecord.load(tmp_path)).axes) == 1


def test_the_report_draws_the_training_curves(tmp_path: Path) -> None:
    make_run(tmp_path, finished=True)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    points = [json.loads(ln) for ln in lines]
    for i, p in enumerate(points):
        p["learners"]["us-0"] |= {"step": i, "tokens": 100 * i, "loss": 5.0 - 0.1 * i, "lr": 1e-3}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(p) + "\n" for p in points))
    rec = RunRecord.load(tmp_path)
    curve = rec.training_curves()["us-0"]
    assert [c["tokens"] for c in curve] == [100 * i for i in range(len(points))]
    by_tokens = run_plots.training(rec).axes[0]
    xs = [[float(x) for x in line.get_xdata()] for line in by_tokens.get_lines()]
    assert [float(p["tokens"]) for p in points] in xs  # us-0's loss by the run's tokens
    write_report(tmp_path)
    assert (tmp_path / "training.png").read_bytes()[:4] == b"\x89PNG"
