"""Layer: sim (pure, no Ray). The goodput sweep over cluster sizes and learner counts, the
calibration of its one calibrated term, its markdown table and its plot (docs/algorithm.md
section 10; docs/goodput.md).

One failure trace per cluster size is shared by every system and every learner count, so the
rows of one size differ only in how the systems react to the same failures. Rows are flat
dicts (JSON-ready), one per (chips, system, learners), each with the CPU seconds its system
took on the shared trace, the published figure where one exists, and whether that cell set
the calibration (`calibration_cell`) or is an out-of-sample check of the model.

A cell in which no round can commit (`goodput_sim.check_feasible`) is not simulated: its row
says why (`infeasible`) and the sweep logs a warning.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ray_diloco.config import DilocoConfig, GoodputSimConfig, SynchronizerConfig
from ray_diloco.sim.figures import save_figure
from ray_diloco.sim.goodput_sim import (
    InfeasibleError,
    SystemResult,
    check_feasible,
    data_parallel,
    decoupled,
    elastic_dp,
    elastic_per_learner,
)
from ray_diloco.sim.goodput_trace import FailureTrace, make_trace

logger = logging.getLogger(__name__)

CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
LEARNERS = (2, 4, 8, 16)

# Published goodput at 1.2M chips (Decoupled DiLoCo, arXiv 2604.21428, and its announcement):
# data-parallel 27%, elastic data-parallel 58%, and M = 2 / 4 / 8 / 16 learners.
ANCHOR_CHIPS = 1_200_000
PUBLISHED: dict[tuple[str, int], float] = {
    ("data_parallel", 1): 0.27,
    ("elastic_dp", 1): 0.58,
    ("decoupled", 2): 0.70,
    ("decoupled", 4): 0.82,
    ("decoupled", 8): 0.88,
    ("decoupled", 16): 0.93,
}

# The one column of the published figure the model is calibrated on: its cell sets
# `restart_cost_s`; every other published cell is an out-of-sample check.
CALIBRATION_COLUMN = ("data_parallel", 1)

Row = dict[str, Any]


def published(chips: int, system: str, learners: int) -> float | None:
    """The published goodput of this cell, if there is one."""
    return PUBLISHED.get((system, learners)) if chips == ANCHOR_CHIPS else None


def cell_goodput(cfg: GoodputSimConfig, trace: FailureTrace, cell: tuple[str, int]) -> float:
    """Goodput of a published cell's system (data-parallel, elastic, or decoupled with M
    learners) on one trace."""
    system, m = cell
    if system == "data_parallel":
        return data_parallel(cfg, trace).goodput
    if system == "elastic_dp":
        return elastic_dp(cfg, trace).goodput
    c = cfg.model_copy(update={"num_learners": m, "quorum_min": min(cfg.quorum_min, m)})
    return decoupled(c, trace).goodput


def implied(
    cfg: GoodputSimConfig,
    field: str,
    cell: tuple[str, int],
    trace: FailureTrace | None = None,
    hi: float = 3600.0,
    precision_s: float = 0.1,
) -> float | None:
    """The value of the cost `field` (seconds; goodput falls as it grows) at which `cell`
    gives its published goodput at 1.2M chips, by bisection to `precision_s` within [0, hi]
    (a cell still above its figure at `hi` gives `hi`); None when even a cost of 0 leaves it
    below (the other costs alone lose more)."""
    base = cfg.model_copy(update={"chips": ANCHOR_CHIPS})
    trace = trace if trace is not None else make_trace(base)
    target = PUBLISHED[cell]

    def goodput(x: float) -> float:
        return cell_goodput(base.model_copy(update={field: x}), trace, cell)

    if goodput(0.0) < target:
        return None
    lo = 0.0
    while hi - lo > precision_s:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if goodput(mid) > target else (lo, mid)
    return round((lo + hi) / 2, 1)


def calibrate(cfg: GoodputSimConfig, trace: FailureTrace | None = None) -> float | None:
    """`restart_cost_s` at which data-parallel gives its published goodput at 1.2M chips, to
    0.1 s; None when even a free restart leaves it below."""
    return implied(cfg, "restart_cost_s", CALIBRATION_COLUMN, trace)


def out_of_sample(rows: Sequence[Row]) -> list[Row]:
    """Published against simulated, per published cell, the calibration cell marked."""
    return [
        {
            "chips": r["chips"],
            "system": r["system"],
            "learners": r["learners"],
            "published": r["published"],
            "simulated": r["goodput"],
            "error_points": round(100 * (r["goodput"] - r["published"]), 2),
            "calibration_cell": r["calibration_cell"],
        }
        for r in rows
        if r.get("published") is not None and r.get("goodput") is not None
    ]


def sweep(
    cfg: GoodputSimConfig,
    chips: Sequence[int] = CHIPS,
    learners: Sequence[int] = LEARNERS,
    diloco: DilocoConfig | None = None,
    sync: SynchronizerConfig | None = None,
) -> tuple[list[Row], dict[str, float]]:
    """Every system at every cluster size; decoupled and per-learner elastic at every M.

    Returns the rows and where the CPU time went (seconds per part, summed over sizes)."""
    rows: list[Row] = []
    profile: defaultdict[str, float] = defaultdict(float)

    def timed(part: str, system: Callable[..., SystemResult], *args: Any) -> None:
        t0 = time.process_time()
        res = system(*args)
        cpu = time.process_time() - t0
        profile[part] += cpu
        rows.append({**row_of(res), "cpu_s": cpu})

    for n in chips:
        t0 = time.process_time()
        base = cfg.model_copy(update={"chips": n})
        trace = make_trace(base)
        profile["trace"] += time.process_time() - t0
        timed("data_parallel", data_parallel, base, trace)
        timed("elastic_dp", elastic_dp, base, trace)
        for m in learners:
            # model_copy skips validation: clip K so a small M still has a reachable quorum.
            c = base.model_copy(update={"num_learners": m, "quorum_min": min(cfg.quorum_min, m)})
            try:
                check_feasible(c, diloco)
            except InfeasibleError as err:
                logger.warning("sweep: %d chips, M=%d not simulated: %s", n, m, err)
                rows.append(
                    {
                        "chips": n,
                        "system": "decoupled",
                        "learners": m,
                        "goodput": None,
                        "uptime": None,
                        "infeasible": str(err),
                        "published": published(n, "decoupled", m),
                        "calibration_cell": False,
                        "cpu_s": 0.0,
                    }
                )
            else:
                timed("decoupled", decoupled, c, trace, diloco, sync)
            timed("elastic_dp_per_learner", elastic_per_learner, c, trace)
        logger.info("sweep: %d chips, %d failures", n, trace.num_failures)
    return rows, dict(profile)


def row_of(res: SystemResult) -> Row:
    """A result as a JSON-ready row, with its published figure and calibration mark."""
    pub = published(res.chips, res.system, res.learners)
    cal = pub is not None and (res.system, res.learners) == CALIBRATION_COLUMN
    return {**asdict(res), "published": pub, "calibration_cell": cal}


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def columns(rows: Sequence[Row]) -> list[tuple[str, int]]:
    """(system, learners) of the table's columns: the two baselines, then decoupled per M."""
    cols = [("data_parallel", 1), ("elastic_dp", 1)]
    ms = sorted({r["learners"] for r in rows if r["system"] == "decoupled"})
    return cols + [("decoupled", m) for m in ms]


