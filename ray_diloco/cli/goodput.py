"""Layer: cli. `ray-diloco simulate-goodput`, the goodput simulator at scale (docs/algorithm.md
section 10) from the command line.

  ray-diloco simulate-goodput --chips 1200000 --learners 8          one cluster, every system
  ray-diloco simulate-goodput --sweep --days 30 --out runs/goodput  150k..2.4M chips x M=2..16
  ray-diloco simulate-goodput --sweep --preset slow-repair          the harsher settings
  ray-diloco simulate-goodput --sweep --chips 1200000 9600000 --learners 8 32 --name beyond

Settings come from the `goodput_sim` section of the run config (`--config`, `--set`), on top
of a named preset (`--preset`, default `calibrated`: the config's defaults); the convenience
flags are shorthands for `--set goodput_sim.<field>=...`. `--chips` and `--learners` take
several values to sweep over them. A run config that sets `diloco.schedule` (the runtime's
`offer` or `pull`) simulates that schedule: `goodput_sim.sync_schedule` is the simulator's own
default for configs that do not (`pull`), and setting both to different values is an error.
Prints a markdown table; `--out DIR` writes
goodput_sim.{json,md,png} (goodput_sim_<preset>.* for another preset), with the wall and CPU
time of the simulation and where the CPU time went.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from ray_diloco.cli.help import parser
from ray_diloco.config import (
    ConfigError,
    RunConfig,
    add_config_args,
    check_output_dir,
    load_config,
    whole_number,
)
from ray_diloco.observe.report import machine
from ray_diloco.sim.goodput_sim import (
    PRESETS,
    PUBLISHED_METHOD,
    PUBLISHED_RULE,
    InfeasibleError,
    simulate,
)
from ray_diloco.sim.goodput_sweep import (
    CALIBRATION_COLUMN,
    CHIPS,
    LEARNERS,
    Row,
    calibrate,
    format_table,
    out_of_sample,
    plot,
    row_of,
    sweep,
)

logger = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    p = parser("simulate-goodput")
    add_config_args(
        p, "YAML run config; its goodput_sim section is used", "goodput_sim.recovery=pareto"
    )
    p.add_argument(
        "--preset",
        choices=list(PRESETS),
        default="calibrated",
        help="named settings under --config/--set (slow-repair: repairs and restarts ten "
        "times slower, learners that restart; slow-link: 0.5 Gbps learner links, a "
        "bandwidth-limited synchronizer)",
    )
    p.add_argument("--chips", type=whole_number, nargs="+", help="cluster size(s) in chips")
    p.add_argument("--learners", type=whole_number, nargs="+", help="decoupled learner count(s), M")
    p.add_argument("--days", type=float, help="simulated duration in days")
    p.add_argument(
        "--sweep",
        action="store_true",
        help=f"sweep chips {list(CHIPS)} x learners {list(LEARNERS)} "
        "(or the values given to --chips / --learners)",
    )
    p.add_argument("--out", type=Path, help="directory for goodput_sim.json, .md and .png")
    p.add_argument(
        "--name",
        help="file stem under --out (default goodput_sim, goodput_sim_<preset> for a preset)",
    )
    return p


def _is_sweep(args: argparse.Namespace) -> bool:
    return bool(args.sweep or len(args.chips or ()) > 1 or len(args.learners or ()) > 1)


def _load(args: argparse.Namespace) -> RunConfig:
    preset = [f"goodput_sim.{k}={v}" for k, v in PRESETS[args.preset].items()]
    # Without a run config: the published method's rounds, which the published figure measured
    published = [f"diloco.{k}={v}" for k, v in PUBLISHED_RULE.items()] if not args.config else []
    overrides = [*published, *preset, *args.overrides]
    # A single run's flags go through the config so they are validated like any other setting;
    # a sweep sets chips and learners per cell itself.
    if not _is_sweep(args):
        if args.chips:
            overrides.append(f"goodput_sim.chips={args.chips[0]}")
        if args.learners:
            overrides.append(f"goodput_sim.num_learners={args.learners[0]}")
    if args.days is not None:
        overrides.append(f"goodput_sim.duration_days={args.days}")
    return with_run_schedule(load_config(args.config, overrides))


def with_run_schedule(cfg: RunConfig) -> RunConfig:
    """The config with the simulated schedule taken from `diloco.schedule` when the config
    sets it: a run config says how its own rounds are timed."""
    gs, schedule = cfg.goodput_sim, cfg.diloco.schedule
    if "schedule" not in cfg.diloco.model_fields_set or gs.sync_schedule == schedule:
        return cfg
    if "sync_schedule" in gs.model_fields_set:
        raise ConfigError(
            f"goodput_sim.sync_schedule={gs.sync_schedule} and diloco.schedule={schedule} "
            "disagree: the simulator takes the run config's schedule; drop one of the two"
        )
    return cfg.model_copy(update={"goodput_sim": gs.model_copy(update={"sync_schedule": schedule})})


def run(args: argparse.Namespace) -> tuple[RunConfig, list[Row], dict[str, Any]]:
    """The rows, and timing: wall and CPU seconds, and CPU seconds per part of the work."""
    cfg = _load(args)
    gs = cfg.goodput_sim
    t0, c0 = time.perf_counter(), time.process_time()
    if _is_sweep(args):
        chips = tuple(args.chips) if args.chips else CHIPS
        learners = tuple(args.learners) if args.learners else LEARNERS
        too_small = [n for n in chips if n < max(learners) * gs.chips_per_slice]
        if too_small:
            raise ConfigError(
                f"--chips {too_small}: fewer than one slice ({gs.chips_per_slice} chips) per "
                f"learner for M={max(learners)}; raise --chips or lower goodput_sim.chips_per_slice"
            )
        rows, profile = sweep(gs, chips, learners, cfg.diloco, cfg.synchronizer)
    else:
        try:
            results = simulate(gs, cfg.diloco, cfg.synchronizer)
        except InfeasibleError as err:
            raise ConfigError(str(err)) from None
        rows = [row_of(r) for r in results]
        profile = {}
    timing: dict[str, Any] = {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}
    return cfg, rows, {**timing, "cpu_s_by_part": profile}


def calibration(cfg: RunConfig) -> dict[str, Any]:
    """The calibrated term: what the configuration uses, and what the calibration gives on
    this configuration's own trace at 1.2M chips."""
    gs = cfg.goodput_sim
    system, learners = CALIBRATION_COLUMN
    return {
        "column": f"{system} (M={learners})",
        "field": "restart_cost_s",
        "used_s": gs.restart_cost_s,
        "calibrated_s": calibrate(gs),
    }


