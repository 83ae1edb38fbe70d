"""Scavenging: a base of 4 learners plus temporary ones that add +0% to +300% compute for part
of the run, in the in-process reference run (virtual clock), at the same token budget and with
the temporary learners' tokens added to it.

The temporary learners (copies of a base learner) join at 25% and leave at 75% of the base
run's virtual duration (`elastic.schedule`; a joiner boots for `chaos.restart_s` before it
registers; a leaver offers its unsent work and gives its unread data back). Data-parallel gets
the same extra hosts at the same fractions of its own base duration: it splits its fixed
global batch over them (faster steps) but re-meshes on every change
(`elastic.remesh_steps`). Two readings: the same token budget (the extra compute's tokens
replace the base learners'), and the budget grown by the tokens the extra compute trains over
the window, the learning-rate schedule still the base run's (`inner.decay_tokens`). Reported:
virtual time to a target held-out loss (each system's own base-run loss at 80% of the base
budget, interpolated between evaluations), relative to the base.
Published (Decoupled DiLoCo): 1.00 / 0.90 / 0.83 / 0.75 / 0.62, data-parallel 1.00 / 1.07 /
1.09 / 1.02 / 0.80. A second table keeps the extra learners for the whole run (4 against 8, at
32 and at 2 sequences per learner; data-parallel, decoupled and synchronous DiLoCo) to tell the
model's critical batch from the merge's cost of more learners, and that from DiLoCo's own;
`--ray` adds the Ray setting's base and +100% runs, in-process and on Ray (the Ray pair
`--ray-repeats` times, 3 by default: its wall-clock schedule varies between runs).

    python benchmarks/scavenging.py [--quick] [--jobs 2] [--ray [--ray-repeats N]]
"""

from __future__ import annotations

import itertools
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from ray_diloco.config import RunConfig, build_config, load_config
from ray_diloco.sim.figures import save_figure

from common import QUICK_MODEL, REFERENCE, parser, write_results

EXTRA = {0: 0, 50: 2, 100: 4, 200: 8, 300: 12}  # % compute added -> temporary learners
PUBLISHED = {
    "decoupled": {0: 1.00, 50: 0.90, 100: 0.83, 200: 0.75, 300: 0.62},
    "data_parallel": {0: 1.00, 50: 1.07, 100: 1.09, 200: 1.02, 300: 0.80},
}
WINDOW = (0.25, 0.75)  # temporary learners present during this part of the base duration
TARGET_AT = 0.8  # the target loss: the base run's at this fraction of the token budget
ADDED = ", tokens added"  # a system's runs whose budget grows with the extra compute
NUM_EVALS = 40
BUDGET = ["token_budget=2000000"]
# A smoke setting: a run of ~1 virtual s, so boots and re-meshes are scaled down with it.
QUICK = [*QUICK_MODEL, "token_budget=120000", "chaos.restart_s=0.05", "elastic.remesh_steps=2"]


def reference_tree(mode: str, quick: bool) -> dict[str, Any]:
    base = load_config(REFERENCE, [*(QUICK if quick else BUDGET), f"diloco.mode={mode}"])
    return base.model_dump(mode="json")


def config(
    mode: str, extra: int, base_s: float, quick: bool, runs: Path, added: bool = False
) -> RunConfig:
    """`runs`: the directory of this invocation's run dirs (a run dir holding a finished run
    is refused, never overwritten); `added`: the budget grows by the tokens `extra` % more
    compute trains over the window, and the schedule decays over the base budget."""
    tree = reference_tree(mode, quick)
    if added:
        budget = tree["token_budget"]
        tree["inner"]["decay_tokens"] = budget
        tree["token_budget"] = round(budget * (1 + extra / 100 * (WINDOW[1] - WINDOW[0])))
    tree["elastic"]["schedule"] = window(tree["learners"][0], EXTRA[extra], base_s)
    tree["run_dir"] = str(runs / f"{mode}-{extra}{'-added' if added else ''}")
    return build_config(tree, f"scavenging {mode}{ADDED if added else ''} +{extra}")