def label(system: str, m: int) -> str:
    return {"data_parallel": "data-parallel", "elastic_dp": "elastic DP"}.get(
        system, f"decoupled M={m}"
    )


def format_table(rows: Sequence[Row]) -> str:
    """Markdown: goodput (uptime) per system and cluster size, the published figure in
    brackets; then decoupled M learners on N chips against elastic data-parallel on N/M chips
    (same trace, each learner's slices)."""
    idx = {(r["chips"], r["system"], r["learners"]): r for r in rows}
    chips = sorted({r["chips"] for r in rows})
    cols = columns(rows)
    lines = [
        "Goodput (uptime) per system; [published goodput]",
        "",
        "| chips | " + " | ".join(label(s, m) for s, m in cols) + " |",
        "|---:|" + "---:|" * len(cols),
    ]
    for n in chips:
        cells = []
        for s, m in cols:
            r = idx.get((n, s, m))
            if r is None:
                cells.append("-")
                continue
            pub = published(n, s, m)
            anchor = f" [{pub:.0%}]" if pub is not None else ""
            if r.get("calibration_cell"):
                anchor += " (calibrated)"
            cells.append(f"{_pct(r['goodput'])} ({_pct(r['uptime'])}){anchor}")
        lines.append(f"| {n:,} | " + " | ".join(cells) + " |")
    checks = out_of_sample(rows)
    if checks:
        lines += [
            "",
            "Published against simulated (one calibration cell, the rest out of sample)",
            "",
            "| chips | system | published | simulated | error (points) | |",
            "|---:|---|---:|---:|---:|---|",
        ]
        for c in checks:
            lines.append(
                f"| {c['chips']:,} | {label(c['system'], c['learners'])} | "
                f"{_pct(c['published'])} | {_pct(c['simulated'])} | {c['error_points']:+.1f} | "
                f"{'calibration' if c['calibration_cell'] else 'out of sample'} |"
            )
    pairs = [(n, m) for n in chips for s, m in cols if s == "decoupled" and (n, s, m) in idx]
    pairs = [p for p in pairs if (p[0], "elastic_dp_per_learner", p[1]) in idx]
    if pairs:
        lines += [
            "",
            "Decoupled, M learners on N chips, vs elastic data-parallel on N/M chips",
            "",
            "| chips N | M | chips/learner | decoupled goodput | elastic DP on N/M | failures |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for n, m in pairs:
            d = idx[(n, "decoupled", m)]
            if d["goodput"] is None:
                continue
            e = idx[(n, "elastic_dp_per_learner", m)]
            lines.append(
                f"| {n:,} | {m} | {n // m:,} | {_pct(d['goodput'])} | {_pct(e['goodput'])} "
                f"| {d['failures']:,} |"
            )
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[Row], path: str | Path, title: str) -> Path:
    """PNG of goodput against chips: one line per decoupled M and the two baselines, the
    published figures as stars in the line's colour."""
    import matplotlib

    matplotlib.use("Agg")  # no display: runs headless in CI and on cluster heads
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, ax = plt.subplots(figsize=(9, 4.8))
    for s, m in columns(rows):
        pts = sorted(
            (r["chips"], r["goodput"])
            for r in rows
            if r["system"] == s and r["learners"] == m and r["goodput"] is not None
        )
        style = "--" if s != "decoupled" else "-"
        (line,) = ax.plot(
            [p[0] for p in pts], [100 * p[1] for p in pts], style, marker="o", label=label(s, m)
        )
        pub = PUBLISHED.get((s, m))
        if pub is not None:
            ax.plot(
                ANCHOR_CHIPS, 100 * pub, "*", ms=14, color=line.get_color(), mec="black", mew=0.8
            )
    ax.set_xscale("log")
    chips = sorted({r["chips"] for r in rows})
    ax.set_xticks(chips, labels=[f"{n / 1e6:g}M" if n >= 1e6 else f"{n / 1e3:g}k" for n in chips])
    ax.minorticks_off()
    ax.set_ylim(-2, 102)  # a line at 0 stays visible above the axis
    ax.set_xlabel("chips in the cluster")
    ax.set_ylabel("goodput (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    star = Line2D([], [], ls="", marker="*", ms=12, color="white", mec="black", mew=0.8)
    handles, labels = ax.get_legend_handles_labels()
    # Outside the axes, so that it hides no line (data-parallel runs along 0 under slow repair).
    ax.legend(
        [*handles, star],
        [*labels, "published, 1.2M chips\n(data-parallel's: the\ncalibration cell)"],
        fontsize=8,
        loc="center left",
        bbox_to_anchor=(1.01, 0.5),
    )
    return save_figure(fig, path)
