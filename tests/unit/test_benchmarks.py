"""The benchmark scripts' --quick settings run and write results of the documented shape
(their values are measured by the full settings, not asserted here)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_quick(script: str, out: Path, *extra: str) -> dict:
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--out", str(out), *extra],
        check=True,
        cwd=ROOT,
        capture_output=True,
        timeout=600,
    )
    name = script.removesuffix(".py") + "-quick"
    assert (out / f"{name}.md").exists(), "markdown report missing"
    return json.loads((out / f"{name}.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_benchmarks_write_their_tables(tmp_path):
    # Side by side: each script is one mostly single-threaded process, and CI has two cores.
    # goodput.py under two failure schedules, not its three: each is 8 more runs (4 modes x 2
    # failure rates) of about 3 CPU s, and two are enough to show every rate runs under every
    # schedule; the third would only repeat that.
    with ThreadPoolExecutor(max_workers=3) as pool:
        runs = [
            pool.submit(run_quick, "goodput.py", tmp_path, "--chaos-seeds", "7", "8"),
            pool.submit(
                run_quick, "quality.py", tmp_path, "--only", "data_parallel", "decoupled K=1 grace"
            ),
            pool.submit(run_quick, "bandwidth.py", tmp_path),
        ]
    goodput, quality, bandwidth = (run.result() for run in runs)
    assert {(r["mode"], r["failures"]) for r in goodput["rows"]} == {
        (m, f)
        for m in ("decoupled", "decoupled, pulled (default)", "synchronous", "data_parallel")
        for f in ("none", "moderate", "aggressive")
    }
    # every failure rate under every failure schedule, the fault-free runs once
    seeds = goodput["meta"]["chaos_seeds"]
    assert seeds == [7, 8]
    for failures in ("none", "moderate", "aggressive"):
        ran = Counter(r["chaos_seed"] for r in goodput["rows"] if r["failures"] == failures)
        assert ran == Counter([None] * 4 if failures == "none" else seeds * 4)
    columns = {
        "goodput",
        "goodput_merged",
        "uptime",
        "time_to_target_s",
        "heldout_loss",
        "work_lost",
    }
    assert columns <= goodput["rows"][0].keys()
    assert all(0.0 < r["goodput_merged"] <= 1.0 for r in goodput["rows"])
    assert (tmp_path / "goodput-quick.png").stat().st_size > 0

    assert [r["variant"] for r in quality["rows"]] == ["data_parallel", "decoupled K=1 grace"]
    assert quality["rows"][0]["vs_data_parallel"] == 0.0

    assert {(r["mode"], r["wire"]) for r in bandwidth["rows"]} == {
        ("data_parallel", "float32"),
        ("decoupled", "bfloat16"),
        ("decoupled", "int4 both ways"),
    }
    assert all(r["bytes_per_token"] > 0 for r in bandwidth["rows"])
    by_wire = {r["wire"]: r for r in bandwidth["rows"]}
    # 4 bits both ways: over 3x fewer bytes than bfloat16 (0.5625 against 2 bytes a parameter)
    assert by_wire["int4 both ways"]["bytes_per_token"] < by_wire["bfloat16"]["bytes_per_token"] / 3
    assert by_wire["bfloat16"]["bound_x"] == 2 * 8  # 8H / (2 + 2) at the quick model's H = 8
    assert by_wire["int4 both ways"]["gbps_for_goodput_0.95"] > 0
    assert bandwidth["meta"]["command"].startswith("python benchmarks/bandwidth.py --quick")
    assert "machine" in bandwidth["meta"]


def test_readme_results_are_generated_from_the_json():
    # Every results table in the README and docs/ (and docs/configuration.md, from the config
    # schema) is rebuilt from benchmarks/results/*.json; a table edited by hand, or JSON
    # regenerated without rerunning the generator, fails here.
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "readme_tables.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    # and every table the generator knows has its page under docs/results (none was dropped)
    blocks = [
        name
        for page in sorted((ROOT / "docs" / "results").glob("*.md"))
        for name in re.findall(r"<!-- results:(\w+) -->", page.read_text())
        if name != "headline"  # the README's table, from several JSON files
    ]
    tables = subprocess.run(
        [sys.executable, "-c", "import readme_tables; print(*sorted(readme_tables.TABLES))"],
        cwd=ROOT / "benchmarks",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert sorted(blocks) == tables.stdout.split(), tables.stderr


def test_sharded_learner_quick_reports_every_figure(tmp_path):
    # One learner over 4 emulated CPU devices (the script sets the count itself, over the
    # suite's 8): memory by layout, both loops' tokens/s, step times by kind, the learner
    # process's RSS; each figure with its goal in the table, and the plot.
    script = ROOT / "benchmarks" / "sharded_learner.py"
    subprocess.run(
        [sys.executable, str(script), "--quick", "--out", str(tmp_path)],
        check=True,
        cwd=ROOT,
        capture_output=True,
        timeout=300,
    )
    data = json.loads((tmp_path / "sharded_learner-quick.json").read_text())
    meta, summary = data["meta"], data["meta"]["summary"]
    assert meta["command"].startswith("python benchmarks/sharded_learner.py --quick")
    assert meta["data"]["command"].startswith("ray-diloco prepare-data --input")
    assert len(meta["devices"]) == 4
    for layout in ("sharded", "replicated"):  # the live arrays hold what the arithmetic says
        measured, arithmetic = (meta["memory"][layout][k] for k in ("measured", "arithmetic"))
        assert measured["total"] == arithmetic["total"] > 0, layout
    # alternately, the order swapped every pair
    order = ["bare", "ray-diloco", "ray-diloco", "bare", "bare", "ray-diloco"]
    assert [r["loop"] for r in meta["runs"]] == order
    assert len(summary["tokens_ratio_per_pair"]) == 3
    # H = 8, P = 2: every 4 steps one begins a fragment's copies and the next collects it
    kinds = summary["steps_by_kind"]
    assert kinds["begin"] == kinds["collect"] == kinds["none"] // 2 > 0
    child = meta["learner_process"]
    assert child["peak_rss"] > child["rss_runtime"] > 0
    assert child["base_values_alias_received"]
    goals = {r["measure"]: r["met"] for r in data["rows"] if r.get("goal")}
    assert len(goals) == 4 and set(goals.values()) <= {"met", "missed", "-"}
    assert (tmp_path / "sharded_learner-quick.md").read_text().startswith("# sharded_learner")
    assert (tmp_path / "sharded_learner-quick.png").stat().st_size > 0
