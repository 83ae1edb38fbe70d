"""How often a finished run's learners were called slow: by the supervisor's degradation
monitor (its `learner_degraded` events on the tape, per cause) and by the live display's flag
(`slow` in the progress points of metrics.jsonl, observe/progress.py). Reads a run dir; run
`ray-diloco train --config jobs/local.yaml` first (a fault-free run: nobody is slower than
configured).

  python benchmarks/slow_flag.py runs/local
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

from benchmarks.common import RESULTS, write_results
from ray_diloco.control.events import LearnerDegraded
from ray_diloco.control.tape import read_tape


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    summary = json.loads((args.run_dir / "summary.json").read_text())
    events = read_tape(args.run_dir / "events.jsonl")
    degraded = [e for e in events if isinstance(e, LearnerDegraded)]
    by_cause = collections.Counter(e.cause for e in degraded)
    points = [json.loads(ln) for ln in (args.run_dir / "metrics.jsonl").read_text().splitlines()]
    rows_flagged = sum(ls.get("slow", False) for p in points for ls in p["learners"].values())
    learner_rows = sum(len(p["learners"]) for p in points)
    rows = [
        {
            "measure": "run: tokens, wall s, held-out loss",
            "value": f"{summary['tokens']:,}, "
            f"{summary['wall_time_s']:.0f}, {summary['heldout_loss']:.4f}",
        },
        {"measure": "faults injected", "value": len(summary.get("faults", []))},
        {"measure": "learner_degraded events (supervisor)", "value": len(degraded)},
        *({"measure": f"  of which {cause}", "value": n} for cause, n in sorted(by_cause.items())),
        {"measure": "learner rows of progress points", "value": learner_rows},
        {"measure": "rows the display flags slow", "value": rows_flagged},
    ]
    meta = {"run_dir": str(args.run_dir), "config": summary.get("mode")}
    write_results(args.out, "slow_flag", rows, ["measure", "value"], meta)


if __name__ == "__main__":
    main()
