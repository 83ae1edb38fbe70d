"""The published heterogeneous setting, in the in-process reference run:
8 learners, 4 at speed 1.0 and 4 at 0.82 (the published 4 + 4 learners' 18% gap), 10% jitter
on every step, over 100 outer steps per fragment, 3 seeds, with a model and batch small enough
that a run takes a minute on one core. The config's defaults (rounds pulled by the
synchronizer, K = 1, kept unsent work) against rules on learners' own offers: rounds of every
learner (K = 8), of whoever comes first (K = 1), K = 1 with the adaptive grace window, K = 2
without it, the same rules pulled, with and without kept unsent work, and on a slow link;
each reporting the held-out loss, goodput of merged work on the virtual clock
(`goodput_merged`: step time whose work reached the global model over allocated time) beside
today's goodput, learners merged a round and the merged share of each speed class (tokens of
its work that reached the global model over tokens it trained).

    python benchmarks/heterogeneous.py --jobs 2   # every variant and seed (~1 h, 2 busy cores)
    python benchmarks/heterogeneous.py --jobs 2 --add --variants 'pull, K=8' --seeds 1 2
    python benchmarks/heterogeneous.py --quick    # one seed, a short budget: a smoke check
"""

from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from ray_diloco.config import RunConfig, apply_overrides, build_config

from common import cache_compilations, parser, write_results

