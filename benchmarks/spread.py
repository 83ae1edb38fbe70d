"""Spread of held-out loss over identical local Ray runs, and the refusals behind it.

Runs the main command's job (`jobs/local.yaml`: 4 CPU learners, an emulated WAN link, K = 2
without the grace window)
`--runs` times, each on its own embedded Ray, and records each run's held-out loss and the
contributions the synchronizer refused, by reason (`norm_outlier` are the norm guard's). Ray
runs are not step-for-step identical (arrival order follows the wall clock), so some spread
is expected; a guard that refuses honest work makes it large (the issue measured 2.71 to 3.29
with 18 to 37 refusals).

`--checkout DIR` runs another checkout's code and `jobs/local.yaml` (e.g. a worktree of an
older commit, to measure "before"); `--label` names the set of runs. spread.json keeps the runs
of every label (a rerun replaces its own label's), so before and after sit side by side.

  python benchmarks/spread.py --label after
  git worktree add /tmp/before <commit> && python benchmarks/spread.py --checkout /tmp/before \
      --label before
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import parser, write_results

ROOT = Path(__file__).resolve().parents[1]
CLI = "import sys; from ray_diloco.cli import main; sys.exit(main())"
COLUMNS = ["label", "commit", "run", "heldout_loss", "norm_outlier", "refused", "tokens", "wall_s"]


def one_run(checkout: Path, run_dir: Path, extra: list[str]) -> dict[str, Any]:
    """One `ray-diloco train` of the checkout's jobs/local.yaml, as a fresh process and Ray."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    cmd = [sys.executable, "-c", CLI, "train", "--config", "jobs/local.yaml"]
    cmd += ["--set", f"run_dir={run_dir}", *extra]
    started = time.monotonic()
    subprocess.run(cmd, cwd=checkout, env=env, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((run_dir / "summary.json").read_text())
    rejected: dict[str, int] = summary.get("rejected", {})
    return {
        "heldout_loss": round(float(summary["heldout_loss"]), 4),
        "norm_outlier": int(rejected.get("norm_outlier", 0)),
        "refused": int(sum(rejected.values())),
        "refused_by_reason": rejected,
        "tokens": int(summary["tokens"]),
        "wall_s": round(time.monotonic() - started, 1),
    }


def commit_of(checkout: Path) -> str:
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True
    )
    return done.stdout.strip() or "unknown"


def label_stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    losses = [r["heldout_loss"] for r in rows]
    return {
        "runs": len(rows),
        "mean": round(statistics.mean(losses), 4),
        "min": min(losses),
        "max": max(losses),
        "spread": round(max(losses) - min(losses), 4),
        "norm_outlier_total": sum(r["norm_outlier"] for r in rows),
    }


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--label", default="after", help="name of this set of runs in spread.json")
    p.add_argument("--checkout", type=Path, default=ROOT, help="the code to run (a checkout)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args()
    if args.quick:  # a smoke setting: two short runs
        args.runs = min(args.runs, 2)
        args.overrides.append("token_budget=60000")
    checkout = args.checkout.resolve()
    extra = [x for o in args.overrides for x in ("--set", o)]
    commit = commit_of(checkout)
    rows = []
    with tempfile.TemporaryDirectory(prefix="spread-") as tmp:
        for i in range(args.runs):
            row = one_run(checkout, Path(tmp) / f"run{i}", extra)
            rows.append({"label": args.label, "commit": commit, "run": i + 1, **row})
            print(
                f"{args.label} run {i + 1}: held-out {row['heldout_loss']}, refused "
                f"{row['refused_by_reason']}, {row['wall_s']} s",
                flush=True,
            )
    previous = args.out / "spread.json"
    kept: list[dict[str, Any]] = []
    labels: dict[str, Any] = {}
    if previous.exists() and not args.quick:
        old = json.loads(previous.read_text())
        kept = [r for r in old["rows"] if r["label"] != args.label]
        labels = {k: v for k, v in old["meta"].get("labels", {}).items() if k != args.label}
    command = " ".join(["python benchmarks/spread.py", *sys.argv[1:]])
    labels[args.label] = {"commit": commit, "command": command, **label_stats(rows)}
    for label, stats in labels.items():
        print(
            f"{label} ({stats['commit']}): mean {stats['mean']}, spread {stats['spread']} "
            f"over {stats['runs']} runs, {stats['norm_outlier_total']} norm_outlier refusals"
        )
    write_results(args.out, "spread", kept + rows, COLUMNS, {"labels": labels})


if __name__ == "__main__":
    main()
