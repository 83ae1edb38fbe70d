"""Layer: algorithm (pure, no Ray, no JAX). The goodput sweep over cluster sizes and learner
counts, its markdown table and its plot (algorithm.md section 10).

One failure trace per cluster size is shared by every system and every learner count, so the
rows of one size differ only in how the systems react to the same failures. Rows are flat
dicts (JSON-ready), one per (chips, system, learners).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ray_diloco.config import DilocoConfig, GoodputSimConfig, SynchronizerConfig
from ray_diloco.sim.goodput_sim import (
    DecoupledSim,
    data_parallel,
    elastic_dp,
    elastic_per_learner,
)
from ray_diloco.sim.goodput_trace import make_trace

logger = logging.getLogger(__name__)

CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
LEARNERS = (2, 4, 8, 16)

Row = dict[str, Any]


def sweep(
    cfg: GoodputSimConfig,
    chips: Sequence[int] = CHIPS,
    learners: Sequence[int] = LEARNERS,
    diloco: DilocoConfig | None = None,
    sync: SynchronizerConfig | None = None,
) -> list[Row]:
    """Every system at every cluster size; decoupled and per-learner elastic at every M."""
    rows: list[Row] = []
    for n in chips:
        t0 = time.perf_counter()
        base = cfg.model_copy(update={"chips": n})
        trace = make_trace(base)
        found = [data_parallel(base, trace), elastic_dp(base, trace)]
        for m in learners:
            # model_copy skips validation: clip K so a small M still has a reachable quorum.
            c = base.model_copy(update={"num_learners": m, "quorum_min": min(cfg.quorum_min, m)})
            found.append(DecoupledSim(c, trace, diloco, sync).run())
            found.append(elastic_per_learner(c, trace))
        rows.extend(asdict(r) for r in found)
        logger.info(
            "sweep: %d chips, %d failures, %.1fs", n, trace.num_failures, time.perf_counter() - t0
        )
    return rows


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _columns(rows: Sequence[Row]) -> list[tuple[str, int]]:
    cols = [("data_parallel", 1), ("elastic_dp", 1)]
    ms = sorted({r["learners"] for r in rows if r["system"] == "decoupled"})
    return cols + [("decoupled", m) for m in ms]


def _label(system: str, m: int) -> str:
    return {"data_parallel": "data-parallel", "elastic_dp": "elastic DP"}.get(
        system, f"decoupled M={m}"
    )


def format_table(rows: Sequence[Row]) -> str:
    """Markdown: goodput (uptime) per system and cluster size, then decoupled M learners on N
    chips against elastic data-parallel on N/M chips (same trace, each learner's slices)."""
    idx = {(r["chips"], r["system"], r["learners"]): r for r in rows}
    chips = sorted({r["chips"] for r in rows})
    cols = _columns(rows)
    lines = [
        "Goodput (uptime) per system",
        "",
        "| chips | " + " | ".join(_label(s, m) for s, m in cols) + " |",
        "|---:|" + "---:|" * len(cols),
    ]
    for n in chips:
        cells = []
        for s, m in cols:
            r = idx.get((n, s, m))
            cells.append("-" if r is None else f"{_pct(r['goodput'])} ({_pct(r['uptime'])})")
        lines.append(f"| {n:,} | " + " | ".join(cells) + " |")
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
            e = idx[(n, "elastic_dp_per_learner", m)]
            lines.append(
                f"| {n:,} | {m} | {n // m:,} | {_pct(d['goodput'])} | {_pct(e['goodput'])} "
                f"| {d['failures']:,} |"
            )
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[Row], path: str | Path) -> Path:
    """PNG of goodput against chips: one line per decoupled M and the two baselines."""
    import matplotlib

    matplotlib.use("Agg")  # no display: runs headless in CI and on cluster heads
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s, m in _columns(rows):
        pts = sorted(
            (r["chips"], r["goodput"]) for r in rows if r["system"] == s and r["learners"] == m
        )
        style = "--" if s != "decoupled" else "-"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=_label(s, m))
    ax.set_xscale("log")
    chips = sorted({r["chips"] for r in rows})
    ax.set_xticks(chips, labels=[f"{n / 1e6:g}M" if n >= 1e6 else f"{n / 1e3:g}k" for n in chips])
    ax.minorticks_off()
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("chips")
    ax.set_ylabel("goodput")
    ax.set_title("Goodput under the same failure trace")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
