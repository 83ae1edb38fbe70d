"""Scavenging: a base of 4 learners plus temporary ones that add +0% to +300% compute for part
of the run, at the same token budget, in the in-process reference run (virtual clock).

The temporary learners (copies of a base learner) join at 25% and leave at 75% of the base
run's virtual duration (`elastic.schedule`; a joiner boots for `chaos.restart_s` before it
registers; a leaver offers its unsent work and gives its unread data back). Data-parallel gets
the same extra hosts at the same fractions of its own base duration: it splits its fixed
global batch over them (faster steps) but re-meshes on every change
(`elastic.remesh_steps`). Reported: virtual time to a target held-out loss (each system's own
base-run loss at 80% of the budget, interpolated between evaluations), relative to the base.
Published (Decoupled DiLoCo): 1.00 / 0.90 / 0.83 / 0.75 / 0.62, data-parallel 1.00 / 1.07 /
1.09 / 1.02 / 0.80.

    python benchmarks/scavenging.py [--quick] [--jobs 2] [--ray]
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from ray_diloco.config import RunConfig, load_config
from ray_diloco.report import save_figure

from common import NO_GRACE, QUICK_MODEL, REFERENCE, parser, write_results

EXTRA = {0: 0, 50: 2, 100: 4, 200: 8, 300: 12}  # % compute added -> temporary learners
PUBLISHED = {
    "decoupled": {0: 1.00, 50: 0.90, 100: 0.83, 200: 0.75, 300: 0.62},
    "data_parallel": {0: 1.00, 50: 1.07, 100: 1.09, 200: 1.02, 300: 0.80},
}
WINDOW = (0.25, 0.75)  # temporary learners present during this part of the base duration
TARGET_AT = 0.8  # the target loss: the base run's at this fraction of the token budget
NUM_EVALS = 40
BUDGET = ["token_budget=2000000"]
# A smoke setting: a run of ~1 virtual s, so boots and re-meshes are scaled down with it.
QUICK = [*QUICK_MODEL, "token_budget=120000", "chaos.restart_s=0.05", "elastic.remesh_steps=2"]


def config(mode: str, extra: int, base_s: float, quick: bool) -> RunConfig:
    base = load_config(REFERENCE, [*(QUICK if quick else BUDGET), f"diloco.mode={mode}"])
    template = base.learners[0].model_dump(mode="json")
    joins = [
        {"at_s": WINDOW[0] * base_s, "join": template | {"name": f"temp-{i}"}} for i in range(extra)
    ]
    leaves = [{"at_s": WINDOW[1] * base_s, "leave": f"temp-{i}"} for i in range(extra)]
    tree = base.model_dump(mode="json")
    tree["elastic"]["schedule"] = joins + leaves
    tree["run_dir"] = f"/tmp/scavenging/{mode}-{extra}"
    from ray_diloco.config import build_config

    return build_config(tree, f"scavenging {mode} +{extra}")


def run(mode: str, extra: int, base_s: float, quick: bool) -> dict[str, Any]:
    from ray_diloco.sim.simulate import run_reference

    t0 = time.perf_counter()
    summary = run_reference(config(mode, extra, base_s, quick), num_evals=NUM_EVALS)
    return summary | {"wall_s": time.perf_counter() - t0}


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
    fig = Figure(figsize=(11, 4.2))
    ax_loss, ax_rel = fig.subplots(1, 2)
    for extra in EXTRA:
        s = results[("decoupled", extra)]
        ax_loss.plot(
            [e["t"] for e in s["evals"]],
            [e["heldout_loss"] for e in s["evals"]],
            label=f"decoupled +{extra}%",
        )
    ax_loss.set_xlabel("virtual time (s)")
    ax_loss.set_ylabel("held-out loss (nats per byte)")
    ax_loss.set_title("decoupled, temporary learners at 25-75% of the base run")
    ax_loss.legend(fontsize=8)
    for mode, marker in (("decoupled", "o"), ("data_parallel", "s")):
        mine = [r for r in rows if r["mode"] == mode]
        xs = [r["extra_compute_pct"] for r in mine]
        (line,) = ax_rel.plot(
            xs, [r["relative_time"] for r in mine], marker=marker, label=f"{mode} (measured)"
        )
        ax_rel.plot(
            list(PUBLISHED[mode]),
            list(PUBLISHED[mode].values()),
            marker=marker,
            linestyle="--",
            color=line.get_color(),
            alpha=0.5,
            label=f"{mode} (published)",
        )
    ax_rel.set_xlabel("extra compute for part of the run (%)")
    ax_rel.set_ylabel("time to target loss / base run's")
    ax_rel.legend(fontsize=8)
    for ax in (ax_loss, ax_rel):
        ax.grid(alpha=0.3)
    save_figure(fig, out / f"{name}.png", dpi=110)


# The Ray run: tests/fixtures/tiny_train.yaml's model, steps paced at 50 ms (mostly sleep, so
# eight learners fit two cores), 4 base learners, +100% = 4 temporary ones; K = 2 without
# the grace window, as in the 4-learner job files.
RAY_CONFIG = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tiny_train.yaml"
RAY_RUN = [
    "diloco.mode=decoupled",
    "diloco.quorum_min=2",
    *NO_GRACE,
    "token_budget=400000",
    "pace=step_time",
    "step_time_s=0.05",
    "elastic.lease_tokens=4096",
    "metrics.eval_every_s=2",
    "synchronizer.checkpoint_every_rounds=1000",
]


def ray_run(extra: int, base_s: float) -> dict[str, Any]:
    """One run on an embedded local Ray: `extra` temporary learners join at 25% and leave at
    75% of the base run's wall time (a real join: boot, placement, registration)."""
    from ray_diloco.config import build_config
    from ray_diloco.driver import run_training

    base = load_config(RAY_CONFIG, [*RAY_RUN, f"run_dir=/tmp/scavenging/ray-{extra}"])
    tree = base.model_dump(mode="json")
    tree["learners"] = [{"name": f"base-{i}", "batch_size": 8, "jitter": 0.1} for i in range(4)]
    temp = {"batch_size": 8, "jitter": 0.1}
    tree["elastic"]["schedule"] = [
        {"at_s": WINDOW[0] * base_s, "join": temp | {"name": f"temp-{i}"}} for i in range(extra)
    ] + [{"at_s": WINDOW[1] * base_s, "leave": f"temp-{i}"} for i in range(extra)]
    return run_training(build_config(tree, f"scavenging on Ray +{extra}"))


