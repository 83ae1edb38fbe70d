"""Shared plumbing for the benchmark scripts: where results go and how they are written.

Each benchmark prints a table, writes `<name>.json` and a dated `<name>-YYYY-MM-DD.md` under
`benchmarks/results/` (or `--out`), with the command line and the machine it ran on.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing
import os
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any, TypeVar

from ray_diloco.config import RunConfig, build_config, load_config
from ray_diloco.report import machine, markdown_table

RESULTS = Path(__file__).resolve().parent / "results"
JAX_CACHE = Path("/tmp/ray_diloco-bench-jax-cache")
REFERENCE = Path(__file__).resolve().parent.parent / "jobs" / "reference.yaml"
# --quick: a tiny model (P = H = 8 fits its 20 leaves) so a smoke run takes seconds.
QUICK_MODEL = [
    "task_args.model.d_model=32",
    "task_args.model.num_layers=2",
    "task_args.model.d_ff=64",
    "diloco.sync_every=8",
    "diloco.num_fragments=8",
    "task_args.data.eval_batches=2",
]


# The quality setting: jobs/reference.yaml (P = H = 24, tau = 2, half the learners 18% slower,
# 10% step jitter) with a model and batch small enough for over 100 outer steps per fragment on
# this machine: 3 layers 64 wide (170k parameters), 16-byte sequences, a global batch of 32
# sequences split over the M learners (8 each for M = 4), 1.28M tokens: 2,500 inner steps.
HORIZON = [
    "task_args.model.d_model=64",
    "task_args.model.num_layers=3",
    "task_args.model.d_ff=256",
    "task_args.model.seq_len=16",
    "token_budget=1280000",
]
GLOBAL_BATCH = 32
# The cluster config's sync period (jobs/cluster-v5p-v6e.yaml): H = 100, P = 25, tau = 5.
H100 = ["diloco.sync_every=100", "diloco.num_fragments=25", "diloco.overlap_steps=5"]


def learners(num: int) -> list[dict[str, Any]]:
    """M learners sharing the global batch; every other one 18% slower, all with jitter."""
    return [
        {
            "name": f"learner-{i}",
            "batch_size": GLOBAL_BATCH // num,
            "jitter": 0.1,
            **({"speed": 0.82} if i % 2 else {}),
        }
        for i in range(num)
    ]


def horizon_config(
    overrides: Sequence[str], num_learners: int = 4, seed: int = 0, quick: bool = False
) -> RunConfig:
    """The quality setting (the tiny --quick model instead with `quick`) with `num_learners`
    learners, the seed and `overrides` applied."""
    base = [*QUICK_MODEL, "token_budget=60000"] if quick else HORIZON
    cfg = load_config(REFERENCE, [*base, *overrides, f"seed={seed}"])
    tree = cfg.model_dump(mode="json")
    tree["learners"] = learners(num_learners)
    return build_config(tree, f"{REFERENCE.name} with {num_learners} learners")


def lower_priority(niceness: int = 10) -> None:
    """Run this process at `niceness` (a shared machine), however many jobs it runs: nice
    only adds, so calling `os.nice(10)` per job pinned a pool worker at 19 from its second."""
    current = os.nice(0)
    if current < niceness:
        os.nice(niceness - current)


J = TypeVar("J")
R = TypeVar("R")


def run_parallel(
    fn: Callable[[J], R],
    jobs: Sequence[J],
    workers: int,
    done: Callable[[list[R]], None] | None = None,
) -> list[R]:
    """`fn` over `jobs`, `workers` at a time, each in its own process (spawned: JAX does not
    survive a fork) with single-threaded XLA and BLAS: two processes on two cores run faster
    than two multi-threaded ones fighting for them. The processes share a persistent JAX
    compilation cache (runs of one setting compile the same programs). In order. `done` gets
    the results finished so far (in job order) after each one, so a benchmark can write what
    it has: on a shared machine a long benchmark may not get to its end."""
    results: dict[int, R] = {}

    def finished(i: int, r: R) -> None:
        results[i] = r
        if done is not None:
            done([results[k] for k in sorted(results)])

    if workers <= 1:
        for i, job in enumerate(jobs):
            finished(i, fn(job))
        return [results[i] for i in range(len(jobs))]
    os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(JAX_CACHE))
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        futures = {pool.submit(fn, job): i for i, job in enumerate(jobs)}
        for future in as_completed(futures):
            finished(futures[future], future.result())
    return [results[i] for i in range(len(jobs))]


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="smoke setting, under two minutes")
    p.add_argument("--out", type=Path, default=RESULTS, help="directory for JSON/markdown/PNG")
    return p


def write_results(
    out: Path, name: str, rows: list[dict[str, Any]], columns: list[str], meta: dict[str, Any]
) -> Path:
    """Print the table and write JSON + dated markdown; returns the markdown path."""
    out.mkdir(parents=True, exist_ok=True)
    command = "python " + " ".join([f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    meta = {"command": command, "machine": machine(), "date": dt.date.today().isoformat(), **meta}
    table = markdown_table(rows, columns)
    print(table)
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    md = out / f"{name}-{meta['date']}.md"
    md.write_text(
        f"# {name}\n\nCommand: `{command}`  \nMachine: {meta['machine']}  \n"
        f"Date: {meta['date']}\n\n{table}\n"
    )
    return md
