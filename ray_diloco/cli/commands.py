"""Layer: cli. The `ray-diloco` command: its subcommands parse, validate and hand over to the
runtime, the simulators or the plan. What each says in --help is in cli/help.py. Printing to the
terminal happens here (and in the progress display) only."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from ray_diloco.cli.help import COMMANDS, add_command, version
from ray_diloco.config import ConfigError, add_config_args, check_output_dir, load_config
from ray_diloco.observe.log import setup_logging
from ray_diloco.observe.report import summary_table


def _add_config_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p, "YAML run config (default: built-in defaults)", "diloco.quorum_min=2")
    p.add_argument("--log-level", default="WARNING")


def _add_overwrite_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run run_dir holds, finished or of another config (its checkpoints "
        "and records are deleted); without it such a run_dir is an error",
    )


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
    result = Trainer(config=cfg).simulate(progress=True, overwrite=args.overwrite)
    print(summary_table(result.metrics))
    print(f"wrote {result.path / 'summary.json'}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from ray_diloco.observe.display import progress_display, run_title
    from ray_diloco.runtime.driver import run_training

    cfg = load_config(args.config, args.overrides)
    with progress_display(run_title(cfg), args.print_every) as show:
        summary = run_training(
            cfg,
            address=args.address,
            stop_synchronizer=not args.keep_synchronizer,
            progress=show,
            dashboard=args.dashboard,
            resume=args.resume,
            overwrite=args.overwrite,
        )
    print(summary_table(summary))
    run_dir = Path(cfg.run_dir).resolve()
    print(f"wrote {run_dir / 'summary.json'} and the run report {run_dir / 'report.html'}")
    return 0 if summary.get("tokens", 0) >= cfg.token_budget else 1


def cmd_plan(args: argparse.Namespace) -> int:
    from ray_diloco.cluster import files, plan

    cfg = load_config(args.config, args.overrides)  # nothing is written: a dry run
    paths = args.cluster or list(cfg.cluster.files)
    if not paths:
        raise ConfigError("no cluster file: pass --cluster FILE or set cluster.files in the job")
    cluster = files.read_cluster_files(paths)
    # The fragment plan and the learners' memory evaluate shapes only; never let JAX open an
    # accelerator.
    os.environ["JAX_PLATFORMS"] = "cpu"
    from ray_diloco.algorithm.memory import learner_memory
    from ray_diloco.algorithm.setup import fitted_config, fragment_plan, task_of

    task = task_of(cfg)
    cfg = fitted_config(cfg, task)
    result = plan.make_plan(cfg, cluster, fragment_plan(cfg, task).sizes, learner_memory(cfg, task))
    print(plan.render(result))
    return 1 if result.problems else 0


def cmd_config(args: argparse.Namespace) -> int:
    from ray_diloco.config.describe import describe_config

    sys.stdout.write(describe_config(load_config(args.config, args.overrides)))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from ray_diloco.observe.record import ReportError
    from ray_diloco.observe.run_report import write_report

    try:
        path = write_report(args.run_dir)
    except ReportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path.resolve()}")
    return 0


# Subcommands with arguments of their own, each a `main(argv) -> exit code` that raises
# ValueError (ConfigError included) for bad input.
OWN_PARSERS = {
    "simulate-goodput": "ray_diloco.cli.goodput:simulate_goodput_main",
    "simulate-bandwidth": "ray_diloco.cli.bandwidth:simulate_bandwidth_main",
    "prepare-data": "ray_diloco.cli.prepare_data:prepare_data_main",
    "scale": "ray_diloco.cli.scale:scale_main",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in OWN_PARSERS:
        module, _, function = OWN_PARSERS[argv[0]].partition(":")
        try:
            return int(getattr(importlib.import_module(module), function)(argv[1:]))
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    parser = argparse.ArgumentParser(
        prog="ray-diloco",
        description="Decoupled DiLoCo on Ray: elastic, low-communication training of JAX\n"
        "models over learners that fail, lag, join and leave.",
        epilog="examples:\n"
        + "\n".join(f"  {c.examples[0]}" for c in COMMANDS.values())
        + "\n\n`ray-diloco COMMAND --help` describes each command.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = add_command(sub, "train")
    _add_config_args(train)
    train.add_argument(
        "--address",
        default=None,
        help="Ray address (default: RAY_ADDRESS or an embedded local Ray)",
    )
    train.add_argument(
        "--resume",
        action="store_true",
        help="resume the unfinished run of this config in run_dir (an error if there is none); "
        "without it such a run resumes too, and a new run_dir starts a run",
    )
    _add_overwrite_arg(train)
    train.add_argument(
        "--keep-synchronizer",
        action="store_true",
        help="leave the detached synchronizer running after the run",
    )
    train.add_argument(
        "--dashboard",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start the Ray dashboard with the embedded local Ray (default: on)",
    )
    train.add_argument(
        "--print-every",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="when stdout is not a terminal: one progress line every SECONDS (default 10)",
    )
    report = add_command(sub, "report")
    report.add_argument("run_dir", metavar="RUN_DIR", help="the run_dir of a train run")
    report.add_argument("--log-level", default="WARNING")
    simulate = add_command(sub, "simulate")
    _add_config_args(simulate)
    _add_overwrite_arg(simulate)
    config = add_command(sub, "config")
    _add_config_args(config)
    for name in OWN_PARSERS:  # listed here; they parse their own arguments
        add_command(sub, name)
    plan = add_command(sub, "plan")
    _add_config_args(plan)
    plan.add_argument(
        "--cluster",
        action="append",
        default=[],
        metavar="FILE",
        help="cluster file (`ray up` YAML or KubeRay manifest), repeatable; "
        "default: the job's cluster.files",
    )
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    commands = {
        "train": cmd_train,
        "simulate": cmd_simulate,
        "plan": cmd_plan,
        "report": cmd_report,
        "config": cmd_config,
    }
    try:
        return commands[args.command](args)
    except ConfigError as err:
        message = str(err)
        if args.command == "plan":  # one line, whatever the validation found
            message = "; ".join(line.strip() for line in message.splitlines())
        print(f"error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
