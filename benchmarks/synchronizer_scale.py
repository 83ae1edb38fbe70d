"""A synchronizer shard at 1B parameters: resident memory, keeping up, and restore.

The model: N = 1B float32 parameters in P = 24 fragments (4 leaves each), split over S = 4
shards (`algorithm/shards.py`: 6 fragments, 250M parameters a shard), M = 4 learners offering
int4 deltas (blocks of 64) and receiving int4 differences (the config's defaults), a 1 s step
and sync_every H = 24: every fragment once per 24 steps, one round a step over the model.

Each shard runs in a fresh process pinned to one core, one shard after the other (the machine
has 2 cores shared with other work; a deployment gives each shard its own): a real
`SynchronizerCore` owning that shard's fragments, driven on the real clock by the load of the
4 learners, without Ray or learner processes (the shard's CPU and memory are what is
measured; the transport is `benchmarks/synchronizer.py`'s load runs). At each step the
shard's due fragment gets the 4 offers (the same encoded delta per learner for every
fragment: the work per byte does not depend on the values), its round closes, merges,
commits and encodes what goes down (`messages`). Per shard: the resident bytes per parameter
by piece (`SynchronizerCore.resident_bytes`) after the first cycle (version 0, the float32
initialisation, is still the learners' base) and at the end, the process's peak RSS,
round latency from the step the offers were due to the publication's messages (median, p99),
whether it kept up (every round done before its fragment is due again and p99 under the step),
offers refused.

Restore (shard 0): its state checkpointed with Orbax one round before the end, the process
"dies" (the core is dropped), and the time to its first merged round is measured: a fresh
core, the Orbax restore of its part, recovery of the round past the checkpoint from a
learner's newest value (handed over in process: the transfer between processes is not in the
figure), the 4 learners registering, and the first round merged.

    python benchmarks/synchronizer_scale.py                 # 1B parameters
    python benchmarks/synchronizer_scale.py --quick         # 24M parameters, 3 cycles
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from common import parser, write_results

P, H, LEARNERS, SHARDS, LEAVES = 24, 24, 4, 4, 4
STEP_S = 1.0
GB = 2**30


def _setting(params: int) -> tuple[Any, Any]:
    from ray_diloco.algorithm.fragments import FragmentPlan
    from ray_diloco.config import build_config

    leaf = params // (P * LEAVES)
    paths = tuple(tuple(f"f{p:02d}/w{i}" for i in range(LEAVES)) for p in range(P))
    plan = FragmentPlan(paths, (leaf * LEAVES,) * P, frozenset())
    cfg = build_config(
        {
            "learners": [{"name": f"l{i}"} for i in range(LEARNERS)],
            "diloco": {
                "num_fragments": P,
                "sync_every": H,
                "quorum_min": LEARNERS,  # every round merges every learner's offer
                "grace_max_s": 0.0,
                "wire_dtype": "int4",
                "publish_delta": "int4",
            },
            "synchronizer": {"num_shards": SHARDS},
        }
    )
    return cfg, plan


def _p99(ordered: list[float]) -> float:
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def _reset_peak_rss() -> None:
    # Linux: writing 5 to clear_refs resets the process's high-water mark (VmHWM).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_rss_gb() -> float:
    # VmHWM, not ru_maxrss: a process keeps the ru_maxrss of the one it was forked from.
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kib * 1024 / GB


def _offers(core: Any, plan: Any, deltas: list[dict[str, Any]], p: int, step: int) -> list[str]:
    from ray_diloco.algorithm.round_types import ContributionMeta

    base = core.book.fragments[p].version
    verdicts = []
    for i, d in enumerate(deltas):
        steps = min(step, H)  # inner steps since the learner adopted the fragment
        meta = ContributionMeta(f"l{i}", 0, p, base, step, steps, steps * 1024)
        enc = {k: d[k.split("/")[1]] for k in plan.fragments[p]}
        verdicts.append(core.offer(meta, enc, time.monotonic()).value)
    return verdicts


def _round(core: Any, names: list[str]) -> int:
    pubs = core.poll(time.monotonic())
    for pub in pubs:
        core.messages(pub, names)
    return len(pubs)


def run_shard(params: int, shard: int, cycles: int, restore: bool) -> dict[str, Any]:
    """One shard under its learners' load on the real clock (pin the process first)."""
    from ray_diloco.algorithm import wire
    from ray_diloco.algorithm.fragments import due_fragments
    from ray_diloco.algorithm.shards import assign_fragments
    from ray_diloco.algorithm.sync_core import SynchronizerCore

    cfg, plan = _setting(params)
    owned = assign_fragments(plan.sizes, SHARDS)[shard]
    n = sum(plan.sizes[p] for p in owned)
    init = {
        k: np.zeros(plan.sizes[p] // LEAVES, np.float32) for p in owned for k in plan.fragments[p]
    }
    core = SynchronizerCore(cfg, plan, init, owned, owns_data=shard == 0)
    del init
    names = [f"l{i}" for i in range(LEARNERS)]
    for name in names:
        core.register(name, 0, 0.0)
    rng = np.random.default_rng(shard)
    leaf = plan.sizes[0] // LEAVES
    deltas = [
        {
            f"w{j}": wire.encode(rng.normal(0, 1e-3, leaf).astype(np.float32), "int4")
            for j in range(LEAVES)
        }
        for _ in range(LEARNERS)
    ]
    latencies: list[tuple[int, float]] = []
    cpu: list[tuple[int, float, float]] = []  # (step, arrival CPU s, round CPU s)
    refused = 0
    behind = 0
    first: dict[str, int] = {}
    early_peak = 0.0  # the peak RSS until the second cycle ends
    t0 = time.monotonic() + 1.0
    steps = cycles * H
    for step in range(1, steps + 1):
        due = t0 + step * STEP_S
        now = time.monotonic()
        if now < due:
            time.sleep(due - now)
        else:
            behind += 1
        for p in due_fragments(step, H, P):
            if p not in owned:
                continue
            c0 = time.process_time()
            verdicts = _offers(core, plan, deltas, p, step)
            c1 = time.process_time()
            refused += sum(v != "accepted" for v in verdicts)
            _round(core, names)
            cpu.append((step, c1 - c0, time.process_time() - c1))
            latencies.append((step, time.monotonic() - due))
        if step == H:  # the first cycle: every fragment merged once, version 0 still a base
            first = core.resident_bytes()
        if step == 2 * H:  # version 0 dropped everywhere: the peak from here on is steady
            early_peak = _peak_rss_gb()
            _reset_peak_rss()
    measured = sorted(d for s, d in latencies if s > H)
    # Until the first round of the second cycle each round allocates its arrays anew: the state
    # grows from 8 to 14 B/param over the first cycle, and only then do rounds release buffers
    # for the next (`buffers.py`). New pages cost what the machine charges for them
    # (`fresh_pages_sys_s_per_gb`); past the second cycle every round reuses buffers.
    steady = sorted(d for s, d in latencies if s > 2 * H)
    arrival = statistics.median(a for s, a, _ in cpu if s > H)
    merge = statistics.median(m for s, _, m in cpu if s > H)
    interval = H * STEP_S / len(owned)  # between two of this shard's rounds
    gc.collect()
    resident = core.resident_bytes()  # steady: the bases are versions the shard published
    steady_peak = _peak_rss_gb()
    out: dict[str, Any] = {
        "shard": shard,
        "params": n,
        "fragments": len(owned),
        "resident_bytes": resident,
        "resident_bytes_per_param": {k: v / n for k, v in resident.items()},
        "resident_bytes_per_param_total": sum(resident.values()) / n,
        "first_cycle_bytes_per_param": {k: v / n for k, v in first.items()},
        "first_cycle_bytes_per_param_total": sum(first.values()) / n,
        # The round buffers kept unused for the next rounds (`algorithm/buffers.py`): working
        # memory, not state.
        "spare_bytes_per_param": core.spare_bytes() / n,
        "peak_rss_gb": max(early_peak, steady_peak),
        "peak_rss_bytes_per_param": max(early_peak, steady_peak) * GB / n,
        "peak_rss_past_second_cycle_gb": steady_peak,
        # Everything in the process beyond the state, past the second cycle (the first holds
        # version 0 too, 2 B/param more state): the interpreter and its libraries, the spare
        # buffers, a round's arrays, the offers in flight.
        "working_memory_gb": steady_peak - sum(resident.values()) / GB,
        "rounds": len(measured),
        "latency_median_s": statistics.median(measured),
        "latency_p99_s": _p99(measured),
        "latency_p99_steady_s": _p99(steady),
        "latencies_s": [[s, d] for s, d in latencies],
        "steps_late": behind,
        "offers_refused": refused,
        # CPU seconds of one round (its 4 offers' arrival; the merge, outer step, commit and
        # the messages down), median: what a core of its own would take, whatever the load.
        "arrival_cpu_s": arrival,
        "round_cpu_s": merge,
        "round_interval_s": interval,
        "contributions_gb_per_cpu_s": LEARNERS * 4 * plan.sizes[0] / 1e9 / (arrival + merge),
    }
    out["kept_up"] = out["latency_p99_s"] < STEP_S and not refused
    out["kept_up_past_second_cycle"] = out["latency_p99_steady_s"] < STEP_S and not refused
    # On a core of its own: the round's CPU done within the step, the offers' before the next.
    out["keeps_up_on_own_core"] = merge < STEP_S and arrival + merge < interval
    if restore:
        directory = tempfile.mkdtemp(prefix="sync-scale-")
        try:
            saved = _checkpoint(core, directory)
            # One more round past the checkpoint: a learner holds it, the checkpoint does not.
            _offers(core, plan, deltas, owned[0], steps + 1)
            _round(core, names)
            newest = core.snapshot()
            del core  # the shard dies
            out["restore"] = _restore(newest, cfg, plan, owned, saved, deltas, names)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    return out


def _checkpoint(core: Any, directory: str) -> tuple[Any, Any]:
    from ray_diloco.algorithm import checkpoint

    t = time.monotonic()
    arrays, meta = checkpoint.sync_state_to_tree(core.state_dict())
    ckpt = checkpoint.Checkpointer(directory, 1)
    ckpt.save(1, arrays, meta)
    return ckpt, (time.monotonic() - t, dict(core.book.versions()))


def _restore(
    newest: Any,
    cfg: Any,
    plan: Any,
    owned: list[int],
    saved: tuple[Any, Any],
    deltas: Any,
    names: Any,
) -> dict[str, Any]:
    """From the shard's death to its first merged round."""
    from ray_diloco.algorithm import checkpoint
    from ray_diloco.algorithm.round_log import LoggedRound
    from ray_diloco.algorithm.sync_core import SynchronizerCore

    ckpt, (save_s, versions) = saved
    # What the learners hold: the newest publication of every fragment; the rounds past the
    # checkpoint, as the round log has them.
    delivered = {p: v for p, (v, _) in newest.items()}
    held = {
        p: (v, {k: np.asarray(a, np.float32) for k, a in q.items()})
        for p, (v, q) in newest.items()
        if v > versions[p]
    }
    logged = [LoggedRound(p, v, (), {}) for p, (v, _) in held.items()]
    del newest
    gc.collect()
    t0 = time.monotonic()
    init = {
        k: np.zeros(plan.sizes[p] // LEAVES, np.float32) for p in owned for k in plan.fragments[p]
    }
    fresh = SynchronizerCore(cfg, plan, init, owned, owns_data=owned[0] == 0)
    del init
    arrays, meta = ckpt.restore()
    fresh.load_state_dict(checkpoint.sync_state_from_tree(arrays, meta, fresh.outer_states), 0.0)
    del arrays
    t_orbax = time.monotonic()
    fresh.start_recovery(logged, delivered)
    for p, want in fresh.wanted().items():
        v, values = held[p]
        if v > want:
            fresh.provide(p, v, values)
    for p in list(fresh.recovering):
        fresh.finish_recovery(p)
    for name in names:
        fresh.register(name, 0, time.monotonic())
    t_recovered = time.monotonic()
    p = owned[0]
    _offers(fresh, plan, deltas, p, 10**6)
    merged = _round(fresh, names)
    t_merged = time.monotonic()
    return {
        "checkpoint_save_s": save_s,
        "fragments_recovered": len(logged),
        "orbax_restore_s": t_orbax - t0,
        "recovery_and_registration_s": t_recovered - t_orbax,
        "first_round_s": t_merged - t_recovered,
        "total_s": t_merged - t0,
        "merged": merged,
    }


def _fresh_pages_sys_s_per_gb() -> float:
    before = os.times().system
    np.empty(GB // 4, np.float32).fill(1.0)
    return os.times().system - before


def _pinned(args: tuple[int, int, int, bool]) -> dict[str, Any]:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    return run_shard(*args)


def main() -> None:
    import psutil

    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=None, help="model parameters (default 1e9)")
    args = p.parse_args()
    params = int(args.params or (24 * 10**6 if args.quick else 10**9))
    cycles = 3 if args.quick else 4
    rows = []
    fresh = _fresh_pages_sys_s_per_gb()
    ctx = multiprocessing.get_context("spawn")
    for shard in range(SHARDS):
        free = psutil.virtual_memory().available / GB
        load = os.getloadavg()[0]
        with ctx.Pool(1) as pool:  # a fresh process per shard: no memory carried over
            row = pool.apply(_pinned, ((params, shard, cycles, shard == 0),))
        row.update(load_before=load, load_after=os.getloadavg()[0], available_gb_before=free)
        print(
            f"shard {shard}: {row['resident_bytes_per_param_total']:.2f} B/param resident, "
            f"peak RSS {row['peak_rss_gb']:.2f} GB, p99 {row['latency_p99_s']:.2f} s, "
            f"kept up {row['kept_up']}, load {load:.1f}",
            flush=True,
        )
        rows.append(row)
    meta = {
        "params": params,
        "num_fragments": P,
        "sync_every": H,
        "learners": LEARNERS,
        "shards": SHARDS,
        "step_s": STEP_S,
        "wire": "int4",
        "publish_delta": "int4",
        "cycles": cycles,
        "restore": rows[0].get("restore"),
        # System CPU seconds to fault in a GB of new pages, before the shards ran: a few
        # hundredths on memory the machine has used before, seconds on a virtual machine's
        # memory that no process has touched since it booted (the host backs it on first touch).
        "fresh_pages_sys_s_per_gb": fresh,
    }
    columns = [
        "shard",
        "params",
        "resident_bytes_per_param_total",
        "peak_rss_gb",
        "peak_rss_past_second_cycle_gb",
        "working_memory_gb",
        "latency_median_s",
        "latency_p99_s",
        "latency_p99_steady_s",
        "kept_up",
        "kept_up_past_second_cycle",
        "offers_refused",
        "load_before",
    ]
    name = "synchronizer_scale-quick" if args.quick else "synchronizer_scale"
    write_results(args.out, name, rows, columns, meta)


if __name__ == "__main__":
    main()
