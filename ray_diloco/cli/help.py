"""What `ray-diloco --help` and each `ray-diloco COMMAND --help` say: a one-line summary (the
command list), a description and examples, kept together so every parser reads alike."""

from __future__ import annotations

import argparse
import textwrap
from dataclasses import dataclass
from importlib import metadata


@dataclass(frozen=True)
class Command:
    summary: str
    description: str
    examples: tuple[str, ...]


SPEC_FORMAT = (
    "SPEC is one learner as comma-separated key=value pairs, the fields of a `learners:` entry "
    "of the run config (values read as YAML); name= is required, e.g. "
    "'name=eu-2,region=eu-west,batch_size=32,speed=0.8' (`ray-diloco config` lists the fields)"
)

COMMANDS = {
    "train": Command(
        "train on Ray: an embedded local Ray, or the cluster at --address / RAY_ADDRESS",
        "Run a training job: the synchronizer, the supervisor and one actor group per learner on "
        "Ray. The run dir (run_dir) gets config.json, summary.json, metrics.jsonl, checkpoints "
        "and report.html.",
        (
            "ray-diloco train --config jobs/local.yaml",
            "ray-diloco train --config jobs/local.yaml --set token_budget=1000000 "
            "--set diloco.quorum_min=2",
            "ray-diloco train --config jobs/local.yaml --set chaos.enabled=true "
            "--set chaos.mtbf_s=30",
            "ray-diloco train --config jobs/local.yaml --address auto   # a Ray already running",
        ),
    ),
    "simulate": Command(
        "in-process reference run of the same algorithm on a virtual clock",
        "Run the job's learners and synchronizer in this process, one after the other, on a "
        "virtual clock (step_time_s per inner step): no Ray, the same rounds as `train`, and "
        "the same summary.json in the run dir.",
        (
            "ray-diloco simulate --config jobs/reference.yaml",
            "ray-diloco simulate --config jobs/reference.yaml --set diloco.mode=data_parallel",
        ),
    ),
    "plan": Command(
        "dry run on a real cluster: placement, link loads, memory per chip; starts nothing",
        "Read a job and the cluster files it names (`ray up` YAMLs, KubeRay manifests) and "
        "print where each learner and the synchronizer would run, the load on each link, each "
        "learner's bytes per chip against its HBM, and every problem found. Exit 1 when there "
        "is a problem.",
        (
            "ray-diloco plan --config jobs/cluster-gke.yaml",
            "ray-diloco plan --config jobs/cluster-v5p-v6e.yaml",
        ),
    ),
    "report": Command(
        "write report.html and the pictures of a run dir, finished or not",
        "Write RUN_DIR/report.html and its pictures from the run's metrics and event tape; "
        "works on a running run too.",
        ("ray-diloco report runs/local",),
    ),
    "config": Command(
        "print the run config's fields, types, bounds and defaults as YAML",
        "Print every field of the run config, generated from its schema: the value (the "
        "defaults, or those of --config and --set), then its type, bounds and meaning. The "
        "output is itself a valid config file.",
        (
            "ray-diloco config",
            "ray-diloco config --config jobs/local.yaml --set diloco.quorum_min=2",
            "ray-diloco config > my.yaml   # then edit it and run: ray-diloco train "
            "--config my.yaml",
        ),
    ),
    "scale": Command(
        "add or remove learners of a running job",
        "Ask a running job's supervisor to add or remove learners. The run dir's config.json "
        "names the supervisor; the command connects to the cluster (--address, else "
        "RAY_ADDRESS, else the newest Ray on this machine, where an embedded local run lives). "
        "A new learner starts from the newest global fragments and reads data from the pool; "
        "a leaving one offers its unsent work first and gives its unread data back. "
        + SPEC_FORMAT
        + ".",
        (
            "ray-diloco scale runs/local --add 'name=eu-2,region=eu-west,batch_size=32'",
            "ray-diloco scale runs/local --remove eu-2",
            "ray-diloco scale runs/local --list",
        ),
    ),
    "prepare-data": Command(
        "tokenize text files into token files for the token_lm task",
        "Tokenize text files (local paths or globs, or fsspec URLs: gs://, s3://, file://) into "
        "train.bin, val.bin, meta.json and tokenizer.json for ray_diloco.tasks.token_lm, with a "
        "byte-level BPE trained on the files (or a tokenizer.json you give). Files are split "
        "into train and held-out by a stable hash of their path.",
        (
            "ray-diloco prepare-data --input 'texts/**/*.txt' --out data/texts",
            "ray-diloco prepare-data --input 'gs://my-bucket/corpus/*.txt' --out data/corpus "
            "--vocab-size 16384",
        ),
    ),
    "simulate-goodput": Command(
        "goodput and uptime at scale, simulated on one failure trace",
        "Goodput and uptime of data-parallel, elastic data-parallel and Decoupled DiLoCo on "
        "one simulated failure trace (the goodput_sim section of the config).",
        (
            "ray-diloco simulate-goodput",
            "ray-diloco simulate-goodput --sweep --out benchmarks/results",
            "ray-diloco simulate-goodput --sweep --preset slow-repair --out benchmarks/results",
        ),
    ),
    "simulate-bandwidth": Command(
        "WAN bandwidth data-parallel and Decoupled DiLoCo need across datacenters",
        "WAN bandwidth data-parallel and Decoupled DiLoCo need across datacenters, and the "
        "goodput each gets on given links (the bandwidth_sim section of the config).",
        (
            "ray-diloco simulate-bandwidth",
            "ray-diloco simulate-bandwidth --datacenters 8 4 --links 1 2 5 --out "
            "benchmarks/results",
        ),
    ),
}


WIDTH = 88


def _epilog(command: Command) -> str:
    return "examples:\n" + "\n".join(f"  {line}" for line in command.examples)


def parser(name: str) -> argparse.ArgumentParser:
    """The parser of `ray-diloco NAME`, with its description and examples."""
    command = COMMANDS[name]
    return argparse.ArgumentParser(
        prog=f"ray-diloco {name}",
        description=textwrap.fill(command.description, WIDTH, break_on_hyphens=False),
        epilog=_epilog(command),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_command(sub: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    """`name` as a subcommand of `ray-diloco`, read alike."""
    command = COMMANDS[name]
    p: argparse.ArgumentParser = sub.add_parser(
        name,
        help=command.summary,
        description=textwrap.fill(command.description, WIDTH, break_on_hyphens=False),
        epilog=_epilog(command),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return p


def version() -> str:
    """`ray-diloco --version`: this package's and the versions a bug report needs."""
    names = ("ray_diloco", "ray", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint")
    found = []
    for name in names:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} (not installed)")
    return f"ray-diloco {found[0].split(' ', 1)[1]} ({', '.join(found[1:])})"
