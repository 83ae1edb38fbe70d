"""Bandwidth: bytes per token over the learner-synchronizer links per mode and wire (up and
down), against data-parallel and against the arithmetic bound 8H / (b_up + b_down), with the
held-out loss beside each; at the reference config's H = 24 and the cluster config's H = 100;
and the link bandwidth each mode needs to keep goodput >= 0.95, found by bisecting the emulated
link (every learner behind one WAN link of the swept bandwidth, 1 ms latency). All on the
in-process reference run (virtual clock, `step_time_s` per inner step).

The bound: per learner and H inner steps, data-parallel's ring all-reduce moves 2 x 4 bytes
per parameter per step (8H), DiLoCo every fragment once up and, at best, once down (b_up +
b_down bytes per parameter: float32 4, bfloat16 2, int4 0.5625 and int2 0.3125 with their
blockwise scales). `publish_to: all` sends more than one round down per window.

H = 100 (jobs/cluster-*.yaml: P = 25, tau = 5) needs more inner steps than the reference's 2M
tokens at 32 sequences per learner give (2.4 syncs per fragment): those rows train 8 sequences
per learner for 2M tokens (about 10 syncs per fragment), and data-parallel's bytes per token
are counted at that batch.

Goodput here: data-parallel and synchronous lose time waiting on the link (time-based, as the
reference run reports it). A decoupled learner never waits, so a too-slow link shows instead as
work that does not reach the global model: its goodput is the time-based one times the tokens
merged per fragment relative to the same run on an unconstrained link.

    python benchmarks/bandwidth.py --jobs 2   # jobs/reference.yaml
    python benchmarks/bandwidth.py --quick
"""

from __future__ import annotations

import math
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any

from ray_diloco.algorithm.wire import wire_bytes
from ray_diloco.config import load_config
from ray_diloco.sim.simulate import run_reference

from common import (
    GRACE,
    OFFERS_K2,
    QUICK_MODEL,
    REFERENCE,
    cache_compilations,
    parser,
    write_results,
)

CONFIG = REFERENCE
QUICK = QUICK_MODEL
# Homogeneous learners behind one link with 1 ms latency: the bandwidth is the only constraint
# (an 18% slower learner alone caps a barrier's goodput at ~0.85 whatever the link).
WAN = [f"learners.{i}.{k}" for i in range(4) for k in ("region=wan", "speed=1", "jitter=0")]
MODES = {
    "data_parallel": ["diloco.mode=data_parallel"],
    "synchronous": ["diloco.mode=synchronous"],
    # the job files' rule before pulled rounds: learners' own offers, K = 2 without the window
    "decoupled": OFFERS_K2,
    # the rule before that: K = 1 with the grace window
    "decoupled K=1": [*OFFERS_K2, "diloco.quorum_min=1", *GRACE],
    "decoupled, publish to contributors": [*OFFERS_K2, "diloco.publish_to=contributors"],
    # the config's defaults: rounds pulled by the synchronizer, K = 1, unsent work kept
    "decoupled, pulled (default)": [],
}
# wire label -> (upstream dtype, publish_delta)
WIRES = {
    "bfloat16": ("bfloat16", "none"),
    "int4 up": ("int4", "none"),
    "int4 both ways": ("int4", "int4"),
    "int2 both ways": ("int2", "int2"),
}
H24 = {
    "data_parallel": ["float32"],
    "synchronous": ["bfloat16", "int4 up", "int4 both ways"],
    "decoupled": ["bfloat16", "int4 up", "int4 both ways", "int2 both ways"],
    "decoupled K=1": ["int4 both ways"],
    "decoupled, publish to contributors": ["bfloat16", "int4 both ways"],
    "decoupled, pulled (default)": ["int4 both ways"],
}
# --quick (a smoke check of every path, for the test suite): fewer rows.
QUICK_ROWS = {"data_parallel": ["float32"], "decoupled": ["bfloat16", "int4 both ways"]}
H100 = {
    "decoupled": ["bfloat16", "int4 both ways"],
    "decoupled, publish to contributors": ["int4 both ways"],
}
H100_SETTING = [
    "diloco.sync_every=100",
    "diloco.num_fragments=25",
    "diloco.overlap_steps=5",
    *[f"learners.{i}.batch_size=8" for i in range(4)],
]
TARGET = 0.95
BYTES_PER_PARAM = {"float32": 4.0, "bfloat16": 2.0}


def run(overrides: list[str], quick: bool, budget: int) -> dict[str, Any]:
    cache_compilations()
    base = [*(QUICK if quick else []), f"token_budget={budget}", "run_dir=/tmp/ray_diloco-bw"]
    return run_reference(load_config(CONFIG, [*base, *overrides]))


