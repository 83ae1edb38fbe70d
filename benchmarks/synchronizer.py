"""Synchronizer throughput: the merge per core, and shards under load on Ray.

1. merge: one `SynchronizerCore` in a fresh process pinned to one core runs whole rounds of
   one fragment of 1 MB to 1 GB of float32: M learners' deltas as they come off the wire
   (bfloat16, and int4 at 64 MB), each decoded onto its base and measured by the norm guard,
   then the round: token weights, RDA, the outer Nesterov step, the publication's encoding and
   its decoded copy for later bases. Throughput is MB of float32 contributions per CPU second
   of that process (`time.process_time`: on a shared machine the wall clock mostly measures
   the neighbours; both are in the JSON), next to a memcpy bound measured in the same process
   (np.copyto of the same bytes between two arrays in memory). Warm-up rounds fill the published
   history first. Target: >= 1000 MB/s for 64 MB+ fragments.
2. load: S = 1, 2, 4 shards (the real Synchronizer actors, on local Ray) driven by M fake
   learners (Ray actors on the real learner channel: registration, reports, bounded offers;
   no training) that step every `--step` seconds on a shared clock and offer each fragment
   every H steps as random bfloat16 deltas, for models of N parameters
   (benchmarks/load_task.py). Per cell: rounds/s against the offered rate, MB/s merged,
   offer-to-publication latency (from a learner's send to its receipt of the version that
   merged it: median, p99), the largest RSS of a shard, offers that had to wait, and whether
   the shards kept up.
3. scale: from the per-core merge throughput, the CPU cores and memory the synchronizer needs
   for the published 12B model across 4 regions (the arithmetic: the JSON and
   docs/results/synchronizer.md).

    python benchmarks/synchronizer.py            # merge 1 MB..1 GB; load 10M/30M/100M x 1/2/4
    python benchmarks/synchronizer.py --quick    # merge 1..64 MB; load 10M x 1/2
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from ray_diloco.config import RunConfig, build_config

from common import parser, write_results

ROOT = Path(__file__).resolve().parent.parent
TARGET_MB_S = 1000.0
MERGE_LEARNERS = 4
H, P = 8, 4  # the load runs' sync_every and fragments: one fragment due every 2 steps
LEARNERS = 4
WARMUP_S, MEASURE_S = 8.0, 20.0
GB = 2**30


# -- 1. the merge, per core --------------------------------------------------------------------


def _merge_config(learners: int, wire_dtype: str) -> RunConfig:
    return build_config(
        {
            "learners": [{"name": f"l{i}"} for i in range(learners)],
            "diloco": {
                "num_fragments": 1,
                "quorum_min": learners,
                "wire_dtype": wire_dtype,
                "max_staleness_versions": 1,  # memory: the history is not what is timed
            },
        }
    )


def merge_rounds(fragment_mb: int, learners: int, wire_dtype: str, rounds: int) -> dict[str, Any]:
    """Whole rounds of one fragment in this process (pin it to one core first)."""
    from ray_diloco.algorithm import wire
    from ray_diloco.algorithm.fragments import FragmentPlan
    from ray_diloco.algorithm.round_types import ContributionMeta
    from ray_diloco.algorithm.sync_core import SynchronizerCore

    n = fragment_mb * 2**20 // 4
    leaves = {f"layer_{i}": n // 4 for i in range(4)}  # a fragment holds several leaves
    plan = FragmentPlan((tuple(leaves),), (sum(leaves.values()),), frozenset())
    cfg = _merge_config(learners, wire_dtype)
    rng = np.random.default_rng(0)
    init = {k: rng.normal(0, 0.02, s).astype(np.float32) for k, s in leaves.items()}
    core = SynchronizerCore(cfg, plan, init)
    del init  # the core holds its own copy
    names = [lg.name for lg in cfg.learners]
    for name in names:
        core.register(name, 0, 0.0)
    # One delta, sent by every learner: the work per byte does not depend on the values.
    delta = wire.encode_tree(
        {k: rng.normal(0, 1e-3, s).astype(np.float32) for k, s in leaves.items()}, wire_dtype
    )
    warmup = cfg.diloco.max_staleness_versions + 2
    cpu, wall, now = [], [], 0.0
    for r in range(warmup + rounds):
        c0, w0 = time.process_time(), time.perf_counter()
        base = core.book.fragments[0].version
        for name in names:
            meta = ContributionMeta(name, 0, 0, base, 4 * (base + 1), 4, 1024)
            assert core.offer(meta, delta, now).value == "accepted"
        now += 1e6  # past every grace window
        (close,) = core.close_due(now)
        core.commit(core.merge(close), now)
        if r >= warmup:
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - w0)
    contributed = learners * 4 * n
    src, dst = np.full(n, 1.0, np.float32), np.zeros(n, np.float32)  # both paged in
    c0 = time.process_time()
    for _ in range(learners * rounds):
        np.copyto(dst, src)
    copy_cpu = (time.process_time() - c0) / rounds
    return {
        "fragment_mb": fragment_mb,
        "learners": learners,
        "wire": wire_dtype,
        "rounds": rounds,
        "cpu_s_per_round": statistics.median(cpu),
        "wall_s_per_round": statistics.median(wall),
        "mb_per_s": contributed / 1e6 / statistics.median(cpu),
        "memcpy_mb_per_s": contributed / 1e6 / copy_cpu,
        "vs_memcpy": copy_cpu / statistics.median(cpu),
    }


def _pinned(args: tuple[int, int, str, int]) -> dict[str, Any]:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    return merge_rounds(*args)


def merge_table(quick: bool) -> list[dict[str, Any]]:
    import psutil

    cells = [(mb, MERGE_LEARNERS, "bfloat16") for mb in (1, 4, 16, 64)]
    if not quick:
        cells += [(64, MERGE_LEARNERS, "int4"), (256, MERGE_LEARNERS, "bfloat16")]
        # A 1 GB fragment with 4 learners needs ~12 GB at once; 2 learners ~9.5 GB.
        if psutil.virtual_memory().available > 14 * GB:
            cells.append((1024, 2, "bfloat16"))
    rows = []
    ctx = multiprocessing.get_context("spawn")
    for mb, learners, dtype in cells:
        rounds = max(3, min(20, 2048 // (mb * learners)))
        with ctx.Pool(1) as pool:  # a fresh process per cell: no memory carried over
            row = pool.apply(_pinned, ((mb, learners, dtype, rounds),))
        row["load"] = os.getloadavg()[0]
        print(
            f"merge {mb} MB x {learners} ({dtype}): {row['mb_per_s']:.0f} MB/s per core, "
            f"memcpy {row['memcpy_mb_per_s']:.0f} MB/s, load {row['load']:.1f}",
            flush=True,
        )
        rows.append(row)
    return rows


# -- 2. shards under load ----------------------------------------------------------------------


def load_config_for(num_params: int, shards: int, run_dir: Path) -> RunConfig:
    return build_config(
        {
            "name": "synchronizer-load",
            "token_budget": 10**15,
            "run_dir": str(run_dir),
            "task": "benchmarks.load_task:make_task",
            "task_args": {"num_params": num_params, "num_leaves": 4 * P},
            "diloco": {
                "mode": "decoupled",
                "sync_every": H,
                "num_fragments": P,
                "overlap_steps": 1,
                "quorum_min": LEARNERS,  # every round merges every learner's offer
                "grace_max_s": 0.0,
                "max_staleness_versions": 1,
                "wire_dtype": "bfloat16",
            },
            "learners": [{"name": f"fake-{i}", "batch_size": 1} for i in range(LEARNERS)],
            "synchronizer": {
                "name": f"load-{num_params}-{shards}",
                "num_shards": shards,
                "heartbeat_timeout_s": 60.0,
            },
            "checkpoint": {"enabled": False},
            "metrics": {"eval_every_s": 1e9, "export_ray_metrics": False},
        }
    )


class _Progress:
    """What the learner channel reads from a learner core in a report."""

    step = 0
    cursor = 0


def _fake_learner_class() -> Any:
    import ray

    @ray.remote(num_cpus=0, max_concurrency=4)
    class FakeLearner:
        """Steps on a shared clock, reports, offers random deltas; times the publications."""

        def __init__(self, cfg: RunConfig, index: int) -> None:
            self.cfg, self.lg = cfg, cfg.learners[index]
            self.lock = threading.Lock()
            self.base: dict[int, int] = {}
            self.adopted_at: dict[int, int] = {}
            self.sent: dict[tuple[int, int], float] = {}
            self.latencies: list[tuple[float, float]] = []  # (sent at, seconds to publication)
            self.progress = _Progress()

        def receive(self, fragment: int, version: int, encoded: Any) -> None:
            now = time.monotonic()
            with self.lock:
                sent = self.sent.pop((fragment, version - 1), None)
                if sent is not None:
                    self.latencies.append((sent, now - sent))
                if version > self.base.get(fragment, 0):
                    self.base[fragment] = version
                    self.adopted_at[fragment] = self.progress.step

        def run(self, t0: float, until: float, step_s: float, seed: int) -> dict[str, Any]:
            from ray_diloco.algorithm import wire
            from ray_diloco.algorithm.fragments import due_fragments
            from ray_diloco.algorithm.round_types import ContributionMeta
            from ray_diloco.runtime.learner.channel import SyncChannel

            counts: Counter[str] = Counter()
            channel = SyncChannel(self.cfg, self.lg, 0, counts, lambda core: {})
            reply = channel.register(lambda why: None)
            plan = reply["plan"]
            rng = np.random.default_rng(seed)
            deltas = {
                p: wire.encode_tree(
                    {k: rng.normal(0, 1e-3, plan.sizes[p] // len(paths)) for k in paths},
                    "bfloat16",
                )
                for p, paths in enumerate(plan.fragments)
            }
            with self.lock:
                for p, (version, _) in reply["snapshot"].items():
                    self.base[p], self.adopted_at[p] = version, 0
            step = 0
            while (now := time.monotonic()) < until:
                time.sleep(max(0.0, t0 + step * step_s - now))
                step += 1
                self.progress.step, self.progress.cursor = step, step
                channel.report(self.progress, step_s, None, lambda why: None)
                offers = []
                with self.lock:
                    for p in due_fragments(step, H, P):
                        steps = step - self.adopted_at[p]
                        meta = ContributionMeta(
                            self.lg.name, 0, p, self.base[p], step, steps, steps
                        )
                        offers.append((meta, deltas[p]))
                        self.sent.setdefault((p, self.base[p]), time.monotonic())
                channel.offer(offers)
            channel.close()
            with self.lock:
                return {"latencies": list(self.latencies), "counts": dict(counts), "steps": step}

    return FakeLearner


def load_cell(num_params: int, shards: int, step_s: float, tmp: Path) -> dict[str, Any]:
    import ray

    from ray_diloco.runtime.synchronizer.launch import create_synchronizer
    from ray_diloco.runtime.synchronizer.shards import ShardSet

    cfg = load_config_for(num_params, shards, tmp / f"{num_params}-{shards}")
    sync = ShardSet(cfg, create_synchronizer(cfg))
    sync.status(2**62, 600)  # every shard built its fragments
    fake = _fake_learner_class()
    learners = [fake.remote(cfg, i) for i in range(LEARNERS)]
    t0 = time.monotonic() + 2.0
    until = t0 + WARMUP_S + MEASURE_S
    runs = [a.run.remote(t0, until, step_s, i) for i, a in enumerate(learners)]
    time.sleep(max(0.0, t0 + WARMUP_S - time.monotonic()))
    start = sync.status(2**62, 120)
    t_start, rss = time.monotonic(), [0.0] * shards
    while time.monotonic() < until:
        st = sync.status(2**62, 120)
        rss = [max(r, s["rss_mb"]) for r, s in zip(rss, st["shards"], strict=True)]
        time.sleep(1.0)
    end = sync.status(2**62, 120)
    seconds = time.monotonic() - t_start
    results = ray.get(runs, timeout=600)
    sync.shutdown(120)
    sync.kill()
    for a in learners:
        ray.kill(a)
    window = (t0 + WARMUP_S, until)
    lat = sorted(d for r in results for sent, d in r["latencies"] if window[0] <= sent < window[1])
    counts: Counter[str] = Counter()
    for r in results:
        counts.update(r["counts"])
    rounds = end["rounds"] - start["rounds"]
    expected = P / (H * step_s)  # every fragment once per H steps
    fragment_bytes = 4 * num_params / P
    return {
        "params": num_params,
        "shards": shards,
        "step_s": step_s,
        "rounds_per_s": rounds / seconds,
        "offered_rounds_per_s": expected,
        "mb_per_s": rounds / seconds * LEARNERS * fragment_bytes / 1e6,
        "latency_median_s": statistics.median(lat) if lat else None,
        "latency_p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None,
        "max_shard_rss_mb": max(rss),
        "offers_waited": counts["offers_waited"] + counts["offers_coalesced"],
        "offers_dropped": counts["offers_dropped"],
        "kept_up": rounds / seconds >= 0.9 * expected and not counts["offers_dropped"],
        "load": os.getloadavg()[0],
    }


def load_table(sizes: list[int], shard_counts: list[int], step_s: float) -> list[dict[str, Any]]:
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # The shards import the load task by name (benchmarks.load_task): from the repository root.
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(":"))]
    os.environ["PYTHONPATH"] = ":".join(paths)
    ray.init(
        address="local",
        num_cpus=2,
        object_store_memory=3 * GB,
        include_dashboard=False,
        namespace="synchronizer-load",
    )
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="sync-load-") as tmp:
            for n in sizes:
                for s in shard_counts:
                    row = load_cell(n, s, step_s, Path(tmp))
                    print(
                        f"load {n / 1e6:.0f}M x {s} shards: {row['rounds_per_s']:.2f} of "
                        f"{row['offered_rounds_per_s']:.2f} rounds/s, "
                        f"{row['mb_per_s']:.0f} MB/s, p99 {row['latency_p99_s']}",
                        flush=True,
                    )
                    rows.append(row)
    finally:
        ray.shutdown()
    return rows


# -- 3. the published setting ------------------------------------------------------------------


def published_scale(per_core_mb_s: float) -> dict[str, Any]:
    """Cores and memory for the published 12B model across 4 regions, by arithmetic."""
    from ray_diloco.config import BandwidthSimConfig, DilocoConfig

    b, d = BandwidthSimConfig(), DilocoConfig()
    params, step_s, h, p, learners = b.model_params, b.step_time_s, b.sync_every, b.num_fragments, 4
    contributed = learners * 4 * params / (h * step_s)  # float32 bytes/s to merge
    cores = contributed / (per_core_mb_s * 1e6)
    fragment = 4 * params / p
    # values + momentum + the newest published copy + older ones a contribution may be
    # based on (max_staleness_versions), + a round's contributions and the merge's scratch.
    resident = 4 * params * (3 + d.max_staleness_versions)
    working = (learners + 3) * fragment
    return {
        "params": params,
        "learners": learners,
        "sync_every": h,
        "num_fragments": p,
        "step_time_s": step_s,
        "contributions_gb_per_s": contributed / 1e9,
        "per_core_mb_per_s": per_core_mb_s,
        "cores": cores,
        "fragment_gb": fragment / 1e9,
        "resident_gb": resident / 1e9,
        "working_gb": working / 1e9,
        "max_staleness_versions": d.max_staleness_versions,
    }


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    fig = Figure(figsize=(8.0, 4.0))
    ax = fig.add_subplot()
    for n in sorted({r["params"] for r in rows}):
        cells = sorted((r for r in rows if r["params"] == n), key=lambda r: r["shards"])
        ax.plot(
            [r["shards"] for r in cells],
            [r["mb_per_s"] for r in cells],
            marker="o",
            label=f"{n / 1e6:.0f}M parameters",
        )
        ax.plot(
            [r["shards"] for r in cells],
            [r["offered_rounds_per_s"] * LEARNERS * 4 * n / P / 1e6 for r in cells],
            linestyle=":",
            color=ax.lines[-1].get_color(),
        )
    ax.set_xlabel("synchronizer shards")
    ax.set_ylabel("float32 contributions merged (MB/s)")
    ax.set_yscale("log")
    ax.set_xticks(sorted({r["shards"] for r in rows}))
    ax.set_title("Merged (solid) vs offered (dotted), 4 fake learners, 2 cores")
    # Beside the axes: inside, it hid the points of whichever model size ran highest.
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--step", type=float, default=0.5, help="fake learners' step time (s)")
    p.add_argument("--sizes", default=None, help="model sizes, comma-separated (default below)")
    p.add_argument("--skip-merge", action="store_true", help="only the load runs")
    args = p.parse_args()
    merge = [] if args.skip_merge else merge_table(args.quick)
    if args.sizes:
        sizes = [int(float(x)) for x in args.sizes.split(",")]
    else:
        sizes = [10**7] if args.quick else [10**7, 3 * 10**7, 10**8]
    shard_counts = [1, 2] if args.quick else [1, 2, 4]
    load = load_table(sizes, shard_counts, args.step)
    big = [r["mb_per_s"] for r in merge if r["fragment_mb"] >= 64 and r["wire"] == "bfloat16"]
    per_core = min(big) if big else None
    meta = {
        "target_mb_per_s": TARGET_MB_S,
        "merge": merge,
        "merge_target_met": per_core is not None and per_core >= TARGET_MB_S,
        "published_scale": published_scale(per_core) if per_core else None,
        "load_setting": {
            "learners": LEARNERS,
            "sync_every": H,
            "num_fragments": P,
            "step_s": args.step,
            "warmup_s": WARMUP_S,
            "measure_s": MEASURE_S,
        },
    }
    name = "synchronizer-quick" if args.quick else "synchronizer"
    columns = [
        "params",
        "shards",
        "rounds_per_s",
        "offered_rounds_per_s",
        "mb_per_s",
        "latency_median_s",
        "latency_p99_s",
        "max_shard_rss_mb",
        "offers_waited",
        "offers_dropped",
        "kept_up",
        "load",
    ]
    write_results(args.out, name, load, columns, meta)
    plot(load, args.out / f"{name}.png")


if __name__ == "__main__":
    main()
