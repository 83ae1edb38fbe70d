"""Layer: sim (pure, no Ray, no JAX). Cross-datacenter bandwidth each system needs to keep
its goodput, and the goodput it gets on a given link (docs/algorithm.md section 9).

Each datacenter has one WAN link (full duplex, the same in both directions).

- Data-parallel: gradients are reduced inside each datacenter, then all-reduced across the
  D datacenters by a ring (reduce-scatter then all-gather), which puts 2 (D - 1) / D times
  the gradient's bytes on every datacenter's link, each way, every step. To keep its goodput
  the all-reduce must fit in a step (overlapped with the backward pass, the best case), so it
  needs those bytes per step time. On a slower link a step lasts as long as the all-reduce
  (bytes / bandwidth, plus 2 (D - 1) latencies around the ring): goodput = step / that.
- Decoupled: every learner sends each of its P fragments' outer gradients up once per H
  steps (`wire_up`) and receives the merged fragment down (`wire_down`). Fragments are
  staggered, one due every H / P steps, and an exchange overlaps with the next tau steps, so
  each must cross within min(tau, H / P) steps: the bandwidth needed is a fragment's bytes
  (times the learners behind the link) per that window, in the busier direction. A learner
  never waits for a fragment (section 4), so a slower link costs staleness, not time, as
  long as it carries a fragment per H / P steps; below that the fragments queue and only
  the share that crosses reaches the global model: goodput = (H / P steps) / transfer time.

Byte counts come from `wire.wire_bytes` (blockwise int4 scales included), link times from
`links.link_seconds`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ray_diloco.algorithm.links import link_seconds
from ray_diloco.algorithm.wire import publish_dtype, wire_bytes
from ray_diloco.config import BandwidthSimConfig, LinkConfig, WireDtype
from ray_diloco.sim.figures import save_figure

# The published pair: 198 Gbps for data-parallel against 0.84 Gbps for Decoupled DiLoCo across
# 8 datacenters (arXiv 2604.21428 and its announcement). Model size, step time, H and the wire
# formats are not given with it; "published-pair" states a set under which the formulas
# here give both figures: a 12B model at 1.7 s a step (data-parallel, bfloat16: 198 Gbps)
# and int4 fragments both ways with one due per step, H = P = 38 (0.84 Gbps).
PUBLISHED_GBPS = {"data_parallel": 198.0, "decoupled": 0.84}
PRESETS: dict[str, dict[str, Any]] = {
    "ray-diloco": {},
    "published-pair": {"sync_every": 38, "num_fragments": 38, "wire_down": "int4"},
}

Row = dict[str, Any]


def dp_bytes_per_step(cfg: BandwidthSimConfig) -> float:
    """Bytes each datacenter's link carries each way per step: a ring all-reduce."""
    d = cfg.datacenters
    grads = wire_bytes(round(cfg.model_params), cfg.dp_wire, cfg.int4_block_size)
    return 2 * (d - 1) / d * grads


def down_wire(cfg: BandwidthSimConfig) -> WireDtype:
    return cfg.wire_down if cfg.wire_down is not None else publish_dtype(cfg.wire_up)


def fragment_bytes(cfg: BandwidthSimConfig) -> float:
    """Bytes one fragment exchange puts on a datacenter's link in the busier direction."""
    n = math.ceil(cfg.model_params / cfg.num_fragments)
    up = wire_bytes(n, cfg.wire_up, cfg.int4_block_size)
    down = wire_bytes(n, down_wire(cfg), cfg.int4_block_size)
    return cfg.learners_per_datacenter * max(up, down)


def window_steps(cfg: BandwidthSimConfig) -> float:
    """Steps a fragment has to cross: its overlap window, or the gap to the next fragment."""
    every = cfg.sync_every / cfg.num_fragments
    return min(cfg.overlap_steps, every) if cfg.overlap_steps > 0 else every


def needed_gbps(cfg: BandwidthSimConfig) -> dict[str, float]:
    """Link bandwidth (Gbps) each system needs to keep its goodput."""
    t = cfg.step_time_s
    return {
        "data_parallel": dp_bytes_per_step(cfg) * 8 / t / 1e9,
        "decoupled": fragment_bytes(cfg) * 8 / (window_steps(cfg) * t) / 1e9,
    }


