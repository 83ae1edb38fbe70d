"""Ray overhead: tokens/s of one learner inside Ray against the bare in-process loop.

Same config both ways (jobs/local.yaml's model and method, one learner, no emulated link or
slowdown), measured side by side in one run, alternating so background load hits both alike:

- bare: `LearnerCore` and `SynchronizerCore` driven directly in this process (train step,
  report, offers, merges, apply), the loop of the reference run without its virtual clock;
- learner only: `LearnerCore` alone (train step and encoded offers, no merges): the upper
  bound of one learner's throughput, the strict baseline for what Ray costs the learner;
- ray: `ray_diloco.runtime.driver.run_training` on a local Ray (learner and synchronizer actors; the
  synchronizer merges in its own process, on the other core of a 2-core box).

Steady state only: from the end of the first (compiling) step to the learner's last step.
Target: ray / bare >= 0.95. (The synchronizer's merge throughput per core is measured by
`benchmarks/synchronizer.py`.)

    python benchmarks/overhead.py            # 3 x 150 steps each way
    python benchmarks/overhead.py --quick    # 1 x 60 steps
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from ray_diloco.config import RunConfig, build_config

from common import parser, write_results  # benchmarks/ is on sys.path when run as a script

LOCAL = Path(__file__).resolve().parent.parent / "jobs" / "local.yaml"
TARGET = 0.95


def one_learner(steps: int, run_dir: Path, name: str) -> RunConfig:
    tree = yaml.safe_load(LOCAL.read_text())
    tree["learners"] = [{"name": "solo", "batch_size": 32}]
    tree["diloco"]["quorum_min"] = 1
    tree.pop("links", None)
    seq_len = tree.get("model", {}).get("seq_len", 64)
    tree.update(token_budget=steps * 32 * seq_len, run_dir=str(run_dir))
    tree["synchronizer"] = {**tree.get("synchronizer", {}), "name": f"overhead-{name}"}
    # Training throughput only: no periodic held-out evaluation competing for the cores.
    tree["metrics"] = {"export_ray_metrics": False, "eval_every_s": 1e9, "log_every_s": 2.0}
    tree["checkpoint"] = {"enabled": False}
    return build_config(tree)


def bare(cfg: RunConfig, merge: bool = True) -> dict[str, float]:
    from ray_diloco.algorithm.learner_core import LearnerCore
    from ray_diloco.algorithm.setup import Setup
    from ray_diloco.algorithm.sync_core import SynchronizerCore

    setup = Setup.build(cfg)
    sync = SynchronizerCore(cfg, setup.plan, setup.init)
    lg = cfg.learners[0]
    sync.register(lg.name, 0, time.monotonic())
    core = LearnerCore(cfg, lg, setup.task, setup.layout, setup.plan, sync.snapshot())
    start, first = 0.0, 0
    while sync.ledger.tokens_trained < cfg.token_budget:
        t0 = time.perf_counter()
        core.train_step(*core.next_batch())
        now = time.monotonic()
        sync.report(lg.name, 0, now, time.perf_counter() - t0, core.cursor)
        offers = core.offers()
        if not merge:  # learner only: stop at the budget, nothing to merge or apply
            sync.ledger.record_progress(lg.name, core.cursor)
        for meta, delta in offers if merge else ():
            sync.offer(meta, delta, now)
        for pub in sync.poll(time.monotonic()) if merge else ():
            for _, msgs in sync.messages(pub, [lg.name]):
                for msg in msgs:
                    core.receive(msg)
        core.apply_received()
        if not start:  # the first step compiled: the steady state starts here
            start, first = time.perf_counter(), core.step
    seconds = time.perf_counter() - start
    steps = core.step - first
    return {
        "steps": steps,
        "seconds": seconds,
        "tokens_per_s": steps * core.tokens_per_step / seconds,
    }


def learner_only(cfg: RunConfig) -> dict[str, float]:
    return bare(cfg, merge=False)


def on_ray(cfg: RunConfig) -> dict[str, float]:
    from ray_diloco.runtime.driver import run_training

    summary = run_training(cfg, progress=lambda line: None)
    events = [
        json.loads(ln) for ln in (Path(cfg.run_dir) / "events.jsonl").read_text().split("\n") if ln
    ]
    changes = [e for e in events if e["kind"] == "learner_state_changed"]
    start = next(e["t"] for e in changes if e["state"] == "training")
    end = next(e["t"] for e in changes if e["state"] == "finished")
    solo = summary["learners"]["solo"]
    steps = solo["inner_steps"] - 1  # the first (compiling) step is not timed
    tokens = steps * solo["tokens"] / solo["inner_steps"]
    return {"steps": steps, "seconds": end - start, "tokens_per_s": tokens / (end - start)}


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=None, help="repetitions each way")
    args = p.parse_args()
    steps, reps = (60, 1) if args.quick else (150, 3)
    reps = args.reps or reps
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray  # Ray starts before JAX runs in this process (fork safety)

    ray.init(address="local", num_cpus=2, object_store_memory=300 * 10**6, include_dashboard=False)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="overhead-") as tmp:
        for rep in range(reps):
            for way, run in (("bare", bare), ("learner only", learner_only), ("ray", on_ray)):
                cfg = one_learner(steps, Path(tmp) / f"{way}-{rep}", f"{rep}")
                result = run(cfg)
                rows.append({"rep": rep, "way": way, **result})
                print(f"rep {rep} {way}: {result['tokens_per_s']:.0f} tokens/s", flush=True)
    ray.shutdown()
    ratios, strict = [], []
    for rep in range(reps):
        b, lo, r = (
            next(x for x in rows if x["rep"] == rep and x["way"] == w)
            for w in ("bare", "learner only", "ray")
        )
        r["ratio"] = r["tokens_per_s"] / b["tokens_per_s"]
        r["ratio_learner_only"] = r["tokens_per_s"] / lo["tokens_per_s"]
        ratios.append(r["ratio"])
        strict.append(r["ratio_learner_only"])
    median = statistics.median(ratios)
    rows.append(
        {
            "rep": "median",
            "way": "ray / baseline",
            "ratio": median,
            "ratio_learner_only": statistics.median(strict),
        }
    )
    md = write_results(
        args.out,
        "overhead",
        rows,
        ["rep", "way", "steps", "seconds", "tokens_per_s", "ratio", "ratio_learner_only"],
        {
            "steps": steps,
            "reps": reps,
            "target": TARGET,
            "median_ratio": median,
            "median_ratio_learner_only": statistics.median(strict),
        },
    )
    verdict = "meets" if median >= TARGET else "misses"
    print(
        f"ray / bare tokens/s: median {median:.3f} ({verdict} the {TARGET} target); "
        f"ray / learner only: {statistics.median(strict):.3f}; {md}"
    )


if __name__ == "__main__":
    main()
