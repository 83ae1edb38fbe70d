"""Outer step rules for stale and partial rounds: held-out loss of the decoupled run with each
combination of `diloco.anchor` (current: G_now - theta; base: the learner's own update),
`diloco.round_step` (full: every round a whole outer step; share: a fraction of one, the share
of a full round's tokens it merged) and `diloco.publish_to` (all, contributors), for K = 1
without and with grace and K = M, on the quality setting (benchmarks/common.py) at half its
tokens (640k, about 52 outer steps per fragment), seed 0. The default is the best of these.

    python benchmarks/outer_rules.py --jobs 2
"""

from __future__ import annotations

import math
import time
from typing import Any

from ray_diloco.sim.simulate import run_reference

from common import horizon_config, lower_priority, parser, run_parallel, write_results

BUDGET = 640_000
QUORUMS = {
    "K=1 no grace": ["diloco.grace_fraction=0"],
    "K=1 grace": [],
    "K=M": ["diloco.quorum_min=4"],
}
REFERENCES = {
    "data_parallel": ["diloco.mode=data_parallel"],
    "synchronous": ["diloco.mode=synchronous"],
}


def grid() -> dict[str, list[str]]:
    out = dict(REFERENCES)
    for quorum, overrides in QUORUMS.items():
        for anchor in ("current", "base"):
            # With K = M every round merges every learner: one step each, the same recipients.
            for step in ("full", "share") if quorum != "K=M" else ("full",):
                for to in ("all", "contributors") if quorum != "K=M" else ("all",):
                    rule = [f"diloco.anchor={anchor}", f"diloco.round_step={step}"]
                    rule.append(f"diloco.publish_to={to}")
                    out[f"{quorum}, {anchor}, {step}, {to}"] = [*overrides, *rule]
    return out


def run(job: tuple[str, list[str], bool]) -> dict[str, Any]:
    name, overrides, quick = job
    lower_priority()
    budget = 40_000 if quick else BUDGET
    t0 = time.perf_counter()
    s = run_reference(horizon_config([*overrides, f"token_budget={budget}"], quick=quick))
    loss = s["heldout_loss"]
    row = {
        "rule": name,
        "heldout_loss": loss if math.isfinite(loss) else None,
        "rounds": s.get("rounds", 0),
        "mean_contributors": s.get("mean_contributors", 0.0),
        "refused": sum(s.get("rejected", {}).values()),
        "bytes_per_token": s["bytes_per_token"],
        "wall_s": time.perf_counter() - t0,
    }
    print(row, flush=True)
    return row


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=1, help="runs at a time, one process each")
    args = p.parse_args()
    rules = grid()
    rows = run_parallel(run, [(n, ov, args.quick) for n, ov in rules.items()], args.jobs)
    dp = rows[0]["heldout_loss"]
    for r in rows:
        r["vs_data_parallel"] = r["heldout_loss"] / dp - 1 if r["heldout_loss"] else None
    name = "outer_rules-quick" if args.quick else "outer_rules"
    columns = ["rule", "heldout_loss", "vs_data_parallel", "rounds", "mean_contributors"]
    write_results(
        args.out, name, rows, [*columns, "refused"], {"budget": BUDGET, "quick": args.quick}
    )


if __name__ == "__main__":
    main()
