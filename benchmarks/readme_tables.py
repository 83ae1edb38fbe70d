"""Write the README's and the docs' results tables, and the configuration reference, from the
benchmarks' JSON and the config schema: one command for every generated figure.

Each table sits between `<!-- results:NAME -->` and `<!-- /results:NAME -->` in README.md or a
page under docs/, and is rebuilt from `benchmarks/results/NAME.json` with the command that
produced it and the machine it ran on (a page under docs/results/ gets the plots too), so no
page says what the JSON does not. docs/configuration.md is written whole from the pydantic
schema (`config_reference.py`).

    python benchmarks/readme_tables.py           # rewrite README.md, docs/**/*.md
    python benchmarks/readme_tables.py --check   # exit 1 (and say which) if any is stale
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ray_diloco.observe.report import markdown_table

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CONFIG_PAGE = DOCS / "configuration.md"

Rows = list[dict[str, Any]]


def _num(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _pct(x: float | None) -> str:
    """A relative difference; "-" where there was nothing to compare with (a row whose
    batch has no synchronous DiLoCo run)."""
    if x is None:
        return "-"
    return "0" if x == 0 else f"{100 * x:+.1f}%"


def _rate(gbps: float) -> str:
    return f"{gbps:.3g} Gbps" if gbps >= 1 else f"{1000 * gbps:.3g} Mbps"


def _refused(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {reason}" for reason, n in counts.items()) or "0"


def _merged(r: dict[str, Any]) -> str:
    # rows measured before the benchmarks recorded merged shares have none
    share = r.get("merged_share_min")
    return "-" if share is None else f"{share:.3f}"


def quality(data: dict[str, Any]) -> str:
    rows = [
        {
            "variant": r["variant"],
            "held-out loss": _num(r["heldout_loss"]),
            "vs data-parallel": _pct(r["vs_data_parallel"]),
            "rounds": r["rounds"] or "-",
            "contributors/round": f"{r['mean_contributors']:.3g}" if r["rounds"] else "-",
            "bytes/token": f"{r['bytes_per_token']:.4g}",
            # the earliest rows were run before the benchmark recorded the refusals
            "refused": _refused(r["refused"]) if "refused" in r else "not recorded",
            "merged share (min)": _merged(r),
        }
        for r in data["rows"]
    ]
    return markdown_table(rows, list(rows[0]))


def quality_horizon(data: dict[str, Any]) -> str:
    rows = [
        {
            "variant": r["variant"],
            "M": r["learners"],
            "seeds": r["seeds"],
            "held-out loss (mean)": _num(r["heldout_loss"]),
            "spread": _num(r["spread"]) if r["seeds"] > 1 else "-",
            "vs data-parallel": _pct(r["vs_data_parallel"]),
            "vs synchronous": _pct(r["vs_synchronous"]),
            "outer steps / fragment": (
                f"{r['outer_steps_per_fragment']:.0f}" if r["rounds"] else "-"
            ),
            "contributors/round": f"{r['mean_contributors']:.3g}" if r["rounds"] else "-",
            "refused": _refused(r["refused"]),
            "merged share (min)": _merged(r),
        }
        for r in data["rows"]
    ]
    return markdown_table(rows, list(rows[0]))


def heterogeneous(data: dict[str, Any]) -> str:
    def spread(r: dict[str, Any], key: str) -> str:
        return _num(r[f"{key}_spread"]) if r["seeds"] > 1 else "-"

    rows = [
        {
            "variant": r["variant"],
            "seeds": r["seeds"],
            "held-out loss (mean)": _num(r["heldout_loss"]),
            "spread": spread(r, "heldout_loss"),
            # a refused offer's tokens count against goodput; the merged figure is the one to read
            "goodput": _num(r["goodput"]),
            "goodput_merged": _num(r["goodput_merged"]),
            "learners a round": f"{r['mean_contributors']:.2f}",
            "merged share fast / slow (min)": (
                f"{r['merged_share_fast']:.3f} / {r['merged_share_slow']:.3f} "
                f"({r['merged_share_min']:.3f})"
            ),
            "overwritten fast / slow": (
                f"{r['overwritten_share_fast']:.2f} / {r['overwritten_share_slow']:.2f}"
            ),
        }
        for r in data["rows"]
    ]
    return markdown_table(rows, list(rows[0]))


def goodput(data: dict[str, Any]) -> str:
    seeds = data["meta"]["chaos_seeds"]
    first = [r for r in data["rows"] if r["chaos_seed"] in (None, seeds[0])]
    rows = [
        {
            "mode": r["mode"],
            "failures (count)": f"{r['failures']} ({r['num_failures']})",
            "goodput": _num(r["goodput"]),
            "vs data-parallel": _num(r["goodput_vs_dp"], 2),
            "goodput (merged work)": _num(r["goodput_merged"]),
            "uptime": _num(r["uptime"]),
            "tokens / virtual s": f"{r['tokens_per_virtual_s']:,.0f}",
            "virtual s to target loss": _num(r["time_to_target_s"], 1),
            "final held-out loss": _num(r["heldout_loss"]),
            "work lost": _num(r.get("work_lost"), 3),
        }
        for r in first
    ]
    target = data["meta"]["target_loss"]
    parts = [
        f"Chaos seed {seeds[0]}:",
        markdown_table(rows, list(rows[0])),
        f"Target loss: {target:.3f}.",
    ]
    if len(seeds) > 1:
        parts += [
            "Every failure schedule: virtual s to the target loss (final held-out loss), and "
            "on how many schedules the mode got there before data-parallel:",
            markdown_table(
                schedules := _goodput_schedules(data["rows"], seeds), list(schedules[0])
            ),
        ]
    return "\n\n".join(parts)


def _goodput_schedules(rows: Rows, seeds: list[int]) -> Rows:
    """Per mode and failure rate: each schedule's time to the target (final loss), and on how
    many schedules the mode got there before data-parallel did under the same one."""
    by = {
        (r["mode"], r["failures"], r["chaos_seed"]): r for r in rows if r["chaos_seed"] is not None
    }
    out = []
    for mode, failures in dict.fromkeys((m, f) for m, f, _ in by):
        row: dict[str, Any] = {"mode": mode, "failures": failures}
        ahead = 0
        for seed in seeds:
            r, dp = by[(mode, failures, seed)], by[("data_parallel", failures, seed)]
            row[f"seed {seed}"] = f"{_num(r['time_to_target_s'], 1)} ({_num(r['heldout_loss'])})"
            t, t_dp = r["time_to_target_s"], dp["time_to_target_s"]
            ahead += t is not None and (t_dp is None or t < t_dp)
        row["before data-parallel"] = "-" if mode == "data_parallel" else f"{ahead} of {len(seeds)}"
        out.append(row)
    return out


def bandwidth(data: dict[str, Any]) -> str:
    rows = [
        {
            "mode": r["mode"],
            "wire (up, down)": r["wire"],
            "H": r["setting"].removeprefix("H="),
            "bytes/token": f"{r['bytes_per_token']:.4g}",
            "fewer than DP": f"{r['x_fewer_than_dp']:.3g}x",
            "bound": "-" if r["mode"] == "data_parallel" else f"{r['bound_x']:.3g}x",
            "held-out loss": _num(r["heldout_loss"]),
            "vs bfloat16 wire": "-" if r["loss_vs_bf16"] is None else _pct(r["loss_vs_bf16"]),
            "needs for goodput 0.95": (
                "-" if r["gbps_for_goodput_0.95"] is None else _rate(r["gbps_for_goodput_0.95"])
            ),
        }
        for r in data["rows"]
    ]
    return markdown_table(rows, list(rows[0]))


def overhead(data: dict[str, Any]) -> str:
    meta = data["meta"]
    runs = [r for r in data["rows"] if isinstance(r["rep"], int)]
    rows = []
    for way in ("bare", "learner only", "ray"):
        tps = sorted(r["tokens_per_s"] for r in runs if r["way"] == way)
        rows.append({"measure": f"tokens/s, {way} (median)", "value": f"{tps[len(tps) // 2]:,.0f}"})
    rows.append({"measure": "ray / bare (median)", "value": f"**{meta['median_ratio']:.3f}**"})
    rows.append(
        {
            "measure": "ray / learner only (median)",
            "value": f"{meta['median_ratio_learner_only']:.3f}",
        }
    )
    return markdown_table(rows, ["measure", "value"])


def sharded_learner(data: dict[str, Any]) -> str:
    meta = data["meta"]
    s, goals = meta["summary"], meta["goals"]

    def goal(key: str, most: bool) -> str:
        value, bound = s[key], goals[key]
        ok = value <= bound if most else value >= bound
        return f"{'<=' if most else '>='} {bound} ({'met' if ok else 'missed'})"

    pairs = ", ".join(f"{r:.3f}" for r in s["tokens_ratio_per_pair"])
    k = s["handoff_ratio_by_kind"]
    low, high = s["load_avg_1min_range"]
    rows = [
        {
            "measure": "params + optimizer state per device, fsdp 4 / replicated",
            "value": f"**{s['bytes_ratio']:.3f}x**",
            "goal": goal("bytes_ratio", most=True),
        },
        {
            "measure": "learner tokens/s, ray-diloco / bare jitted FSDP loop (median of pairs)",
            "value": f"**{s['tokens_ratio']:.3f}** ({pairs})",
            "goal": goal("tokens_ratio", most=False),
        },
        {
            "measure": "the same per CPU-second (median of pairs)",
            "value": f"{s['tokens_per_cpu_s_ratio']:.3f}",
            "goal": "",
        },
        {
            "measure": "step time, hand-off steps / others (copies started; collected, encoded)",
            "value": f"**{s['handoff_ratio']:.3f}x** ({k['begin']:.3f}x, {k['collect']:.3f}x)",
            "goal": goal("handoff_ratio", most=True),
        },
        {
            "measure": "peak RSS of the learner process per parameter",
            "value": f"{s['peak_bytes_per_param']:.1f} bytes",
            "goal": "reported",
        },
        {
            "measure": "1-minute load average during the runs (2 cores)",
            "value": f"{low:.1f} .. {high:.1f}",
            "goal": "",
        },
    ]
    return markdown_table(rows, ["measure", "value", "goal"])


RECOVERY_NAMES = {"kill_host_multi": "kill_host (two-host v5p learner)"}


def recovery(data: dict[str, Any]) -> str:
    rows = [
        {
            "fault": RECOVERY_NAMES.get(r["fault"], r["fault"]),
            "detected / injected": f"{r['detected']}/{r['injected']}",
            "detection (median)": f"{_num(r['detection_s_median'], 2)} s",
            "recovered": f"{r['recovered']}/{r['injected']}"
            + (f" ({r['superseded']} superseded)" if r.get("superseded") else ""),
            "contributing again (median)": f"{_num(r['recovery_s_median'], 1)} s",
            "rounds lost": ", ".join(map(str, r.get("rounds_lost") or [])) or "-",
        }
        for r in data["rows"]
    ]
    return markdown_table(rows, list(rows[0]))


def spread(data: dict[str, Any]) -> str:
    rows = [
        {
            "runs": label,
            "code": f"`{stats['commit']}`",
            "held-out loss (mean)": _num(stats["mean"]),
            "min .. max": f"{_num(stats['min'])} .. {_num(stats['max'])}",
            "spread": _num(stats["spread"]),
            "norm-guard refusals": str(stats["norm_outlier_total"]),
            "command": f"`{stats['command']}`",
        }
        for label, stats in data["meta"]["labels"].items()
    ]
    return markdown_table(rows, list(rows[0]))


def outage(data: dict[str, Any]) -> str:
    """One row per outage, the two rules side by side."""
    by = {(r["start_s"], r["length_s"], r["accelerate"]): r for r in data["rows"]}
    rows = []
    for (start, length, rule), r in by.items():
        if rule != "window":
            continue
        amplified = by.get((start, length, "all"))
        rows.append(
            {
                "outage": f"{length:g} s from {start:g} s" if length else "none",
                "tokens": str(r["tokens"]),
                "offers refused": str(r["refused"]),
                "held-out, window (default)": _num(r["heldout_loss"]),
                "held-out, all": _num(amplified["heldout_loss"]) if amplified else "-",
            }
        )
    return markdown_table(rows, list(rows[0]))


def goodput_sim(data: dict[str, Any]) -> str:
    rows, meta = data["rows"], data["meta"]
    learners = sorted({r["learners"] for r in rows if r["system"] == "decoupled"})
    systems = [("data_parallel", 1, "data-parallel"), ("elastic_dp", 1, "elastic DP")]
    systems += [("decoupled", m, f"decoupled M={m}") for m in learners]
    table = []
    for chips in sorted({r["chips"] for r in rows}):
        at = {(r["system"], r["learners"]): r for r in rows if r["chips"] == chips}
        row = {"chips": f"{chips:,}"}
        for system, m, name in systems:
            r = at[(system, m)]
            pub = f" **[{100 * r['published']:.0f}%]**" if r.get("published") is not None else ""
            if r["goodput"] is None:  # a cell in which no round can commit: not simulated
                row[name] = f"not simulated{pub}"
                continue
            row[name] = f"{100 * r['goodput']:.1f}% ({100 * r['uptime']:.0f}%){pub}"
        table.append(row)
    parts = sorted(meta["cpu_s_by_part"].items(), key=lambda kv: -kv[1])
    timing = (
        f"Goodput (uptime), **[published]** at 1.2M chips. The sweep took "
        f"**{meta['cpu_s']:.1f} s of CPU** on one core ({meta['wall_s']:.1f} s wall, load "
        f"{meta['load_avg_1min']:.0f} on the 2 cores); by part: "
        + ", ".join(f"{k} {v:.2f} s" for k, v in parts)
        + "."
    )
    return markdown_table(table, ["chips", *(name for _, _, name in systems)]) + f"\n\n{timing}"


def bandwidth_sim(data: dict[str, Any]) -> str:
    links = list(data["rows"][0]["goodput_on"])
    rows = []
    for r in data["rows"]:
        row = {
            "preset": r["preset"],
            "datacenters": r["datacenters"],
            "system": r["system"].replace("_", "-"),
            "H = P, tau": "-" if r["system"] == "data_parallel" else f"{r['H']}, {r['tau']}",
            "wire (up/down)": r["wire"],
            "needs": _rate(r["needed_gbps"]),
            "published": "-" if r["published_gbps"] is None else _rate(r["published_gbps"]),
        }
        for g in links:
            row[f"goodput on {g} Gbps"] = f"{100 * r['goodput_on'][g]:.1f}%"
        rows.append(row)
    return markdown_table(rows, list(rows[0]))


def scavenging(data: dict[str, Any]) -> str:
    rows = [
        {
            "system": r["mode"].replace("_", "-"),
            "extra compute": f"+{r['extra_compute_pct']}%",
            "temporary learners": r["temporary_learners"],
            "time to target": _num(r["time_to_target_s"], 2),
            "relative": _num(r["relative_time"], 2),
            "published": f"{r['published']:.2f}",
            "final loss": _num(r["final_loss"]),
            "tokens": f"{r['tokens'] / 1e6:.2f}M",
            "ledger exact": "yes" if r["ledger_violations"] == 0 else "no",
        }
        for r in data["rows"]
    ]
    whole = [
        {
            "system": r["mode"].replace("_", "-"),
            "sequences per learner": r["batch_per_learner"],
            "learners": r["learners"],
            "final loss": _num(r["final_loss"]),
            "against 4 learners": f"{100 * r['cost_vs_4_learners']:+.1f}%",
        }
        for r in data["meta"]["whole_run"]
    ]
    return "\n\n".join(
        [
            markdown_table(rows, list(rows[0])),
            "The same budget with the learners there for the whole run (copies of the 4 "
            "reference learners):",
            markdown_table(whole, list(whole[0])),
        ]
    )


def _params(n: int) -> str:
    return f"{n / 1e9:g}B" if n >= 1e9 else f"{n / 1e6:g}M"


def synchronizer(data: dict[str, Any]) -> str:
    meta = data["meta"]
    merge = [
        {
            "fragment": f"{r['fragment_mb']} MB",
            "learners": r["learners"],
            "wire": r["wire"],
            "merged, one core": f"**{r['mb_per_s']:,.0f} MB/s**",
            "memcpy, same process": f"{r['memcpy_mb_per_s']:,.0f} MB/s",
            "merge / memcpy": f"{1 / r['vs_memcpy']:.1f}x slower" if r["vs_memcpy"] < 1 else "-",
            "CPU s / round": _num(r["cpu_s_per_round"]),
            "wall s / round": _num(r["wall_s_per_round"]),
        }
        for r in meta["merge"]
    ]
    s = meta["load_setting"]
    load = [
        {
            "model": _params(r["params"]),
            "shards": r["shards"],
            "rounds/s (offered)": f"{r['rounds_per_s']:.2f} ({r['offered_rounds_per_s']:.2f})",
            "MB/s merged": f"{r['mb_per_s']:,.0f}",
            "offer to publication, median / p99": (
                f"{_num(r['latency_median_s'], 2)} / {_num(r['latency_p99_s'], 2)} s"
            ),
            "peak RSS of a shard": f"{r['max_shard_rss_mb']:,.0f} MB",
            "offers waited / dropped": f"{r['offers_waited']} / {r['offers_dropped']}",
            "kept up": "yes" if r["kept_up"] else "no",
        }
        for r in data["rows"]
    ]
    target = "met" if meta["merge_target_met"] else "missed"
    parts = [
        f"Merge, whole rounds in one process pinned to one core (target "
        f"{meta['target_mb_per_s']:,.0f} MB/s for 64 MB+ fragments: **{target}**):",
        markdown_table(merge, list(merge[0])),
        f"Load: {s['learners']} fake learners stepping every {s['step_s']} s, "
        f"H = {s['sync_every']}, P = {s['num_fragments']}, bfloat16 offers, measured over "
        f"{s['measure_s']:g} s after {s['warmup_s']:g} s of warm-up, every process on the "
        "same 2 cores:",
        markdown_table(load, list(load[0])),
    ]
    g = meta.get("published_scale")
    if g:
        parts.append(
            f"Published setting by arithmetic: {_params(g['params'])} parameters, "
            f"{g['learners']} learners, H = {g['sync_every']}, P = {g['num_fragments']}, "
            f"{g['step_time_s']} s a step: {g['learners']} x 4 B x {_params(g['params'])} / "
            f"({g['sync_every']} x {g['step_time_s']} s) = "
            f"**{g['contributions_gb_per_s']:.2f} GB/s** of float32 contributions to merge; at "
            f"{g['per_core_mb_per_s']:,.0f} MB/s per core that is **{g['cores']:.1f} cores**. "
            f"Memory: values, momentum, the newest publication and "
            f"{g['max_staleness_versions']} older ones = (3 + {g['max_staleness_versions']}) x "
            f"4 B x {_params(g['params'])} = **{g['resident_gb']:.0f} GB** resident, plus a "
            f"round's {g['learners']} contributions and scratch, ({g['learners']} + 3) x "
            f"{g['fragment_gb']:.1f} GB = {g['working_gb']:.1f} GB while merging."
        )
    return "\n\n".join(parts)


# The config's default as the quality benchmarks name it (common.PULLED), and the job files'
# rule before it (offers, K = 2 without the grace window, the mix, the sqrt step, 4 bits both
# ways), which the rows not yet rerun on pulled rounds measured.
DEFAULT_VARIANT = "default: pulled, K=1, kept unsent work"
FORMER_VARIANT = "decoupled K=1 grace, sqrt step, mixing alpha 0.25, int4 both ways, K=2, no grace"
# ... and as the goodput and bandwidth benchmarks name their modes
DEFAULT_MODE, FORMER_MODE = "decoupled, pulled (default)", "decoupled"
FORMER = " (offers, K = 2)"


def _load(name: str, results: Path) -> dict[str, Any]:
    return json.loads((results / f"{name}.json").read_text())


def headline(results: Path = RESULTS, pages: str = "docs/results/") -> str:
    """The README's one table: goodput, quality, bandwidth and recovery of the default against
    synchronous DiLoCo and data-parallel training, each row from its benchmark's JSON and
    linking its results page (`pages`: where they are from the page holding the table)."""
    good = _load("goodput", results)["rows"]
    # the default's row where its benchmark has one, else the former rule's, marked
    good_mode = DEFAULT_MODE if any(r["mode"] == DEFAULT_MODE for r in good) else FORMER_MODE

    def goodput_at(mode: str, failures: str) -> str:
        runs = [r["goodput"] for r in good if r["mode"] == mode and r["failures"] == failures]
        return f"{100 * sum(runs) / len(runs):.0f}%"

    horizon = {(r["variant"]): r for r in _load("quality_horizon", results)["rows"]}

    def loss(variant: str) -> str:
        r = horizon[variant]
        return f"{r['heldout_loss']:.3f}" + (
            f" ({_pct(r['vs_data_parallel'])})" if r["vs_data_parallel"] else ""
        )

    wire = {(r["mode"], r["wire"], r["setting"]): r for r in _load("bandwidth", results)["rows"]}
    wire_mode = DEFAULT_MODE if (DEFAULT_MODE, "int4 both ways", "H=24") in wire else FORMER_MODE

    def marked(mode: str) -> str:
        return FORMER if mode == FORMER_MODE else ""

    def per_token(mode: str, w: str) -> str:
        r = wire[(mode, w, "H=24")]
        value = r["bytes_per_token"]
        return (f"{value:,.0f}" if value >= 100 else f"{value:.3g}") + (
            f" ({r['x_fewer_than_dp']:.0f}x fewer)" if mode != "data_parallel" else ""
        )

    sim = {
        (r["system"], r["learners"]): r
        for r in _load("goodput_sim", results)["rows"]
        if r["chips"] == 1_200_000
    }
    kill = next(r for r in _load("recovery", results)["rows"] if r["fault"] == "kill_host")
    batch = ", global batch 512"
    rows = [
        {
            "measure": "goodput under aggressive failures (reference run, 3 schedules)",
            "ray_diloco (default)": goodput_at(good_mode, "aggressive") + marked(good_mode),
            "synchronous DiLoCo": goodput_at("synchronous", "aggressive"),
            "data-parallel": goodput_at("data_parallel", "aggressive"),
            "page": f"[goodput]({pages}goodput.md)",
        },
        {
            "measure": "goodput at 1.2M chips, simulated (8 learners)",
            # the sweep simulates the published method's rounds (goodput_sim.PUBLISHED_RULE)
            "ray_diloco (default)": (
                f"{100 * sim[('decoupled', 8)]['goodput']:.0f}% (the published rounds)"
            ),
            "synchronous DiLoCo": "-",
            "data-parallel": f"{100 * sim[('data_parallel', 1)]['goodput']:.0f}%",
            "page": f"[goodput at scale]({pages}goodput_sim.md)",
        },
        {
            "measure": "held-out loss, 104 outer steps a fragment (3 seeds)",
            "ray_diloco (default)": loss(DEFAULT_VARIANT),
            "synchronous DiLoCo": loss("synchronous"),
            "data-parallel": loss("data_parallel"),
            "page": f"[quality]({pages}quality_horizon.md)",
        },
        {
            "measure": "the same at 16x the global batch (3 seeds)",
            "ray_diloco (default)": loss(FORMER_VARIANT + batch) + FORMER,
            "synchronous DiLoCo": loss("synchronous" + batch),
            "data-parallel": loss("data_parallel" + batch),
            "page": f"[quality]({pages}quality_horizon.md)",
        },
        {
            "measure": "bytes per token trained, learner links (H = 24)",
            "ray_diloco (default)": per_token(wire_mode, "int4 both ways") + marked(wire_mode),
            "synchronous DiLoCo": per_token("synchronous", "int4 both ways"),
            "data-parallel": per_token("data_parallel", "float32"),
            "page": f"[bandwidth]({pages}bandwidth.md)",
        },
        {
            "measure": "a killed learner host on Ray: detected / contributing again (median)",
            "ray_diloco (default)": (
                f"{kill['detection_s_median']:.1f} s / {kill['recovery_s_median']:.1f} s"
                " (offers, K = 1 + grace)"
            ),
            "synchronous DiLoCo": "-",
            "data-parallel": "-",
            "page": f"[recovery]({pages}recovery.md)",
        },
    ]
    sources = ", ".join(
        f"`{n}.json`"
        for n in ("goodput", "goodput_sim", "quality_horizon", "bandwidth", "recovery")
    )
    return (
        f"From {sources} in `benchmarks/results/`; each row's page names the command that "
        f"wrote it and the machine.\n\n{markdown_table(rows, list(rows[0]))}"
    )


def synchronizer_scale(data: dict[str, Any]) -> str:
    meta = data["meta"]
    rows = [
        {
            "shard": r["shard"],
            "parameters": _params(r["params"]),
            "resident B/param (global + momentum + versions + differences + held)": (
                f"**{r['resident_bytes_per_param_total']:.2f}** ("
                + " + ".join(
                    f"{r['resident_bytes_per_param'][k]:.2f}"
                    for k in ("global", "momentum", "versions", "differences", "held")
                )
                + ")"
            ),
            "first cycle B/param": f"{r['first_cycle_bytes_per_param_total']:.2f}",
            "peak RSS; past the second cycle (beyond the state: working memory)": (
                f"{r['peak_rss_gb']:.2f} GB; {r['peak_rss_past_second_cycle_gb']:.2f} GB "
                f"({r['working_memory_gb']:.2f} GB, of which "
                f"{r['spare_bytes_per_param'] * r['params'] / 2**30:.2f} GB spare round buffers)"
            ),
            "round latency, median / p99 (p99 past the second cycle)": (
                f"{_num(r['latency_median_s'], 2)} / {_num(r['latency_p99_s'], 2)} s "
                f"({_num(r['latency_p99_steady_s'], 2)} s)"
            ),
            "CPU s a round: offers' arrival + round": (
                f"{r['arrival_cpu_s']:.2f} + {r['round_cpu_s']:.2f} "
                f"({r['contributions_gb_per_cpu_s']:.2f} GB/s)"
            ),
            "offers refused": r["offers_refused"],
            "kept up (past the second cycle)": (
                f"{'yes' if r['kept_up'] else 'no'} "
                f"({'yes' if r['kept_up_past_second_cycle'] else 'no'})"
            ),
            "on a core of its own": "yes" if r["keeps_up_on_own_core"] else "no",
            "load": f"{r['load_before']:.1f}",
        }
        for r in data["rows"]
    ]
    parts = [
        f"{_params(meta['params'])} parameters, P = {meta['num_fragments']}, H = "
        f"{meta['sync_every']}, {meta['shards']} shards, {meta['learners']} learners offering "
        f"{meta['wire']} (differences down: {meta['publish_delta']}), a {meta['step_s']:g} s "
        "step; each shard alone in a process pinned to one core; new pages cost "
        f"{meta['fresh_pages_sys_s_per_gb']:.2f} s of system CPU a GB on this machine:",
        markdown_table(rows, list(rows[0])),
    ]
    r = meta.get("restore")
    if r:
        parts.append(
            f"Restore of shard 0, from its death to its first merged round: "
            f"**{r['total_s']:.1f} s** (Orbax restore and a fresh core "
            f"{r['orbax_restore_s']:.1f} s, "
            f"recovery of {r['fragments_recovered']} fragment from a learner's value and "
            f"{meta['learners']} "
            f"registrations {r['recovery_and_registration_s']:.2f} s, the first round "
            f"{r['first_round_s']:.1f} s; the checkpoint's save took "
            f"{r['checkpoint_save_s']:.1f} s)."
        )
    return "\n\n".join(parts)


def mutation(data: dict[str, Any]) -> str:
    """Per file, then every survivor with its verdict."""
    m = data["meta"]
    rows = [
        {
            "file": f"`{r['file']}`",
            "mutants": str(r["mutants"]),
            "not checked yet": str(r["not_checked"]),
            "caught (failing test / timeout / mypy)": (
                f"{r['killed'] + r['timeout'] + r['type_check']} "
                f"({r['killed']} / {r['timeout']} / {r['type_check']})"
            ),
            "survived": str(r["survived"]),
            "no test reaches it": str(r["no_tests"]),
            "score (of those checked)": "-" if r["score"] is None else f"{r['score']:.1%}",
        }
        for r in data["rows"]
    ]
    rows.append(
        {
            "file": "**all**",
            "mutants": str(m["mutants"]),
            "not checked yet": str(m["mutants"] - m["checked"]),
            "caught (failing test / timeout / mypy)": str(m["caught"]),
            "survived": str(sum(r["survived"] for r in data["rows"])),
            "no test reaches it": str(sum(r["no_tests"] for r in data["rows"])),
            "score (of those checked)": f"**{m['score']:.1%}** "
            f"({m['score_without_equivalent']:.1%} without the {m['equivalent']} equivalent)",
        }
    )
    # a pipe inside a cell would end it
    survivors = [
        {
            "mutant": f"`{s['mutant'].removeprefix('ray_diloco.algorithm.')}`",
            "change": "<br>".join(f"`{line.strip()}`" for line in s["change"]).replace("|", r"\|"),
            "verdict": s["verdict"].replace("|", r"\|"),
        }
        for s in m["survivors"]
    ]
    return "\n\n".join(
        [markdown_table(rows, list(rows[0])), markdown_table(survivors, list(survivors[0]))]
    )


# The plots each results page shows under its table (files in benchmarks/results/).
PLOTS: dict[str, list[str]] = {
    "quality": ["quality.png"],
    "quality_horizon": [
        "quality_horizon.png",
        "quality_horizon-batch.png",
        "quality_horizon-scaling.png",
    ],
    "heterogeneous": ["heterogeneous.png"],
    "goodput": ["goodput.png"],
    "goodput_sim": ["goodput_sim.png"],
    "goodput_sim_slow_repair": ["goodput_sim_slow_repair.png"],
    "bandwidth_sim": ["bandwidth_sim.png"],
    "scavenging": ["scavenging.png"],
    "synchronizer": ["synchronizer.png"],
    "sharded_learner": ["sharded_learner.png"],
}


TABLES: dict[str, Callable[[dict[str, Any]], str]] = {
    "quality": quality,
    "quality_horizon": quality_horizon,
    "heterogeneous": heterogeneous,
    "goodput": goodput,
    "bandwidth": bandwidth,
    "overhead": overhead,
    "recovery": recovery,
    "recovery_load": recovery,
    "spread": spread,
    "outage": outage,
    "goodput_sim": goodput_sim,
    "goodput_sim_slow_repair": goodput_sim,
    "bandwidth_sim": bandwidth_sim,
    "scavenging": scavenging,
    "synchronizer": synchronizer,
    "synchronizer_scale": synchronizer_scale,
    "sharded_learner": sharded_learner,
    "mutation": mutation,
}


def block(name: str, results: Path = RESULTS, plots: bool = False) -> str:
    """One generated block: where the figures come from, the table, and (on a results page)
    the plots."""
    if name == "headline":
        return headline(results, "" if plots else "docs/results/")
    data = _load(name, results)
    meta = data.get("meta") or {}
    where = (
        f"`{meta['command']}` on {meta['machine']}:"
        if meta
        else f"from `benchmarks/results/{name}.json`:"
    )
    parts = [where, TABLES[name](data)]
    if plots:
        parts += [f"![{png.removesuffix('.png')}]({png})" for png in PLOTS.get(name, [])]
    return "\n\n".join(parts)


BLOCK = re.compile(r"<!-- results:(\w+) -->.*?<!-- /results:\1 -->", flags=re.DOTALL)


def render(text: str, results: Path = RESULTS, plots: bool = False) -> str:
    """`text` with every results block rebuilt; a block names a table in TABLES (or the
    headline)."""

    def fill(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in TABLES and name != "headline":
            raise SystemExit(f"unknown results block {name!r}; known: {list(TABLES)}")
        return f"<!-- results:{name} -->\n{block(name, results, plots)}\n<!-- /results:{name} -->"

    return BLOCK.sub(fill, text)


def pages() -> list[Path]:
    """Every file that holds generated blocks: the README and the docs' pages."""
    return [README, *sorted(p for p in DOCS.rglob("*.md") if p != CONFIG_PAGE)]


def generated() -> dict[Path, str]:
    """What every generated file should hold now."""
    from config_reference import reference

    out = {p: render(p.read_text(), plots=p.parent == DOCS / "results") for p in pages()}
    out[CONFIG_PAGE] = reference()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="fail if any generated file is stale")
    args = p.parse_args()
    new = generated()
    stale = [path for path, text in new.items() if not path.exists() or path.read_text() != text]
    if args.check:
        if stale:
            names = ", ".join(str(path.relative_to(ROOT)) for path in stale)
            sys.exit(f"stale: {names}; run python benchmarks/readme_tables.py")
        print(f"{len(new)} generated files match benchmarks/results/*.json and the config schema")
        return
    for path in stale:
        path.write_text(new[path])
    print(f"rewrote {len(stale)} of {len(new)} generated files")


if __name__ == "__main__":
    main()
