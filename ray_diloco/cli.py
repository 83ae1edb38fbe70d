"""Top level: the `ray-diloco` command.

  ray-diloco train --config jobs/local.yaml [--set a.b=c ...]       run on Ray (embedded or
                                                                       RAY_ADDRESS)
  ray-diloco simulate --config jobs/local.yaml [--set ...]          in-process reference run
  ray-diloco simulate-goodput [--chips N --learners M --sweep ...]  goodput at scale
  ray-diloco prepare-data --input 'texts/**/*.txt' --out DIR        token files for token_lm
  ray-diloco scale RUN_DIR --add 'name=x,...' | --remove NAME       learners join/leave a run
  ray-diloco simulate-bandwidth [--datacenters D --links G ...]     WAN bandwidth needed

Printing to the terminal happens here (and in the progress display) only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ray_diloco.config import ConfigError, check_output_dir, load_config
from ray_diloco.log import setup_logging
from ray_diloco.report import summary_table


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML run config (default: built-in defaults)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="dotted override, repeatable, e.g. --set diloco.quorum_min=2",
    )
    p.add_argument("--log-level", default="WARNING")


def cmd_simulate(args: argparse.Namespace) -> int:
    from ray_diloco.api import Trainer

    cfg = load_config(args.config, args.overrides)
    check_output_dir(cfg.run_dir, "run_dir")  # before the header: a bad run_dir is one line
    print(
        f"simulate: task={cfg.task} mode={cfg.diloco.mode} learners={cfg.num_learners} "
        f"P={cfg.diloco.num_fragments} H={cfg.diloco.sync_every} K={cfg.diloco.quorum_min} "
        f"wire={cfg.diloco.wire_dtype} budget={cfg.token_budget} tokens",
        flush=True,
    )
    result = Trainer(config=cfg).simulate(progress=True)
    print(summary_table(result.metrics))
    print(f"wrote {result.path / 'summary.json'}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from ray_diloco.driver import run_training

    cfg = load_config(args.config, args.overrides)
    summary = run_training(cfg, address=args.address, stop_synchronizer=not args.keep_synchronizer)
    print(summary_table(summary))
    print(f"wrote {Path(cfg.run_dir).resolve() / 'summary.json'}")
    return 0 if summary.get("tokens", 0) >= cfg.token_budget else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "simulate-goodput":
        from ray_diloco.sim.goodput_cli import simulate_goodput_main

        return simulate_goodput_main(argv[1:])
    if argv and argv[0] == "scale":
        from ray_diloco.scale import main as scale_main

        try:
            return scale_main(argv[1:])
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    if argv and argv[0] == "prepare-data":
        from ray_diloco.tasks.prepare import main as prepare_main

        try:
            return prepare_main(argv[1:])
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    if argv and argv[0] == "simulate-bandwidth":
        from ray_diloco.sim.bandwidth_cli import simulate_bandwidth_main

        return simulate_bandwidth_main(argv[1:])
    parser = argparse.ArgumentParser(prog="ray-diloco", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train on Ray (embedded local Ray or RAY_ADDRESS)")
    _add_config_args(train)
    train.add_argument(
        "--address",
        default=None,
        help="Ray address (default: RAY_ADDRESS or an embedded local Ray)",
    )
    train.add_argument(
        "--keep-synchronizer",
        action="store_true",
        help="leave the detached synchronizer running after the run",
    )
    simulate = sub.add_parser("simulate", help="in-process reference run on a virtual clock")
    _add_config_args(simulate)
    sub.add_parser("simulate-goodput", help="goodput simulation at scale (see --help)")
    sub.add_parser("prepare-data", help="tokenize text files for the token_lm task (see --help)")
    sub.add_parser("scale", help="add or remove learners of a running job (see --help)")
    sub.add_parser("simulate-bandwidth", help="WAN bandwidth across datacenters (see --help)")
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    try:
        return {"train": cmd_train, "simulate": cmd_simulate}[args.command](args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