def _stem(args: argparse.Namespace) -> str:
    if args.name:
        return str(args.name)
    preset = args.preset
    return "goodput_sim" if preset == "calibrated" else f"goodput_sim_{preset.replace('-', '_')}"


def _write(
    out: Path,
    args: argparse.Namespace,
    argv: list[str],
    cfg: RunConfig,
    rows: list[Row],
    table: str,
    timing: dict[str, Any],
) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["ray-diloco", "simulate-goodput", *argv])
    stem = _stem(args)
    meta = {
        "command": command,
        "calibration": calibration(cfg),
        "machine": machine(),
        "date": dt.date.today().isoformat(),
        "preset": args.preset,
        # The machine is shared: CPU seconds are the figure to compare, the load says how busy.
        "load_avg_1min": os.getloadavg()[0],
        **timing,
    }
    paths = [out / f"{stem}.json", out / f"{stem}.md", out / f"{stem}.png"]
    paths[0].write_text(
        json.dumps(
            {
                "meta": meta,
                "goodput_sim": cfg.goodput_sim.model_dump(mode="json"),
                "diloco": cfg.diloco.model_dump(mode="json"),
                "published_vs_simulated": out_of_sample(rows),
                "rows": rows,
            },
            indent=2,
        )
    )
    paths[1].write_text(
        f"{table}\n{cfg.goodput_sim.duration_days:g} simulated days, preset {args.preset}: "
        f"{timing['cpu_s']:.1f} s CPU, {timing['wall_s']:.1f} s wall.\n\n```\n{command}\n```\n"
    )
    gs = cfg.goodput_sim
    # what the rounds simulated differ in from the published method's
    default = PUBLISHED_METHOD.model_dump()
    changed = [f"diloco.{k}={v}" for k, v in cfg.diloco.model_dump().items() if default[k] != v]
    title = (
        f"Goodput under one failure trace ({args.preset} settings: {gs.learner_mode} learners, "
        f"K = {gs.quorum_min}, {gs.sync_schedule} schedule)\n{gs.duration_days:g} simulated "
        f"day(s), MTBI {gs.mtbi_chip_days:g} chip-days, learner links {gs.link_gbps:g} Gbps"
        + "".join(f", {c}" for c in changed)
    )
    plot(rows, paths[2], title)
    return paths


def simulate_goodput_main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    try:
        if args.name is not None and (not args.name or Path(args.name).name != args.name):
            raise ConfigError(f"--name {args.name!r}: a file stem, without a folder; pick another")
        if args.out is not None:
            check_output_dir(args.out, "--out")
        cfg, rows, timing = run(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    table = format_table(rows)
    gs = cfg.goodput_sim
    print(table)
    for r in rows:
        if r.get("infeasible"):
            print(
                f"warning: {r['chips']:,} chips, M={r['learners']}: {r['infeasible']}",
                file=sys.stderr,
            )
    print(
        f"{gs.duration_days:g} simulated days, mtbi {gs.mtbi_chip_days:g} chip-days, "
        f"{gs.recovery} recovery (median {gs.recovery_median_s:g} s), {gs.learner_mode} "
        f"learners, seed {gs.seed}: {timing['cpu_s']:.1f} s CPU, {timing['wall_s']:.1f} s wall"
    )
    if timing["cpu_s_by_part"]:
        parts = sorted(timing["cpu_s_by_part"].items(), key=lambda kv: -kv[1])
        print("CPU by part: " + ", ".join(f"{k} {v:.2f} s" for k, v in parts))
    if args.out is not None:
        paths = _write(args.out, args, argv, cfg, rows, table, timing)
        print("wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(simulate_goodput_main())
