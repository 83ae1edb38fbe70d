"""Bandwidth: bytes per token over the learner-synchronizer links per mode and wire dtype, and
the link bandwidth each mode needs to keep goodput >= 0.95, found by bisecting the emulated
link (every learner behind one WAN link of the swept bandwidth, 1 ms latency). All on the
in-process reference run (virtual clock, `step_time_s` per inner step).

Goodput here: data-parallel and synchronous lose time waiting on the link (time-based, as the
reference run reports it). A decoupled learner never waits, so a too-slow link shows instead as
work that does not reach the global model: its goodput is the time-based one times the tokens
merged per fragment relative to the same run on an unconstrained link.

    python benchmarks/bandwidth.py            # jobs/reference.yaml
    python benchmarks/bandwidth.py --quick
"""

from __future__ import annotations

import math
from typing import Any

from ray_diloco.config import load_config
from ray_diloco.sim.simulate import run_reference

from common import QUICK_MODEL, REFERENCE, cache_compilations, parser, write_results

CONFIG = REFERENCE
QUICK = QUICK_MODEL
# Homogeneous learners behind one link with 1 ms latency: the bandwidth is the only constraint
# (an 18% slower learner alone caps a barrier's goodput at ~0.85 whatever the link).
WAN = [f"learners.{i}.{k}" for i in range(4) for k in ("region=wan", "speed=1", "jitter=0")]
MODES = {
    "data_parallel": ["diloco.mode=data_parallel"],
    "synchronous": ["diloco.mode=synchronous"],
    "decoupled": [],
    "decoupled, publish to contributors": ["diloco.publish_to=contributors"],
}
TARGET = 0.95


def run(overrides: list[str], quick: bool, budget: int) -> dict[str, Any]:
    base = [*(QUICK if quick else []), f"token_budget={budget}", "run_dir=/tmp/ray_diloco-bw"]
    return run_reference(load_config(CONFIG, [*base, *overrides]))


def goodput_at(mode: str, gbps: float, quick: bool, budget: int, free: dict[str, Any]) -> float:
    link = [*WAN, f"links.wan.bandwidth_gbps={gbps}", "links.wan.latency_ms=1"]
    s = run([*MODES[mode], *link], quick, budget)
    if mode.startswith("decoupled"):
        return s["goodput"] * min(1.0, s["tokens_merged"] / free["tokens_merged"])
    return float(s["goodput"])


def needed_bandwidth(mode: str, quick: bool, budget: int) -> float:
    """Smallest bandwidth (Gbps, within 10%; within 2x for --quick) at which goodput >=
    TARGET, by bisection on a log scale between 1 Mbps and 100 Gbps."""
    free = run([*MODES[mode], *WAN], quick, budget)  # region without a link: unconstrained
    lo, hi = math.log(1e-3), math.log(100.0)
    if goodput_at(mode, math.exp(hi), quick, budget, free) < TARGET:
        return math.inf
    while hi - lo > math.log(2.0 if quick else 1.1):
        mid = (lo + hi) / 2
        if goodput_at(mode, math.exp(mid), quick, budget, free) >= TARGET:
            hi = mid
        else:
            lo = mid
    return math.exp(hi)


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    cache_compilations()
    budget = 60_000 if args.quick else 500_000
    sweep_budget = 40_000 if args.quick else 200_000
    rows = []
    for mode, overrides in MODES.items():
        for wire in ("bfloat16", "int4") if mode != "data_parallel" else ("float32",):
            s = run([*overrides, f"diloco.wire_dtype={wire}"], args.quick, budget)
            rows.append(
                {
                    "mode": mode,
                    "wire": wire,
                    "bytes_per_token": s["bytes_per_token"],
                    "x_fewer_than_dp": s["dp_bytes_per_token"] / s["bytes_per_token"],
                    "heldout_loss": s["heldout_loss"],
                }
            )
            print(rows[-1], flush=True)
        need = needed_bandwidth(mode, args.quick, sweep_budget)
        for r in rows:
            if r["mode"] == mode:
                r["gbps_for_goodput_0.95"] = need
        print(f"{mode}: needs {need:.4g} Gbps for goodput >= {TARGET}", flush=True)
    bf16 = {r["mode"]: r["heldout_loss"] for r in rows if r["wire"] == "bfloat16"}
    for r in rows:
        r["loss_vs_bf16"] = r["heldout_loss"] / bf16[r["mode"]] - 1 if r["mode"] in bf16 else None
    name = "bandwidth-quick" if args.quick else "bandwidth"
    columns = [
        "mode",
        "wire",
        "bytes_per_token",
        "x_fewer_than_dp",
        "heldout_loss",
        "loss_vs_bf16",
        "gbps_for_goodput_0.95",
    ]
    write_results(
        args.out,
        name,
        rows,
        columns,
        {
            "config": CONFIG.name,
            "quick": args.quick,
            "budget": budget,
            "sweep_budget": sweep_budget,
            "latency_ms": 1,
        },
    )


if __name__ == "__main__":
    main()