def _per_param(dtype: str) -> float:
    """Bytes per parameter of a large tensor on this wire (scales included)."""
    n = 1 << 20
    return BYTES_PER_PARAM.get(dtype) or wire_bytes(n, dtype, 64) / n  # type: ignore[arg-type]


def measure(job: tuple[str, str, str, bool, int]) -> dict[str, Any]:
    mode, wire, setting, quick, budget = job
    overrides = [*MODES[mode], *(H100_SETTING if setting == "H=100" else [])]
    sync_every = load_config(CONFIG, [*(QUICK if quick else []), *overrides]).diloco.sync_every
    if mode != "data_parallel":
        up, delta = WIRES[wire]
        overrides += [f"diloco.wire_dtype={up}", f"diloco.publish_delta={delta}"]
        down = up if delta != "none" else ("float32" if up == "float32" else "bfloat16")
        bound = 8 * sync_every / (_per_param(up) + _per_param(down))
    else:
        bound = 1.0
    s = run(overrides, quick, budget)
    return {
        "mode": mode,
        "wire": wire,
        "setting": setting,
        "bytes_per_token": s["bytes_per_token"],
        "x_fewer_than_dp": s["dp_bytes_per_token"] / s["bytes_per_token"],
        "bound_x": bound,
        "heldout_loss": s["heldout_loss"],
        "rounds": s.get("rounds", 0),
    }


def goodput_at(
    mode: str, overrides: list[str], gbps: float, quick: bool, budget: int, free: Any
) -> float:
    link = [*WAN, f"links.wan.bandwidth_gbps={gbps}", "links.wan.latency_ms=1"]
    s = run([*overrides, *link], quick, budget)
    if mode.startswith("decoupled"):
        return s["goodput"] * min(1.0, s["tokens_merged"] / free["tokens_merged"])
    return float(s["goodput"])


def needed_bandwidth(job: tuple[str, str, bool, int]) -> tuple[str, str, float]:
    """Smallest bandwidth (Gbps, within 10%; within 4x for --quick) at which goodput >=
    TARGET, by bisection on a log scale between 1 Mbps and 100 Gbps."""
    mode, wire, quick, budget = job
    overrides = list(MODES[mode])
    if mode != "data_parallel":
        up, delta = WIRES[wire]
        overrides += [f"diloco.wire_dtype={up}", f"diloco.publish_delta={delta}"]
    free = run([*overrides, *WAN], quick, budget)  # region without a link: unconstrained
    lo, hi = math.log(1e-3), math.log(100.0)
    if goodput_at(mode, overrides, math.exp(hi), quick, budget, free) < TARGET:
        return mode, wire, math.inf
    while hi - lo > math.log(4.0 if quick else 1.1):
        mid = (lo + hi) / 2
        if goodput_at(mode, overrides, math.exp(mid), quick, budget, free) >= TARGET:
            hi = mid
        else:
            lo = mid
    return mode, wire, math.exp(hi)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=1, help="runs side by side (processes)")
    args = p.parse_args()
    budget = 30_000 if args.quick else 500_000
    h100_budget = 30_000 if args.quick else 2_000_000
    sweep_budget = 20_000 if args.quick else 200_000
    rows_h24 = QUICK_ROWS if args.quick else H24
    jobs = [(m, w, "H=24", args.quick, budget) for m, ws in rows_h24.items() for w in ws]
    if not args.quick:
        jobs += [(m, w, "H=100", args.quick, h100_budget) for m, ws in H100.items() for w in ws]
    sweeps = [("decoupled", "int4 both ways", args.quick, sweep_budget)]
    if not args.quick:  # --quick: one sweep checks the path
        sweeps += [
            (m, w, False, sweep_budget)
            for m, ws in rows_h24.items()
            for w in ws
            if w in ("float32", "bfloat16")
        ]
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        need_runs = [pool.submit(needed_bandwidth, job) for job in sweeps]
        rows = list(pool.map(measure, jobs))
        needs = {(m, w): g for m, w, g in (f.result() for f in need_runs)}
    bf16 = {(r["mode"], r["setting"]): r["heldout_loss"] for r in rows if r["wire"] == "bfloat16"}
    for r in rows:
        ref = bf16.get((r["mode"], r["setting"]))
        r["loss_vs_bf16"] = r["heldout_loss"] / ref - 1 if ref else None
        swept = r["setting"] == "H=24"  # the sweeps run the reference config
        r["gbps_for_goodput_0.95"] = needs.get((r["mode"], r["wire"])) if swept else None
    name = "bandwidth-quick" if args.quick else "bandwidth"
    columns = [
        "mode",
        "wire",
        "setting",
        "bytes_per_token",
        "x_fewer_than_dp",
        "bound_x",
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
            "h100_budget": h100_budget,
            "h100_setting": H100_SETTING,
            "sweep_budget": sweep_budget,
            "latency_ms": 1,
        },
    )


if __name__ == "__main__":
    main()
