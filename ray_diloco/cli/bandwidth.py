"""Layer: cli. `ray-diloco simulate-bandwidth`, the cross-datacenter bandwidth each system needs
to keep its goodput and the goodput it gets on given links (docs/algorithm.md section 9).

  ray-diloco simulate-bandwidth                                    both presets, 8 and 4 sites
  ray-diloco simulate-bandwidth --preset ray-diloco --datacenters 4 --links 2 5
  ray-diloco simulate-bandwidth --set bandwidth_sim.model_params=7e10 --out runs/bw

Settings come from the `bandwidth_sim` section of the run config (`--config`, `--set`), under
each named preset. Prints a markdown table; `--out DIR` writes bandwidth_sim.{json,md,png}.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
from pathlib import Path

from ray_diloco.cli.help import parser
from ray_diloco.config import (
    ConfigError,
    add_config_args,
    check_output_dir,
    load_config,
    whole_number,
)
from ray_diloco.observe.report import machine
from ray_diloco.sim.bandwidth_sim import PRESETS, format_table, plot, rows


def _parser() -> argparse.ArgumentParser:
    p = parser("simulate-bandwidth")
    add_config_args(
        p, "YAML run config; its bandwidth_sim section is used", "bandwidth_sim.step_time_s=3"
    )
    p.add_argument(
        "--preset",
        nargs="+",
        choices=list(PRESETS),
        default=list(PRESETS),
        help="settings under --config/--set (published-pair: the assumptions that reproduce "
        "the published 198 vs 0.84 Gbps)",
    )
    p.add_argument(
        "--datacenters", type=whole_number, nargs="+", default=[8, 4], help="sites (>= 2)"
    )
    p.add_argument(
        "--links", type=float, nargs="+", default=[2.0, 5.0], help="link bandwidths (Gbps)"
    )
    p.add_argument("--out", type=Path, help="directory for bandwidth_sim.json, .md and .png")
    return p


def simulate_bandwidth_main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    try:
        if min(args.datacenters) < 2:
            raise ConfigError(f"--datacenters {args.datacenters}: a WAN needs at least 2 sites")
        if min(args.links) <= 0:
            raise ConfigError(f"--links {args.links}: bandwidths must be > 0 Gbps")
        if args.out is not None:
            check_output_dir(args.out, "--out")
        cfg = load_config(args.config, args.overrides).bandwidth_sim
        table_rows = rows(cfg, args.preset, args.datacenters, args.links)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    table = format_table(table_rows)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        command = shlex.join(["ray-diloco", "simulate-bandwidth", *argv])
        meta = {"command": command, "machine": machine(), "date": dt.date.today().isoformat()}
        data = {"meta": meta, "bandwidth_sim": cfg.model_dump(mode="json"), "rows": table_rows}
        (args.out / "bandwidth_sim.json").write_text(json.dumps(data, indent=2))
        (args.out / "bandwidth_sim.md").write_text(f"{table}\n```\n{command}\n```\n")
        plot(cfg, args.out / "bandwidth_sim.png", args.links)
        print(f"wrote {args.out}/bandwidth_sim.json, bandwidth_sim.md, bandwidth_sim.png")
    return 0


if __name__ == "__main__":
    sys.exit(simulate_bandwidth_main())