def window(template: dict[str, Any], extra: int, base_s: float) -> list[dict[str, Any]]:
    """`elastic.schedule`: `extra` copies of `template` join at WINDOW[0] and leave at
    WINDOW[1] of a base run lasting `base_s`."""
    joins = [
        {"at_s": WINDOW[0] * base_s, "join": template | {"name": f"temp-{i}"}} for i in range(extra)
    ]
    return joins + [{"at_s": WINDOW[1] * base_s, "leave": f"temp-{i}"} for i in range(extra)]


def run(cfg: RunConfig) -> dict[str, Any]:
    from ray_diloco.sim.simulate import run_reference

    # A grown budget is evaluated at its base budget's spacing, more often in all: at a
    # coarser spacing the time to the target, interpolated between evaluations, would differ
    # from that of the same run's base even where the two runs are one.
    base_budget = cfg.inner.decay_tokens or cfg.token_budget
    t0 = time.perf_counter()
    summary = run_reference(cfg, num_evals=round(NUM_EVALS * cfg.token_budget / base_budget))
    return summary | {"wall_s": time.perf_counter() - t0}


# Learners for the whole run instead of a window: the 4 reference learners against 8 (each
# twice), at the reference's own batch (32 sequences per learner) and at 2, same budget.
# Data-parallel's cost of the doubled global batch says how far the model is past its critical
# batch at that batch; decoupled's cost beyond it is the merge's, of twice the learners, and
# synchronous DiLoCo's (rounds of every learner, no asynchrony) tells what of that cost is
# DiLoCo's own, half the outer steps for the same tokens, from what decoupling adds.
WHOLE_RUN_LEARNERS = (4, 8)
WHOLE_RUN_MODES = ("data_parallel", "decoupled", "synchronous")


def whole_run_batches(quick: bool) -> tuple[int, int]:
    return reference_tree("decoupled", quick)["learners"][0]["batch_size"], 2


