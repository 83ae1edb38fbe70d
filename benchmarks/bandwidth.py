"""Bandwidth: bytes per token over the learner-synchronizer links against data-parallel training,
per mode and wire (upstream contributions / downstream publications), with the held-out loss
of each run, at the quality setting (benchmarks/common.py: over 100 outer steps per fragment)
with H = 24 (P = 24, tau = 2) and with the cluster config's H = 100 (P = 25, tau = 5).

Data-parallel moves 2 x 4 bytes per parameter per step per learner (ring all-reduce of float32
gradients); DiLoCo at least one fragment up and one down per learner every H steps, so its
ratio is at most 8H / (b_up + b_down) with b the bytes per parameter of each direction's wire
(scales included): the `bound` column. Every run is the in-process reference run.

Then, on `jobs/reference.yaml` at 200k tokens: the link bandwidth each mode needs for
goodput >= 0.95, found by bisecting an emulated link (every learner behind one WAN link, 1 ms
latency). Data-parallel and synchronous lose time waiting on the link; a decoupled learner
never waits, so a too-slow link shows instead as work that does not reach the global model:
its goodput is the time-based one times the tokens merged per fragment relative to the same
run on an unconstrained link.

    python benchmarks/bandwidth.py --jobs 2
    python benchmarks/bandwidth.py --quick
"""

from __future__ import annotations

import math
import time
from typing import Any

from ray_diloco.algorithm import wire
from ray_diloco.config import WireDtype, load_config
from ray_diloco.sim.simulate import run_reference

from common import (
    H100,
    QUICK_MODEL,
    REFERENCE,
    horizon_config,
    lower_priority,
    parser,
    run_parallel,
    write_results,
)

MODES = {
    "data_parallel": ["diloco.mode=data_parallel"],
    "synchronous": ["diloco.mode=synchronous"],
    "decoupled": [],
}
# (upstream wire, downstream wire) per H; data-parallel all-reduces float32 gradients. The
# 2-bit wires (where quality is expected to break) run at H = 24 only, synchronous DiLoCo in
# bfloat16 at H = 24 only: a full set (16 runs of the quality setting) does not fit this
# machine's time.
BF16: tuple[WireDtype, WireDtype] = ("bfloat16", "bfloat16")
WIRES: dict[int, list[tuple[WireDtype, WireDtype]]] = {
    24: [BF16, ("int4", "int4"), ("int4", "int2"), ("int2", "int2")],
    100: [BF16, ("int4", "int4")],
}
SYNC_EVERY = {24: [], 100: H100}
BLOCK = 64  # diloco.int4_block_size
TARGET = 0.95
# Homogeneous learners behind one link with 1 ms latency for the bisection: the bandwidth is the
# only constraint (an 18% slower learner alone caps a barrier's goodput at ~0.85).
WAN = [f"learners.{i}.{k}" for i in range(4) for k in ("region=wan", "speed=1", "jitter=0")]


def bytes_per_param(dtype: WireDtype) -> float:
    """Wire bytes per parameter of a large leaf (scales included)."""
    n = BLOCK * 1024
    return wire.wire_bytes(n, dtype, BLOCK) / n


def bound(h: int, up: WireDtype, down: WireDtype) -> float:
    return 8 * h / (bytes_per_param(up) + bytes_per_param(down))


def measure(job: tuple[str, int, WireDtype, WireDtype, bool]) -> dict[str, Any]:
    mode, h, up, down, quick = job
    lower_priority()
    dp = mode == "data_parallel"
    wires = [] if dp else [f"diloco.wire_dtype={up}", f"diloco.publish_dtype={down}"]
    t0 = time.perf_counter()
    s = run_reference(horizon_config([*MODES[mode], *SYNC_EVERY[h], *wires], quick=quick))
    row = {
        "mode": mode,
        "H": None if dp else h,  # data-parallel has no H: one run serves every H
        "up": "float32" if dp else up,
        "down": "float32" if dp else down,
        "bytes_per_token": s["bytes_per_token"],
        "x_fewer_than_dp": s["dp_bytes_per_token"] / s["bytes_per_token"],
        "bound": None if dp else bound(h, up, down),
        "heldout_loss": s["heldout_loss"],
        "refused": sum(s.get("rejected", {}).values()),
        "wall_s": time.perf_counter() - t0,
    }
    print(row, flush=True)
    return row


def run(overrides: list[str], quick: bool, budget: int) -> dict[str, Any]:
    base = [*(QUICK_MODEL if quick else []), f"token_budget={budget}", "run_dir=/tmp/bw"]
    return run_reference(load_config(REFERENCE, [*base, *overrides]))


def goodput_at(mode: str, gbps: float, quick: bool, budget: int, free: dict[str, Any]) -> float:
    link = [*WAN, f"links.wan.bandwidth_gbps={gbps}", "links.wan.latency_ms=1"]
    s = run([*MODES[mode], *link], quick, budget)
    if mode == "decoupled":
        return s["goodput"] * min(1.0, s["tokens_merged"] / free["tokens_merged"])
    return float(s["goodput"])


def needed_bandwidth(job: tuple[str, bool, int]) -> float:
    """Smallest bandwidth (Gbps, within 10%; within 2x for --quick) at which goodput >=
    TARGET, by bisection on a log scale between 1 Mbps and 100 Gbps."""
    mode, quick, budget = job
    lower_priority()
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
    print(f"{mode}: needs {math.exp(hi):.4g} Gbps for goodput >= {TARGET}", flush=True)
    return math.exp(hi)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=1, help="runs at a time, one process each")
    args = p.parse_args()
    # The runs the targets need first: 4-bit both ways against bfloat16 at H = 100 and 24.
    jobs: list[tuple[str, int, WireDtype, WireDtype, bool]] = []
    for h in sorted(WIRES, reverse=True):
        if args.quick and h == 100:  # the quick model has too few leaves for P = 25
            continue
        jobs += [("decoupled", h, *w, args.quick) for w in (("int4", "int4"), BF16)]
    jobs += [("data_parallel", 24, "float32", "float32", args.quick)]
    jobs += [("synchronous", 24, *BF16, args.quick)]
    jobs += [("decoupled", 24, up, down, args.quick) for up, down in WIRES[24][2:]]
    name = "bandwidth-quick" if args.quick else "bandwidth"
    sweep_budget = 40_000 if args.quick else 200_000
    columns = [
        "mode",
        "H",
        "up",
        "down",
        "bytes_per_token",
        "x_fewer_than_dp",
        "bound",
        "heldout_loss",
        "loss_vs_bf16",
        "refused",
    ]

    def save(rows: list[dict[str, Any]], need: dict[str, float] | None = None) -> None:
        """Write what has finished (the JSON says how many of the planned runs)."""
        for r in rows:
            ref = [
                x["heldout_loss"]
                for x in rows
                if (x["mode"], x["H"]) == (r["mode"], r["H"]) and x["up"] in ("bfloat16", "float32")
            ]
            r["loss_vs_bf16"] = r["heldout_loss"] / ref[0] - 1 if ref else None
        meta = {
            "config": REFERENCE.name,
            "quick": args.quick,
            "runs_planned": len(jobs),
            "runs_done": len(rows),
            "sweep_budget": sweep_budget,
            "needs_gbps": need,
            "latency_ms": 1,
        }
        write_results(args.out, name, rows, columns, meta)

    rows = run_parallel(measure, jobs, args.jobs, save)
    needs = run_parallel(
        needed_bandwidth, [(m, args.quick, sweep_budget) for m in MODES], args.jobs
    )
    save(rows, dict(zip(MODES, needs, strict=True)))


if __name__ == "__main__":
    main()