NAME = "heterogeneous"
SEEDS = (0, 1, 2)
LEARNERS, SLOW_SPEED, JITTER, BATCH = 8, 0.82, 0.1, 4
# A 2-layer, 32-wide byte model on 16-byte sequences, P = H = 8: a fast learner takes about
# 840 inner steps (105 outer steps a fragment) in the token budget.
MODEL = [
    "task_args.model.d_model=32",
    "task_args.model.num_layers=2",
    "task_args.model.num_heads=2",
    "task_args.model.d_ff=128",
    "task_args.model.seq_len=16",
    "task_args.data.eval_batches=4",
    "task_args.data.eval_batch_size=32",
    "diloco.sync_every=8",
    "diloco.num_fragments=8",
    "token_budget=390000",
]
QUICK = ["token_budget=60000"]
SLOW_LINK = ["links.local.bandwidth_gbps=0.01", "links.local.latency_ms=5"]
# The rule every row but "default" starts from: learners offer on their own count, rounds of
# K = 1 with the grace window (gamma = 0.5), non-contributors' unsent work mixed over, bases at
# most 4 versions behind (the defaults before pulled rounds were measured best here).
OFFER_RULE = [
    "diloco.schedule=offer",
    "diloco.grace_fraction=0.5",
    "diloco.keep_unsent_work=false",
    "diloco.max_staleness_versions=4",
]
# name -> what it changes from the config's defaults
VARIANTS: dict[str, list[str]] = {
    # The config's defaults: pulled rounds of one, kept unsent work, staleness bound 8.
    "default": [],
    # ... with rounds of one taking a share of a step each, or rounds of two answers
    "default, fraction step": ["diloco.round_step=fraction"],
    "default, K=2": ["diloco.quorum_min=2"],
    "K=8": [*OFFER_RULE, "diloco.quorum_min=8", "diloco.grace_fraction=0"],
    "K=1": [*OFFER_RULE, "diloco.quorum_min=1", "diloco.grace_fraction=0"],
    "K=1 + grace (offer)": OFFER_RULE,
    "K=2 (the job files' rule before)": [
        *OFFER_RULE,
        "diloco.quorum_min=2",
        "diloco.grace_fraction=0",
    ],
    # Non-contributors carry their unsent work onto a new version (counted in their next
    # offer) instead of losing it; each one-learner round then holds a whole window of its
    # learner's work, so it takes its share of an outer step (the fraction step), not sqrt.
    "K=1 + grace, keep unsent work, fraction step": [
        *OFFER_RULE,
        "diloco.keep_unsent_work=true",
        "diloco.round_step=fraction",
    ],
    # ... with the default sqrt step: sqrt(1/8) of a step per one-learner round, 2.8 a window
    "K=1 + grace, keep unsent work": [*OFFER_RULE, "diloco.keep_unsent_work=true"],
    # Is what separates the rows the outer step a window takes? Each of these takes one outer
    # step of every learner's window a window: at twice and at half the outer lr.
    "K=1 + grace, keep unsent work, fraction step, outer lr 1.4": [
        *OFFER_RULE,
        "diloco.keep_unsent_work=true",
        "diloco.round_step=fraction",
        "outer.lr=1.4",
    ],
    "K=8, outer lr 1.4": [
        *OFFER_RULE,
        "diloco.quorum_min=8",
        "diloco.grace_fraction=0",
        "outer.lr=1.4",
    ],
    # ... and half the outer lr
    "K=1 + grace, keep unsent work, fraction step, outer lr 0.35": [
        *OFFER_RULE,
        "diloco.keep_unsent_work=true",
        "diloco.round_step=fraction",
        "outer.lr=0.35",
    ],
    "K=8, outer lr 0.35": [
        *OFFER_RULE,
        "diloco.quorum_min=8",
        "diloco.grace_fraction=0",
        "outer.lr=0.35",
    ],
    # Kept work was trained against an older G: anchored at its base, a contribution is its
    # learner's own update, whatever G did since.
    "K=1 + grace, keep unsent work, fraction step, base anchor": [
        *OFFER_RULE,
        "diloco.keep_unsent_work=true",
        "diloco.round_step=fraction",
        "diloco.outer_anchor=base",
    ],
    # The synchronizer pulls every live learner's current value of p when p falls due on the
    # leading learner's count (docs/algorithm.md section 5, the open question), so each
    # learner contributes every round; only its steps between the pull and the adoption of
    # the round's version are overwritten (none with kept unsent work).
    "pull, K=1 + grace": [*OFFER_RULE, "diloco.schedule=pull"],
    "pull, K=8": [
        *OFFER_RULE,
        "diloco.schedule=pull",
        "diloco.quorum_min=8",
        "diloco.grace_fraction=0",
    ],
    "pull, K=1 + grace, keep unsent work": [
        *OFFER_RULE,
        "diloco.schedule=pull",
        "diloco.keep_unsent_work=true",
    ],
    # Without the window a pulled round closes on the leader's answer and the others' answers
    # make the next round: more rounds a window, fewer learners each.
    "pull, K=1, keep unsent work": [
        *OFFER_RULE,
        "diloco.schedule=pull",
        "diloco.keep_unsent_work=true",
        "diloco.grace_fraction=0",
    ],
    # ... whose later answers, on a base up to 7 versions behind, are then merged, not refused
    "pull, K=1, keep unsent work, staleness 8": [
        *OFFER_RULE,
        "diloco.schedule=pull",
        "diloco.keep_unsent_work=true",
        "diloco.grace_fraction=0",
        "diloco.max_staleness_versions=8",
    ],
    "pull, K=1, staleness 8": [
        *OFFER_RULE,
        "diloco.schedule=pull",
        "diloco.grace_fraction=0",
        "diloco.max_staleness_versions=8",
    ],
    # Where the window pays: every learner's link carries 10 Mbps each way, shared (5 ms).
    # One-learner rounds publish each learner's answer to all 8 (about 30 Mbps down), rounds
    # the window fills publish a pull's answers about once (about 5 Mbps).
    "pull, K=1, keep unsent work, staleness 8, 10 Mbps link": [
        *OFFER_RULE,
        "diloco.schedule=pull",
        "diloco.keep_unsent_work=true",
        "diloco.grace_fraction=0",
        "diloco.max_staleness_versions=8",
        *SLOW_LINK,
    ],
    "pull, K=1 + grace, keep unsent work, 10 Mbps link": [
        *OFFER_RULE,
        "diloco.schedule=pull",
        "diloco.keep_unsent_work=true",
        *SLOW_LINK,
    ],
    # Which of the two separates the pulled rows with kept work, the window or the staleness
    # fence: the window with late answers on bases up to 7 versions behind merged too.
    "pull, K=1 + grace, keep unsent work, staleness 8": [
        *OFFER_RULE,
        "diloco.schedule=pull",
        "diloco.keep_unsent_work=true",
        "diloco.max_staleness_versions=8",
    ],
    "pull, K=1 + grace, keep unsent work, staleness 8, 10 Mbps link": [
        *OFFER_RULE,
        "diloco.schedule=pull",
        "diloco.keep_unsent_work=true",
        "diloco.max_staleness_versions=8",
        *SLOW_LINK,
    ],
}