def whole_run_config(mode: str, batch: int, learners: int, quick: bool, runs: Path) -> RunConfig:
    tree = reference_tree(mode, quick)
    ref = tree["learners"]
    copies = [(ref[i % len(ref)], i // len(ref)) for i in range(learners)]
    # the first round of copies keeps the reference names: 4 at the reference's batch is the
    # +0% run itself (main reuses it)
    tree["learners"] = [
        r | {"name": r["name"] + (f"{n + 1}" if n else ""), "batch_size": batch} for r, n in copies
    ]
    tree["run_dir"] = str(runs / f"whole-{mode}-{batch}x{learners}")
    return build_config(tree, f"scavenging {mode}, {learners} learners of batch {batch}")


def time_to_loss(evals: list[dict[str, float]], target: float) -> float | None:
    """The virtual time the held-out loss first reaches `target`, interpolated linearly
    between the two evaluations around the crossing; None if it never does."""
    for before, after in itertools.pairwise(evals):
        if after["heldout_loss"] <= target < before["heldout_loss"]:
            drop = before["heldout_loss"] - after["heldout_loss"]
            frac = (before["heldout_loss"] - target) / drop
            return before["t"] + frac * (after["t"] - before["t"])
    return evals[0]["t"] if evals and evals[0]["heldout_loss"] <= target else None


def loss_at_tokens(evals: list[dict[str, float]], tokens: float) -> float:
    xs = [e["tokens"] for e in evals]
    return float(np.interp(tokens, xs, [e["heldout_loss"] for e in evals]))


def plot(
    results: dict[tuple[str, int], dict[str, Any]], rows: list[dict[str, Any]], out: Path, name: str
) -> None:
    """Left: the decoupled runs' held-out loss over the part of the run where the levels differ
    (the window's shading, the target as a line; dashed: the budget grown by the extra
    compute's tokens). Right: time to the target against extra compute for every system in
    `rows`, a run that never reached it marked on the top edge."""
    fig = Figure(figsize=(12, 5.6))
    ax_loss, ax_rel = fig.subplots(1, 2)
    target = next(r["target_loss"] for r in rows if r["mode"] == "decoupled")
    for i, extra in enumerate(EXTRA):
        for system, style in (("decoupled", "-"), ("decoupled" + ADDED, "--")):
            if (s := results.get((system, extra))) is None or (extra == 0 and style == "--"):
                continue
            ax_loss.plot(
                [e["t"] for e in s["evals"]],
                [e["heldout_loss"] for e in s["evals"]],
                color=f"C{i}",
                linestyle=style,
                label=f"decoupled +{extra}%" if style == "-" else None,
            )
    base_s = results[("decoupled", 0)]["virtual_time_s"]
    ax_loss.axvspan(*(f * base_s for f in WINDOW), color="grey", alpha=0.12)
    ax_loss.axhline(target, color="black", linestyle=":", linewidth=1)
    ax_loss.annotate(
        f"target {target:.3f}", (0.02, target), xycoords=("axes fraction", "data"), va="bottom"
    )
    ends = max(s["virtual_time_s"] for (m, _), s in results.items() if m.startswith("decoupled"))
    ax_loss.set_xlim(WINDOW[0] * base_s * 0.6, ends * 1.02)
    finals = [s["heldout_loss"] for (m, _), s in results.items() if m.startswith("decoupled")]
    ax_loss.set_ylim(
        min(finals) - 0.05, max(target + 4 * (target - min(finals)), max(finals) + 0.03)
    )
    ax_loss.set_xlabel(
        "virtual time (s); shaded: temporary learners present; dashed: their tokens added"
    )
    ax_loss.set_ylabel("held-out loss (nats per byte)")
    ax_loss.set_title("decoupled, temporary learners at 25-75% of the base run")
    ax_loss.legend(fontsize=8)
    top = 1.15
    styles = {
        "decoupled": ("o", "C0"),
        "data_parallel": ("s", "C1"),
        "decoupled" + ADDED: ("o", "C4"),
        "data_parallel" + ADDED: ("s", "C5"),
        "decoupled, Ray's setting in-process": ("^", "C2"),
        "decoupled on Ray": ("D", "C3"),
    }
    for shift, (system, (marker, color)) in enumerate(styles.items()):
        runs = sorted({r["mode"] for r in rows if r["mode"].split(RUN_SUFFIX)[0] == system})
        count = f", {len(runs)} runs" if len(runs) > 1 else ""
        for i, mode in enumerate(runs):
            # a grown budget's line starts at its base run
            base = mode.removesuffix(ADDED)
            mine = [
                r
                for r in rows
                if r["mode"] == mode
                or (base != mode and (r["mode"], r["extra_compute_pct"]) == (base, 0))
            ]
            reached = [r for r in mine if r["relative_time"] is not None]
            # open markers, dotted: a grown budget's line may lie on its system's
            ax_rel.plot(
                [r["extra_compute_pct"] for r in reached],
                [r["relative_time"] for r in reached],
                marker=marker,
                color=color,
                linestyle=":" if base != mode else "-",
                markerfacecolor="none" if base != mode else color,
                label=None if i else f"{system} (measured{count})",
            )
            # nudged sideways so that two systems missing at one level both show
            missed = [r["extra_compute_pct"] for r in mine if r["relative_time"] is None]
            ax_rel.plot(
                [x + 5 * shift for x in missed],
                [top] * len(missed),
                marker=marker,
                color=color,
                linestyle="none",
            )
        if system in PUBLISHED:
            ax_rel.plot(
                list(PUBLISHED[system]),
                list(PUBLISHED[system].values()),
                marker=marker,
                linestyle="--",
                color=color,
                alpha=0.45,
                label=f"{system} (published)",
            )
    ax_rel.axhline(top, color="black", linewidth=0.6)
    ax_rel.annotate(
        "target never reached", (0.02, top), xycoords=("axes fraction", "data"), va="bottom"
    )
    ax_rel.set_ylim(0.55, top + 0.06)
    ax_rel.set_xlabel("extra compute for part of the run (%)")
    ax_rel.set_ylabel("time to target loss / base run's")
    ax_rel.set_title("time to each system's target (Ray: wall clock)")
    # below the axes: inside, it covers some system's line at any corner
    ax_rel.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    for ax in (ax_loss, ax_rel):
        ax.grid(alpha=0.3)
    save_figure(fig, out / f"{name}.png", dpi=110)


# The Ray run: tests/fixtures/tiny_train.yaml's model, steps paced at 50 ms (mostly sleep, so
# eight learners fit two cores), 4 base learners, +100% = 4 temporary ones; the config's
# rounds (pulled, K = 1, unsent work kept), as in the 4-learner job files.
RAY_CONFIG = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tiny_train.yaml"
RUN_SUFFIX = ", run "  # "decoupled on Ray, run 2": one of the repeated Ray pairs
RAY_RUN = [
    "diloco.mode=decoupled",
    "token_budget=400000",
    "pace=step_time",
    "step_time_s=0.05",
    "elastic.lease_tokens=4096",
    "metrics.eval_every_s=2",
    "synchronizer.checkpoint_every_rounds=1000",
]


def ray_config(extra: int, base_s: float, where: Path) -> RunConfig:
    """The Ray run's setting: `extra` temporary learners join at 25% and leave at 75% of a
    base run lasting `base_s`; `where` names the run directory."""
    base = load_config(RAY_CONFIG, [*RAY_RUN, f"run_dir={where}-{extra}"])
    tree = base.model_dump(mode="json")
    learner = {"batch_size": 8, "jitter": 0.1}
    tree["learners"] = [learner | {"name": f"base-{i}"} for i in range(4)]
    tree["elastic"]["schedule"] = window(learner, extra, base_s)
    return build_config(tree, f"scavenging on Ray +{extra}")


def ray_setting_pair(on_ray: bool, where: Path) -> dict[int, dict[str, Any]]:
    """The Ray setting's base run and +100%, the window on the base run's duration: on an
    embedded local Ray (a real join: boot, placement, registration; wall clock), or in-process
    on the virtual clock (what the setting gives without 2 cores shared by 8 learners, a
    synchronizer and boots)."""
    if on_ray:
        from ray_diloco.runtime.driver import run_training as train

        clock = "wall_time_s"
    else:
        train, clock = run, "virtual_time_s"
    base = train(ray_config(0, 0.0, where))
    return {0: base, 100: train(ray_config(EXTRA[100], base[clock], where))}


def rows_for(
    system: str, published: dict[int, float], runs: dict[int, dict[str, Any]], clock: str
) -> list[dict[str, Any]]:
    """One system's table rows by % compute added; its target is its +0% run's held-out loss
    at TARGET_AT of the budget. `clock`: the summary field of the run's duration."""
    base = runs[0]
    target = loss_at_tokens(base["evals"], TARGET_AT * base["tokens"])
    t_base = time_to_loss(base["evals"], target)
    rows = []
    for extra, s in sorted(runs.items()):
        t = time_to_loss(s["evals"], target)
        rows.append(
            {
                "mode": system,
                "extra_compute_pct": extra,
                "temporary_learners": EXTRA[extra],
                "target_loss": target,
                "time_to_target_s": t,
                "relative_time": t / t_base if t is not None and t_base else None,
                "published": published[extra],
                "final_loss": s["heldout_loss"],
                "tokens": s["tokens"],
                "run_time_s": s[clock],
                "ledger_violations": len(s.get("ledger_violations", [])),
            }
        )
    return rows


def whole_run_rows(runs: dict[tuple[str, int, int], dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "mode": mode,
            "batch_per_learner": batch,
            "learners": learners,
            "final_loss": s["heldout_loss"],
            "cost_vs_4_learners": s["heldout_loss"] / runs[(mode, batch, 4)]["heldout_loss"] - 1,
        }
        for (mode, batch, learners), s in runs.items()
    ]


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel processes")
    p.add_argument(
        "--ray",
        action="store_true",
        help="also real Ray runs at +0%% and +100%% and their setting in-process",
    )
    p.add_argument(
        "--ray-repeats",
        type=int,
        default=3,
        help="how many times the Ray pair runs (its wall-clock schedule varies between runs)",
    )
    args = p.parse_args()
    runs = Path(tempfile.mkdtemp(prefix="scavenging-"))
    results: dict[tuple[str, int], dict[str, Any]] = {}
    modes = ("data_parallel", "decoupled")
    with ProcessPoolExecutor(args.jobs) as pool:
        bases = {m: pool.submit(run, config(m, 0, 0.0, args.quick, runs)) for m in modes}
        # 4 learners at the reference's batch: the +0% run, reused below
        ref_batch, small = whole_run_batches(args.quick)
        whole_keys = [
            (m, b, n)
            for m in WHOLE_RUN_MODES
            for b in (ref_batch, small)
            for n in WHOLE_RUN_LEARNERS
        ]
        whole_jobs = {
            key: pool.submit(run, whole_run_config(*key, args.quick, runs))
            for key in whole_keys
            if key[0] not in modes or key[1:] != (ref_batch, 4)
        }
        twin = (
            pool.submit(ray_setting_pair, on_ray=False, where=runs / "ray-in-process")
            if args.ray
            else None
        )
        for m in modes:
            results[(m, 0)] = bases[m].result()
        jobs = {
            (m + (ADDED if added else ""), extra): pool.submit(
                run, config(m, extra, results[(m, 0)]["virtual_time_s"], args.quick, runs, added)
            )
            for added in (False, True)
            for m in modes
            for extra, n in EXTRA.items()
            if n
        }
        for key, job in jobs.items():
            results[key] = job.result()
            print(f"{key[0]:28s} +{key[1]:3d}%  done ({results[key]['wall_s']:.0f} s)", flush=True)
        whole = {
            key: results[(key[0], 0)] if key not in whole_jobs else whole_jobs[key].result()
            for key in whole_keys
        }
        # each reading against the same base run
        rows = [
            row
            for m in modes
            for system in (m, m + ADDED)
            for row in rows_for(
                system,
                PUBLISHED[m],
                {0: results[(m, 0)]}
                | {x: s for (mode, x), s in results.items() if mode == system and x},
                "virtual_time_s",
            )
            if row["extra_compute_pct"] or system == m
        ]
        if twin is not None:
            rows += rows_for(
                "decoupled, Ray's setting in-process",
                PUBLISHED["decoupled"],
                twin.result(),
                "virtual_time_s",
            )
    name = "scavenging-quick" if args.quick else "scavenging"
    meta = {
        "config": REFERENCE.name,
        "quick": args.quick,
        "window": WINDOW,
        "target_at_budget_fraction": TARGET_AT,
        "num_evals_per_base_budget": NUM_EVALS,
        "whole_run": whole_run_rows(whole),
    }
    # Written now and again after each Ray pair: a Ray run that fails keeps what ran before.
    save(results, rows, args.out, name, meta)
    for i in range(args.ray_repeats if args.ray else 0):
        rows += rows_for(
            f"decoupled on Ray{RUN_SUFFIX}{i + 1}",
            PUBLISHED["decoupled"],
            ray_setting_pair(on_ray=True, where=runs / f"ray-{i + 1}"),
            "wall_time_s",
        )
        save(results, rows, args.out, name, meta)


def save(
    results: dict[tuple[str, int], dict[str, Any]],
    rows: list[dict[str, Any]],
    out: Path,
    name: str,
    meta: dict[str, Any],
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    plot(results, rows, out, name)
    write_results(out, name, rows, list(rows[0]), meta)


if __name__ == "__main__":
    main()