def goodput_on(cfg: BandwidthSimConfig, gbps: float) -> dict[str, float]:
    """Fraction of compute that reaches the model on a link of `gbps` (failures aside)."""
    t = cfg.step_time_s
    ring = LinkConfig(bandwidth_gbps=gbps, latency_ms=2 * (cfg.datacenters - 1) * cfg.latency_ms)
    allreduce_s = link_seconds(ring, round(dp_bytes_per_step(cfg)))
    wan = LinkConfig(bandwidth_gbps=gbps, latency_ms=cfg.latency_ms)
    fragment_s = link_seconds(wan, round(fragment_bytes(cfg)))
    every_s = cfg.sync_every / cfg.num_fragments * t
    return {
        "data_parallel": t / max(t, allreduce_s),
        "decoupled": min(1.0, every_s / fragment_s),
    }


def rows(
    cfg: BandwidthSimConfig,
    presets: Sequence[str],
    datacenters: Sequence[int],
    links: Sequence[float],
) -> list[Row]:
    """One row per (preset, datacenters, system): bandwidth needed and goodput per link."""
    out: list[Row] = []
    for preset in presets:
        for d in datacenters:
            c = cfg.model_copy(update={**PRESETS[preset], "datacenters": d})
            need, on = needed_gbps(c), [goodput_on(c, g) for g in links]
            for system in ("data_parallel", "decoupled"):
                published = (
                    PUBLISHED_GBPS[system] if preset == "published-pair" and d == 8 else None
                )
                out.append(
                    {
                        "preset": preset,
                        "datacenters": d,
                        "system": system,
                        "model_params": c.model_params,
                        "step_time_s": c.step_time_s,
                        "H": c.sync_every,
                        "P": c.num_fragments,
                        "tau": c.overlap_steps,
                        "wire": c.dp_wire
                        if system == "data_parallel"
                        else f"{c.wire_up}/{down_wire(c)}",
                        "needed_gbps": need[system],
                        "published_gbps": published,
                        "goodput_on": {f"{g:g}": o[system] for g, o in zip(links, on, strict=True)},
                    }
                )
    return out


def _rate(gbps: float) -> str:
    return f"{gbps:.3g} Gbps" if gbps >= 1 else f"{1000 * gbps:.3g} Mbps"


def format_table(table_rows: Sequence[Row]) -> str:
    links = list(table_rows[0]["goodput_on"]) if table_rows else []
    head = ["preset", "datacenters", "system", "H = P, tau", "wire", "needs", "published"]
    head += [f"goodput on {g} Gbps" for g in links]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table_rows:
        cells = [
            r["preset"],
            str(r["datacenters"]),
            r["system"].replace("_", "-"),
            "-" if r["system"] == "data_parallel" else f"{r['H']}, {r['tau']}",
            r["wire"],
            _rate(r["needed_gbps"]),
            "-" if r["published_gbps"] is None else _rate(r["published_gbps"]),
        ]
        cells += [f"{100 * r['goodput_on'][g]:.1f}%" for g in links]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(cfg: BandwidthSimConfig, path: str | Path, links: Sequence[float]) -> Path:
    """PNG: bandwidth needed against model size, per system, at the config's step time and
    datacenters (a fixed step time: the chips per learner grow with the model)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    sizes = np.logspace(9, 12, 31)
    series = {f"data-parallel ({cfg.dp_wire} all-reduce)": ("ray-diloco", "data_parallel")}
    for preset in PRESETS:
        c = cfg.model_copy(update=PRESETS[preset])
        name = (
            f"decoupled, {preset} ({c.wire_up} up, {down_wire(c)} down, "
            f"H = {c.sync_every}, P = {c.num_fragments})"
        )
        series[name] = (preset, "decoupled")
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for name, (preset, system) in series.items():
        need = [
            needed_gbps(cfg.model_copy(update={**PRESETS[preset], "model_params": float(n)}))[
                system
            ]
            for n in sizes
        ]
        ax.plot(sizes, need, "--" if system == "data_parallel" else "-", label=name)
    for g in links:
        ax.axhline(g, color="grey", lw=0.8, ls=":")
    span = f"{min(links):g}-{max(links):g} Gbps links"
    ax.axhspan(min(links), max(links), color="grey", alpha=0.12, label=span)
    if cfg.datacenters == 8:  # the published pair is for 8 datacenters (and a 12B model here)
        ax.plot(
            [12e9, 12e9],
            list(PUBLISHED_GBPS.values()),
            "*",
            ms=14,
            color="white",
            mec="black",
            mew=0.8,
            label="published pair (placed at 12B)",
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("model parameters")
    ax.set_ylabel("WAN bandwidth needed per datacenter (Gbps)")
    ax.set_title(
        f"{cfg.datacenters} datacenters, {cfg.learners_per_datacenter} learner(s) each, "
        f"{cfg.step_time_s:g} s per step at every size",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    return save_figure(fig, path)