def ray_rows() -> list[dict[str, Any]]:
    base = ray_run(0, 0.0)
    # the run clock starts before the learners boot: scale the window on training time
    scaled = ray_run(4, base["wall_time_s"])
    target = loss_at_tokens(base["evals"], TARGET_AT * base["tokens"])
    t_base = time_to_loss(base["evals"], target)
    rows = []
    for extra, s in ((0, base), (100, scaled)):
        t = time_to_loss(s["evals"], target)
        rows.append(
            {
                "mode": "decoupled on Ray",
                "extra_compute_pct": extra,
                "temporary_learners": 4 if extra else 0,
                "target_loss": target,
                "time_to_target_s": t,
                "relative_time": t / t_base if t is not None and t_base else None,
                "published": PUBLISHED["decoupled"][extra],
                "final_loss": s["heldout_loss"],
                "run_time_s": s["wall_time_s"],
                "ledger_violations": len(s["ledger_violations"]),
            }
        )
    return rows


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel processes")
    p.add_argument("--ray", action="store_true", help="also one real Ray run at +100%%")
    args = p.parse_args()
    results: dict[tuple[str, int], dict[str, Any]] = {}
    modes = ("decoupled", "data_parallel")
    with ProcessPoolExecutor(args.jobs) as pool:
        bases = {m: pool.submit(run, m, 0, 0.0, args.quick) for m in modes}
        for m in modes:
            results[(m, 0)] = bases[m].result()
        jobs = {
            (m, extra): pool.submit(run, m, n, results[(m, 0)]["virtual_time_s"], args.quick)
            for m in modes
            for extra, n in EXTRA.items()
            if n
        }
        for key, job in jobs.items():
            results[key] = job.result()
            print(f"{key[0]:13s} +{key[1]:3d}%  done ({results[key]['wall_s']:.0f} s)", flush=True)
    rows = []
    for (mode, extra), s in sorted(results.items()):
        base = results[(mode, 0)]
        target = loss_at_tokens(base["evals"], TARGET_AT * base["tokens"])
        t = time_to_loss(s["evals"], target)
        t_base = time_to_loss(base["evals"], target)
        rows.append(
            {
                "mode": mode,
                "extra_compute_pct": extra,
                "temporary_learners": EXTRA[extra],
                "target_loss": target,
                "time_to_target_s": t,
                "relative_time": t / t_base if t is not None and t_base else None,
                "published": PUBLISHED[mode][extra],
                "final_loss": s["heldout_loss"],
                "run_time_s": s["virtual_time_s"],  # virtual seconds (wall on Ray)
                "ledger_violations": len(s.get("ledger_violations", [])),
            }
        )
    if args.ray:
        rows += ray_rows()
    name = "scavenging-quick" if args.quick else "scavenging"
    args.out.mkdir(parents=True, exist_ok=True)
    plot(results, rows, args.out, name)
    write_results(
        args.out,
        name,
        rows,
        list(rows[0]),
        {
            "config": REFERENCE.name,
            "quick": args.quick,
            "window": WINDOW,
            "target_at_budget_fraction": TARGET_AT,
            "num_evals": NUM_EVALS,
        },
    )


if __name__ == "__main__":
    main()
