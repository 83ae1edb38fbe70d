"""Quality at equal tokens: held-out loss of data-parallel, synchronous DiLoCo and Decoupled
DiLoCo variants with heterogeneous learners (two 18% slower, 10% per-step jitter), all on the
in-process reference run (`ray_diloco.sim.simulate`), which is deterministic for a seed.

    python benchmarks/quality.py            # jobs/reference.yaml, 2M tokens per variant
    python benchmarks/quality.py --quick    # tiny model, smoke check
    python benchmarks/quality.py --jobs 2   # two variants at a time
    python benchmarks/quality.py --plot     # redraw quality.png from quality.json, run nothing
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from ray_diloco.config import load_config
from ray_diloco.sim.simulate import run_reference

from common import (
    AS_WRITTEN,
    DEFAULT,
    DEFAULT_K2,
    DEFAULT_ROW,
    FRACTION_STEP,
    K2,
    MIX,
    NO_GRACE,
    PULLED,
    QUICK_MODEL,
    REFERENCE,
    both_ways,
    parser,
    plot_loss_curves,
    write_results,
)

CONFIG = REFERENCE
QUICK = [*QUICK_MODEL, "token_budget=60000"]
# Every variant names what it changes from AS_WRITTEN (the default config's rows: common.py).
VARIANTS: dict[str, list[str]] = {
    "data_parallel": ["diloco.mode=data_parallel"],
    "synchronous": ["diloco.mode=synchronous"],
    "decoupled K=M": ["diloco.quorum_min=4"],
    "decoupled K=1 no grace": ["diloco.grace_fraction=0"],
    "decoupled K=1 grace": [],
    "decoupled K=1 grace, mean merge": ["diloco.merge=mean"],
    "decoupled K=1 grace, int4 wire": ["diloco.wire_dtype=int4"],
    "decoupled K=1 no grace, publish to contributors": [
        "diloco.grace_fraction=0",
        "diloco.publish_to=contributors",
    ],
    "decoupled K=1 grace, publish to contributors": ["diloco.publish_to=contributors"],
    # Staleness-aware outer steps: a round steps by the share of learners it merged,
    # and/or a contribution's outer gradient is its own update (anchored at its base).
    "decoupled K=1 grace, share step": ["diloco.round_step=share"],
    "decoupled K=1 grace, base anchor, share step": [
        "diloco.outer_anchor=base",
        "diloco.round_step=share",
    ],
    "decoupled K=1 no grace, publish to contributors, share step": [
        "diloco.grace_fraction=0",
        "diloco.publish_to=contributors",
        "diloco.round_step=share",
    ],
    "decoupled K=1 no grace, publish to contributors, base anchor, share step": [
        "diloco.grace_fraction=0",
        "diloco.publish_to=contributors",
        "diloco.outer_anchor=base",
        "diloco.round_step=share",
    ],
    "decoupled K=1 grace, publish to contributors, share step": [
        "diloco.publish_to=contributors",
        "diloco.round_step=share",
    ],
    FRACTION_STEP: ["diloco.round_step=fraction"],
    "decoupled K=1 no grace, fraction step": [
        "diloco.grace_fraction=0",
        "diloco.round_step=fraction",
    ],
    f"{FRACTION_STEP}, mean merge": ["diloco.round_step=fraction", "diloco.merge=mean"],
    "decoupled K=1 grace, keep unsent work, fraction step": [
        "diloco.keep_unsent_work=true",
        "diloco.round_step=fraction",
    ],
    "decoupled K=1 no grace, keep unsent work, fraction step": [
        "diloco.grace_fraction=0",
        "diloco.keep_unsent_work=true",
        "diloco.round_step=fraction",
    ],
    # The outer optimizer at this short horizon (about 10 outer steps per fragment).
    "synchronous, outer momentum 0.5": ["diloco.mode=synchronous", "outer.momentum=0.5"],
    "decoupled K=1 grace, outer momentum 0.5": ["outer.momentum=0.5"],
    "decoupled K=1 grace, outer momentum 0.5, share step": [
        "outer.momentum=0.5",
        "diloco.round_step=share",
    ],
    # The fraction step's best outer lr at 104 outer steps per fragment (quality_horizon.py).
    f"{FRACTION_STEP}, outer lr 1.4": ["diloco.round_step=fraction", "outer.lr=1.4"],
    # A round as sqrt(share) of an outer step (the default): one learner of 4 takes half a step.
    DEFAULT: ["diloco.round_step=sqrt"],
    "decoupled K=1 no grace, sqrt step": ["diloco.grace_fraction=0", "diloco.round_step=sqrt"],
    f"{DEFAULT}, mean merge": ["diloco.round_step=sqrt", "diloco.merge=mean"],
    # The same outer lr where every round merges every learner (a full step either way).
    "synchronous, outer lr 1.4": ["diloco.mode=synchronous", "outer.lr=1.4"],
    "decoupled K=M, outer lr 1.4": ["diloco.quorum_min=4", "outer.lr=1.4"],
    # What helped at the long horizon (quality_horizon.py): synchronous DiLoCo at
    # outer lr 0.5, and Streaming DiLoCo's mixing with the sqrt step.
    "synchronous, outer lr 0.5": ["diloco.mode=synchronous", "outer.lr=0.5"],
    DEFAULT_ROW: MIX,
    "decoupled K=1 no grace, sqrt step, mixing alpha 0.25": ["diloco.grace_fraction=0", *MIX],
    f"{DEFAULT_ROW}, mean merge": [*MIX, "diloco.merge=mean"],
    # The narrow wires both ways (quality_horizon.py: int2 ahead of the bfloat16
    # wire on every seed at 2.56M tokens, but 0.8% behind it at 500k in the bandwidth table).
    **{f"{DEFAULT_ROW}, {bits} both ways": [*MIX, *both_ways(bits)] for bits in ("int4", "int2")},
    # K = 2 on the default wire (the best decoupled quorum at the quality horizon), and the
    # grace and merge alternatives for it; without the window, the default.
    DEFAULT_K2: K2,
    f"{DEFAULT_K2}, no grace": [*K2, *NO_GRACE],
    f"{DEFAULT_K2}, mean merge": [*K2, "diloco.merge=mean"],
    f"{DEFAULT_K2}, no grace, mean merge": [*K2, *NO_GRACE, "diloco.merge=mean"],
    # jobs/reference.yaml as it stands: the config's defaults, nothing of AS_WRITTEN
    PULLED: [],
}


def run_variant(name: str, overrides: list[str], quick: bool) -> dict[str, Any]:
    written = AS_WRITTEN if name != PULLED else []
    slug = re.sub(r"[^\w=,.-]+", "-", name)  # a path an override can carry
    cfg = load_config(
        CONFIG,
        [*(QUICK if quick else []), *written, *overrides, f"run_dir=/tmp/quality/{slug}"],
    )
    t0 = time.perf_counter()
    s = run_reference(cfg)
    shares = [v["merged_share"] for v in s.get("learners", {}).values()]
    return {
        "variant": name,
        "heldout_loss": s["heldout_loss"],
        "tokens": s["tokens"],
        "rounds": s.get("rounds", 0),
        "mean_contributors": s.get("mean_contributors", 0.0),
        "bytes_per_token": s["bytes_per_token"],
        "dp_bytes_per_token": s["dp_bytes_per_token"],
        "refused": s.get("rejected", {}),  # the synchronizer's refusals, by reason
        # the lowest learner's share of its trained tokens that reached the global model
        "merged_share_min": min(shares, default=None),
        "wall_s": time.perf_counter() - t0,
        "evals": s["evals"],
    }


# The curves of quality.png: the baselines, the method as written, the two steps that changed
# it most, and the default with and without the grace window and RDA. The other variants are
# in the table only: 38 curves are more than a legend can tell apart.
PLOTTED = {
    "data_parallel": "data-parallel",
    "synchronous": "synchronous DiLoCo",
    "decoupled K=1 grace": "decoupled as written, K = 1 with grace",
    DEFAULT: "as written + sqrt step",
    DEFAULT_ROW: "as written + sqrt step + mix",
    PULLED: "the default (pulled rounds, K = 1, unsent work kept)",
    f"{DEFAULT_K2}, no grace": "offers, K = 2 (sqrt step, mix, int4 both ways: the former default)",
    DEFAULT_K2: "the same with the grace window",
    f"{DEFAULT_K2}, no grace, mean merge": "the same with the plain mean, not RDA",
}


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    by = {r["variant"]: r for r in rows}
    curves = [(label, by[name]["evals"]) for name, label in PLOTTED.items() if name in by]
    plot_loss_curves(curves, path)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", help="subset of variants")
    p.add_argument("--jobs", type=int, default=1, help="variants run side by side (processes)")
    p.add_argument(
        "--add",
        action="store_true",
        help="keep the rows already in the JSON and run only the variants missing there",
    )
    p.add_argument(
        "--plot", action="store_true", help="redraw the plot from the JSON in --out, run nothing"
    )
    args = p.parse_args()
    name = "quality-quick" if args.quick else "quality"
    path = args.out / f"{name}.json"
    if args.plot:
        plot(json.loads(path.read_text())["rows"], args.out / f"{name}.png")
        return
    kept = json.loads(path.read_text())["rows"] if args.add and path.exists() else []
    have = {r["variant"] for r in kept}
    chosen = {
        n: o for n, o in VARIANTS.items() if (not args.only or n in args.only) and n not in have
    }
    # Each variant is a deterministic in-process run of its own: processes side by side change
    # the wall times only.
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(run_variant, n, o, args.quick) for n, o in chosen.items()]
        rows = []
        for future in futures:
            rows.append(future.result())
            print(
                f"{rows[-1]['variant']}: heldout {rows[-1]['heldout_loss']:.4f} "
                f"({rows[-1]['wall_s']:.0f}s)",
                flush=True,
            )
    order = list(VARIANTS)
    rows = sorted(
        kept + rows,
        key=lambda r: order.index(r["variant"]) if r["variant"] in order else len(order),
    )
    dp = next((r["heldout_loss"] for r in rows if r["variant"] == "data_parallel"), None)
    for r in rows:
        r["vs_data_parallel"] = (r["heldout_loss"] / dp - 1) if dp else None
    args.out.mkdir(parents=True, exist_ok=True)
    plot(rows, args.out / f"{name}.png")
    columns = [
        "variant",
        "heldout_loss",
        "vs_data_parallel",
        "rounds",
        "mean_contributors",
        "bytes_per_token",
        "dp_bytes_per_token",
        "wall_s",
    ]
    write_results(
        args.out,
        name,
        [{k: v for k, v in r.items() if k != "evals"} | {"evals": r["evals"]} for r in rows],
        columns,
        {"config": str(CONFIG.name), "quick": args.quick, "jobs": args.jobs},
    )


if __name__ == "__main__":
    main()
