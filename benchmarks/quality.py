"""Quality at equal tokens: held-out loss of data-parallel, synchronous DiLoCo and Decoupled
DiLoCo variants with heterogeneous learners (half of them 18% slower, 10% per-step jitter), all
on the in-process reference run (`ray_diloco.sim.simulate`), which is deterministic for a seed.

The setting is `jobs/reference.yaml` (P = H = 24, tau = 2) with a smaller model and batch, so a
run has over 100 outer steps per fragment on this machine (`common.HORIZON`): a 3-layer,
64-wide model, sequences of 16 bytes, a global batch of 32 sequences split over the M learners
(8 each for M = 4), 1.28M tokens (2,500 inner steps). Every variant runs with `--seeds`
seeds (default 3: mean and spread), spread over `--jobs` processes. `--sweep` instead runs the
default variant with other outer optimizer settings (one seed each) and writes
quality_sweep.json.

    python benchmarks/quality.py --jobs 2           # the variants, 3 seeds each
    python benchmarks/quality.py --jobs 2 --seeds 1 # seed 0 only
    python benchmarks/quality.py --sweep --jobs 2   # the outer-optimizer sweep
    python benchmarks/quality.py --quick            # tiny model, smoke check
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from common import (
    GLOBAL_BATCH,
    HORIZON,
    QUICK_MODEL,
    REFERENCE,
    horizon_config,
    lower_priority,
    parser,
    run_parallel,
    write_results,
)

CONFIG = REFERENCE
SEEDS = (0, 1, 2)
QUICK_SEEDS = (0,)
DEFAULT = "decoupled K=1 grace"
# name -> (overrides, number of learners); runs start in this order (the comparisons the
# targets need first), every variant's seed 0 before any seed 1.
VARIANTS: dict[str, tuple[list[str], int]] = {
    "data_parallel": (["diloco.mode=data_parallel"], 4),
    DEFAULT: ([], 4),
    "synchronous": (["diloco.mode=synchronous"], 4),
    "decoupled K=1 no grace": (["diloco.grace_fraction=0"], 4),
    "decoupled K=1 grace, mean merge": (["diloco.merge=mean"], 4),
    "decoupled K=M": (["diloco.quorum_min=4"], 4),
    "decoupled K=1 grace, M=2": ([], 2),
    "decoupled K=1 grace, M=8": ([], 8),
}
# The outer optimizer of the default variant (M = 4), one seed: `--sweep`.
SWEEP: dict[str, list[str]] = {
    f"lr {lr}, momentum {m}": [f"outer.lr={lr}", f"outer.momentum={m}"]
    for lr in (0.7, 1.0, 1.4)
    for m in (0.8, 0.9, 0.95)
}
SWEEP["lr 1.0, momentum 0.9, warm-up 10"] = [
    "outer.lr=1.0",
    "outer.momentum=0.9",
    "outer.momentum_warmup_steps=10",
]


def run_one(job: tuple[str, list[str], int, int, bool]) -> dict[str, Any]:
    from ray_diloco.sim.simulate import run_reference

    name, overrides, num_learners, seed, quick = job
    lower_priority()
    t0 = time.perf_counter()
    s = run_reference(horizon_config(overrides, num_learners, seed, quick))
    return _report(
        {
            "variant": name,
            "seed": seed,
            "heldout_loss": s["heldout_loss"],
            "tokens": s["tokens"],
            "rounds": s.get("rounds", 0),
            "mean_contributors": s.get("mean_contributors", 0.0),
            "refused": sum(s.get("rejected", {}).values()),
            "refused_by_reason": s.get("rejected", {}),
            "bytes_per_token": s["bytes_per_token"],
            "wall_s": time.perf_counter() - t0,
            "evals": s["evals"],
        }
    )


def _report(r: dict[str, Any]) -> dict[str, Any]:
    print(
        f"{r['variant']} (seed {r['seed']}): held-out {r['heldout_loss']:.4f}, "
        f"refused {r['refused']} ({r['wall_s']:.0f}s)",
        flush=True,
    )
    return r


def summarize(runs: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """Per variant: mean held-out loss over its seeds, spread (max - min), mean figures."""
    rows = []
    for name in names:
        mine = [r for r in runs if r["variant"] == name]
        if not mine:
            continue
        losses = [r["heldout_loss"] for r in mine]
        rows.append(
            {
                "variant": name,
                "seeds": len(mine),
                "heldout_loss": statistics.fmean(losses),
                "spread": max(losses) - min(losses),
                "losses": losses,
                "rounds": statistics.fmean(r["rounds"] for r in mine),
                "mean_contributors": statistics.fmean(r["mean_contributors"] for r in mine),
                "refused": [r["refused"] for r in mine],
                "bytes_per_token": statistics.fmean(r["bytes_per_token"] for r in mine),
                "wall_s": statistics.fmean(r["wall_s"] for r in mine),
            }
        )
    dp = next((r["heldout_loss"] for r in rows if r["variant"] == "data_parallel"), None)
    sync = next((r["heldout_loss"] for r in rows if r["variant"] == "synchronous"), None)
    for r in rows:
        r["vs_data_parallel"] = r["heldout_loss"] / dp - 1 if dp else None
        r["vs_synchronous"] = r["heldout_loss"] / sync - 1 if sync else None
    return rows


def plot(runs: list[dict[str, Any]], names: list[str], path: Path) -> None:
    """Held-out loss over tokens, seed 0 of each variant (the tail, where they differ)."""
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for name in names:
        first = next((r for r in runs if r["variant"] == name), None)
        if first is None:
            continue
        evals = first["evals"][2:]
        ax.plot([e["tokens"] for e in evals], [e["heldout_loss"] for e in evals], label=name)
    ax.set_xlabel("tokens trained")
    ax.set_ylabel("held-out loss of the global parameters (nats/byte)")
    ax.set_title(f"seed {runs[0]['seed']}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", help="subset of variants (or of sweep points)")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time, one process each")
    p.add_argument("--sweep", action="store_true", help="the outer-optimizer sweep instead")
    p.add_argument("--seeds", type=int, default=len(SEEDS), help="seeds per variant (from 0)")
    args = p.parse_args()
    seeds = QUICK_SEEDS if args.quick else SEEDS[: args.seeds]
    if args.sweep:
        points = {n: (ov, 4) for n, ov in SWEEP.items()}
        seeds = seeds[:1]
    else:
        points = VARIANTS
    jobs = [
        (name, overrides, num, seed, args.quick)
        for seed in seeds
        for name, (overrides, num) in points.items()
        if not args.only or name in args.only
    ]
    name = "quality" + ("_sweep" if args.sweep else "") + ("-quick" if args.quick else "")
    args.out.mkdir(parents=True, exist_ok=True)
    columns = [
        "variant",
        "seeds",
        "heldout_loss",
        "spread",
        "vs_data_parallel",
        "vs_synchronous",
        "rounds",
        "mean_contributors",
        "refused",
        "bytes_per_token",
    ]

    def save(runs: list[dict[str, Any]]) -> None:
        """Write what has finished (the JSON says how many of the planned runs)."""
        if not args.sweep:
            plot(runs, list(points), args.out / f"{name}.png")
        meta = {
            "config": CONFIG.name,
            "setting": [*QUICK_MODEL, "token_budget=60000"] if args.quick else HORIZON,
            "global_batch": GLOBAL_BATCH,
            "quick": args.quick,
            "default": DEFAULT,
            "variants": list(points),
            "runs_planned": len(jobs),
            "runs_done": len(runs),
            "runs": runs,
        }
        write_results(args.out, name, summarize(runs, list(points)), columns, meta)

    run_parallel(run_one, jobs, args.jobs, save)


if __name__ == "__main__":
    main()