def config(overrides: list[str], seed: int, quick: bool) -> RunConfig:
    named = "-".join(overrides) or "default"
    tree: dict[str, Any] = {
        "run_dir": f"/tmp/{NAME}/{seed}-{named}",
        "learners": [
            {
                "name": f"{'fast' if i < LEARNERS // 2 else 'slow'}-{i}",
                "batch_size": BATCH,
                "jitter": JITTER,
                **({"speed": SLOW_SPEED} if i >= LEARNERS // 2 else {}),
            }
            for i in range(LEARNERS)
        ],
    }
    apply_overrides(tree, [*MODEL, *(QUICK if quick else []), *overrides, f"seed={seed}"])
    return build_config(tree, f"{NAME} benchmark")


def run_one(job: tuple[str, list[str], int, bool]) -> dict[str, Any]:
    from ray_diloco.sim.simulate import run_reference

    name, overrides, seed, quick = job
    cache_compilations()
    cfg = config(overrides, seed, quick)
    t0 = time.perf_counter()
    s = run_reference(cfg)
    per = s["learners"]
    fast = [v for n, v in per.items() if n.startswith("fast")]
    slow = [v for n, v in per.items() if n.startswith("slow")]
    steps = max(v["inner_steps"] for v in per.values())
    return {
        "variant": name,
        "seed": seed,
        "heldout_loss": s["heldout_loss"],
        "goodput": s["goodput"],
        "goodput_merged": s["goodput_merged"],
        "merged_share": s["merged_share"],
        "merged_share_fast": statistics.mean(v["merged_share"] for v in fast),
        "merged_share_slow": statistics.mean(v["merged_share"] for v in slow),
        "merged_share_min": min(v["merged_share"] for v in per.values()),
        "overwritten_share_fast": statistics.mean(v["overwritten_share"] for v in fast),
        "overwritten_share_slow": statistics.mean(v["overwritten_share"] for v in slow),
        "refused": s["rejected"],
        "mean_contributors": s["mean_contributors"],
        "rounds": s["rounds"],
        "outer_steps_per_fragment": steps / cfg.diloco.sync_every,
        "tokens": s["tokens"],
        "virtual_time_s": s["virtual_time_s"],
        "wall_s": time.perf_counter() - t0,
        "evals": s["evals"],
    }


# Each run's figures a row averages over the seeds (with their spread).
MEASURES = (
    "heldout_loss",
    "goodput",
    "goodput_merged",
    "mean_contributors",
    "merged_share_fast",
    "merged_share_slow",
    "merged_share_min",
    "overwritten_share_fast",
    "overwritten_share_slow",
    "outer_steps_per_fragment",
)


def summarize(runs: list[dict[str, Any]], variants: list[str]) -> list[dict[str, Any]]:
    """Mean and spread (max - min) over the seeds of each variant."""
    rows = []
    for name in variants:
        mine = [r for r in runs if r["variant"] == name]
        row: dict[str, Any] = {"variant": name, "seeds": len(mine)}
        for key in MEASURES:
            values = [r[key] for r in mine]
            row[key] = statistics.mean(values)
            row[f"{key}_spread"] = max(values) - min(values)
        rows.append(row)
    return rows


def plot(rows: list[dict[str, Any]], runs: list[dict[str, Any]], path: Path) -> None:
    """Left: held-out loss over tokens, seed 0 of each variant. Right: loss against goodput of
    merged work per seed, so the trade-off the grace window is meant to win reads at a glance."""
    import matplotlib
    from matplotlib.figure import Figure

    from ray_diloco.sim.figures import save_figure

    fig = Figure(figsize=(16, 5.2))
    curves, trade = fig.subplots(1, 2)
    for i, row in enumerate(rows):
        colour = f"C{i}" if len(rows) <= 10 else matplotlib.colormaps["tab20"](i % 20)
        # past tab20's colours the same colour again, told apart by the line and marker
        dashed, marker = ("--", "s") if i >= 20 else ("-", "o")
        first = next(r for r in runs if r["variant"] == row["variant"] and r["seed"] == 0)
        tokens = [e["tokens"] / 1e3 for e in first["evals"]]
        curves.plot(tokens, [e["heldout_loss"] for e in first["evals"]], dashed, color=colour)
        mine = [r for r in runs if r["variant"] == row["variant"]]
        trade.scatter(
            [r["goodput_merged"] for r in mine],
            [r["heldout_loss"] for r in mine],
            color=colour,
            marker=marker,
            label=row["variant"],
        )
    end = max(e["heldout_loss"] for r in runs for e in r["evals"][-3:])
    low = min(r["heldout_loss"] for r in runs)
    curves.set_ylim(low - 0.05, end + 0.4)
    curves.set_xlabel("tokens (thousands)")
    curves.set_ylabel("held-out loss (global parameters)")
    curves.set_title("held-out loss, seed 0, 8 learners (4 at speed 0.82)")
    trade.set_xlabel("goodput of merged work (virtual clock)")
    trade.set_ylabel("final held-out loss")
    trade.set_title("each seed: quality against merged goodput")
    for ax in (curves, trade):
        ax.grid(alpha=0.3)
    # the colours of both panels, beside them: the points fill the panel's corners
    trade.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    save_figure(fig, path, dpi=110)


COLUMNS = ["variant", "seeds", MEASURES[0], f"{MEASURES[0]}_spread", *MEASURES[1:]]


def earlier_runs(path: Path, rerun: set[tuple[str, int]]) -> list[dict[str, Any]]:
    """The runs a previous invocation wrote to `path`, but those (variant, seed) in `rerun`."""
    if not path.exists():
        return []
    meta = json.loads(path.read_text())["meta"]
    return [
        {**r, "evals": meta["curves"][f"{r['variant']}/{r['seed']}"]}
        for r in meta["runs"]
        if (r["variant"], r["seed"]) not in rerun and r["variant"] in VARIANTS
    ]


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel (processes)")
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), help="a subset, by name")
    p.add_argument("--seeds", type=int, nargs="*", default=list(SEEDS))
    p.add_argument(
        "--add",
        action="store_true",
        help="keep the JSON's runs (in --out) of other variants or seeds",
    )
    p.add_argument(
        "--merge",
        type=Path,
        nargs="*",
        default=[],
        help="with --add: also keep the runs of these JSONs (this benchmark's, run elsewhere)",
    )
    args = p.parse_args()
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.exit(2, f"error: --variants: unknown {unknown}; choose from {list(VARIANTS)}\n")
    seeds = args.seeds[:1] if args.quick else args.seeds
    jobs = [(v, VARIANTS[v], s, args.quick) for v in args.variants for s in seeds]
    name = f"{NAME}-quick" if args.quick else NAME
    rerun = {(v, s) for v, _, s, _ in jobs}
    sources = [args.out / f"{name}.json", *args.merge] if args.add else []
    # one run of a (variant, seed): the first source's
    found = {
        (r["variant"], r["seed"]): r for path in sources[::-1] for r in earlier_runs(path, rerun)
    }
    kept = list(found.values())
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        runs = kept + list(pool.map(run_one, jobs))
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in runs)]
    rows = summarize(runs, variants)
    meta = {
        "learners": LEARNERS,
        "slow_speed": SLOW_SPEED,
        "jitter": JITTER,
        "batch_per_learner": BATCH,
        "seeds": sorted({r["seed"] for r in runs}),
        "variants": {v: VARIANTS[v] for v in variants},
        "runs": [{k: v for k, v in r.items() if k != "evals"} for r in runs],
        "curves": {f"{r['variant']}/{r['seed']}": r["evals"] for r in runs},
    }
    md = write_results(args.out, name, rows, COLUMNS, meta)
    plot(rows, runs, args.out / f"{name}.png")
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
