"""Sharded learner: one learner trains over every device of its slice (algorithm/sharding.py).

A GPT-2-small-shaped model (12 layers, width 768, 12 heads, d_ff 3072, vocabulary 50257, tied
embeddings: 124M parameters) at sequence 128 and batch 8 (1,024 tokens a step, about 8 s on
2 CPU cores), on token files `ray-diloco prepare-data` makes from the Python standard
library's top-level *.py (a BPE of 8192; the model's vocabulary is GPT-2's). One learner on 4
emulated CPU devices (`--xla_force_host_platform_device_count=4`), mesh {fsdp: 4}, H = 16 and
P = 4 (a fragment falls due every 4th step), the config's int4 offers. Measured:

1. per-device bytes of parameters + optimizer state, sharded against the replicated layout of
   the same slice (mesh {data: 4, fsdp: 1}): from the live arrays (each leaf's first
   addressable shard) and from `partitioning.device_bytes` arithmetic. Goal: <= 0.30x;
2. tokens/s of ray-diloco's learner (`LearnerCore` in the Ray learner loop's order: dispatch
   the step, collect the previous step's offers, float(loss), begin this step's offers)
   against a bare jitted FSDP loop written here (its own jax.jit of value_and_grad + optax
   AdamW with NamedSharding in and out, the same FSDP rule, mesh, batch and data). Steady
   state: each run's first step (the compiling one in the first pair) is not timed; pairs run
   alternately in this one process, the order swapped every pair. Goal: median ratio >= 0.95;
3. ray-diloco's step time when the step hands a fragment off (begins its host copies, or
   collects them: delta and wire encoding) against its steps that do neither, from the same
   runs. Goal: <= 1.05x. Beside the wall time of 2 and 3, the process's CPU time (every
   thread) and the load average: other work on a shared machine stretches the wall time of
   whichever loop it lands on, and not its CPU time;
4. peak RSS of a learner process (ru_maxrss) in bytes per parameter, in a child process that
   holds only the learner and receives its parameters as host arrays, as a Ray learner does,
   with a breakdown: measured RSS before the model, the host base copies and the state on the
   devices from the arrays, the step's outputs and temporaries from XLA's compiled memory
   statistics. No goal: reported.

    python benchmarks/sharded_learner.py           # 5 pairs x 4 steps each way, ~10 min
    python benchmarks/sharded_learner.py --quick   # a tiny model, seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

DEVICES = 4


def emulate_devices(count: int = DEVICES) -> None:
    """The slice: `count` CPU devices. XLA reads the flag when JAX starts its CPU backend, so
    this runs before anything asks for a device; a count inherited from elsewhere (the test
    suite's 8) is replaced."""
    flags = [
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={count}"])


emulate_devices()

from common import parser, write_results  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

GPT2_SMALL = {
    "vocab_size": 50257,
    "d_model": 768,
    "num_layers": 12,
    "num_heads": 12,
    "d_ff": 3072,
    "seq_len": 128,
    "tie_embeddings": True,
}
TINY = {
    "vocab_size": 512,
    "d_model": 32,
    "num_layers": 2,
    "num_heads": 2,
    "d_ff": 64,
    "seq_len": 32,
    "tie_embeddings": True,
}
# setting -> model, batch, H, P, mesh.min_shard_elements, corpus glob (stdlib), BPE vocabulary,
# pairs, timed steps per run. Steps are a multiple of H / P, so every run times the same number
# of hand-offs. The tiny model's leaves are all below the default 2**14 elements: 256 shards
# its matrices as the default shards GPT-2's.
SETTINGS: dict[str, dict[str, Any]] = {
    "full": {
        "model": GPT2_SMALL,
        "batch_size": 8,
        "sync_every": 16,
        "num_fragments": 4,
        "min_shard_elements": 2**14,
        "corpus": "*.py",
        "bpe_vocab": 8192,
        "pairs": 5,
        "steps": 4,
    },
    "quick": {
        "model": TINY,
        "batch_size": 8,
        "sync_every": 8,
        "num_fragments": 2,
        "min_shard_elements": 256,
        "corpus": "email/*.py",
        "bpe_vocab": 300,
        "pairs": 3,
        "steps": 4,
    },
}
GOALS = {"bytes_ratio": 0.30, "tokens_ratio": 0.95, "handoff_ratio": 1.05}
SHARDED = {"fsdp": DEVICES}
REPLICATED = {"data": DEVICES, "fsdp": 1}


def config_tree(setting: dict[str, Any], data_dir: str, mesh: dict[str, int]) -> dict[str, Any]:
    return {
        "name": "sharded-learner",
        "task": "ray_diloco.tasks.token_lm:make_task",
        "task_args": {"data_dir": data_dir, "model": setting["model"], "eval_batches": 1},
        "diloco": {
            "sync_every": setting["sync_every"],
            "num_fragments": setting["num_fragments"],
            "quorum_min": 1,
            # fragments fall due on the learner's own count: the hand-off this measures
            "schedule": "offer",
        },
        "learners": [
            {
                "name": "solo",
                "batch_size": setting["batch_size"],
                "devices_per_host": DEVICES,
                "mesh": {**mesh, "min_shard_elements": setting["min_shard_elements"]},
            }
        ],
        "checkpoint": {"enabled": False},
    }


def prepare_data(setting: dict[str, Any], out: Path) -> dict[str, Any]:
    """Token files by the project's own command, from text every Python install has."""
    exe = Path(sys.executable).with_name("ray-diloco")
    prog = str(exe) if exe.exists() else shutil.which("ray-diloco")
    if prog is None:
        raise SystemExit("ray-diloco is not installed: pip install -e . first")
    pattern = str(Path(sysconfig.get_paths()["stdlib"]) / setting["corpus"])
    cmd = [prog, "prepare-data", "--input", pattern, "--out", str(out)]
    cmd += ["--vocab-size", str(setting["bpe_vocab"])]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    meta = json.loads((out / "meta.json").read_text())
    shown = ["ray-diloco", *cmd[1:]]
    return {"command": shlex.join(shown), "printed": done.stdout.strip(), "meta": meta}


# -- what a device holds ------------------------------------------------------------------------


def first_shard_bytes(tree: Any) -> int:
    """Bytes of each leaf's first addressable shard, summed: what device 0 holds."""
    import jax

    return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree))


def all_shard_bytes(tree: Any) -> int:
    """Bytes of every addressable shard of every leaf: what all the devices hold."""
    import jax

    return sum(s.data.nbytes for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards)


def layout_bytes(core: Any, tree: Any) -> dict[str, Any]:
    """Device 0's bytes of parameters and optimizer state, live and by arithmetic."""
    from ray_diloco.algorithm import partitioning

    sizes = dict(core.layout.mesh.shape)
    arithmetic = partitioning.device_bytes(core.tx, tree, core.layout.specs, sizes)
    params, opt = first_shard_bytes(core.params), first_shard_bytes(core.opt_state)
    return {
        "mesh": sizes,
        "measured": {"params": params, "opt_state": opt, "total": params + opt},
        "arithmetic": {
            "params": arithmetic["params"],
            "opt_state": arithmetic["opt_state"],
            "total": arithmetic["params"] + arithmetic["opt_state"],
            "grads": arithmetic["grads"],
        },
    }


def snapshot_of(plan: Any, values: dict[str, Any]) -> dict[int, tuple[int, dict[str, Any]]]:
    """Version 0 of every fragment, as the synchronizer hands a new learner its start."""
    return {p: (0, {k: values[k] for k in paths}) for p, paths in enumerate(plan.fragments)}


# -- the two loops -----------------------------------------------------------------------------


def fsdp_spec(shape: tuple[int, ...], fsdp: int, min_elements: int) -> Any:
    """FSDP, written out here: a leaf of at least `min_elements` is split over `fsdp` along its
    largest axis that `fsdp` divides (the first of equal ones); others are replicated."""
    from jax.sharding import PartitionSpec

    size = 1
    for n in shape:
        size *= n
    fits = [i for i, n in enumerate(shape) if n % fsdp == 0]
    if size < min_elements or not fits:
        return PartitionSpec()
    axis = max(fits, key=lambda i: (shape[i], -i))
    return PartitionSpec(*[("fsdp" if i == axis else None) for i in range(len(shape))])


class BareLoop:
    """A plain jitted FSDP training loop of the model: JAX and optax only, the same mesh over
    the same devices, the same FSDP rule, batch and data, and the same AdamW (clipping, decay
    mask and schedule as the config's inner optimizer) as the learner. No fragments, offers
    or host copies: what training costs without ray-diloco around it."""

    def __init__(self, cfg: Any, task: Any, init: dict[str, Any], devices: list[Any]) -> None:
        import jax
        import numpy as np
        import optax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        from ray_diloco.algorithm.setup import total_inner_steps

        lg, inner = cfg.learners[0], cfg.inner
        mesh = Mesh(np.array(devices).reshape(1, len(devices), 1), ("data", "fsdp", "tensor"))
        fsdp, least = len(devices), lg.mesh.min_shard_elements
        self.specs = {k: fsdp_spec(tuple(v.shape), fsdp, least) for k, v in init.items()}
        params_sh = {k: NamedSharding(mesh, s) for k, s in self.specs.items()}
        replicated = NamedSharding(mesh, PartitionSpec())
        self.batch_sh = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
        schedule = optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=inner.lr,
            warmup_steps=inner.warmup_steps,
            decay_steps=max(total_inner_steps(cfg, task), inner.warmup_steps + 1),
            end_value=inner.lr * inner.final_lr_fraction,
        )
        tx = optax.chain(
            optax.clip_by_global_norm(inner.grad_clip_norm),
            optax.adamw(
                schedule,
                b1=inner.b1,
                b2=inner.b2,
                weight_decay=inner.weight_decay,
                mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p),
            ),
        )
        params = {k: jax.device_put(v, params_sh[k]) for k, v in init.items()}
        # Adam's moments take their parameters' shardings, the step counts are replicated.
        state_sh = optax.tree_utils.tree_map_params(
            tx,
            lambda _, sh: sh,
            jax.eval_shape(tx.init, params),
            params_sh,
            transform_non_params=lambda _: replicated,
            is_leaf=lambda x: isinstance(x, NamedSharding),
        )
        self.opt_state = jax.jit(tx.init, out_shardings=state_sh)(params)
        self.params = params
        loss_fn = task.loss

        def step(params: Any, opt_state: Any, batch: Any) -> Any:
            (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self.step_fn = jax.jit(  # donating its state, as the learner's step does
            step,
            in_shardings=(params_sh, state_sh, self.batch_sh),
            out_shardings=(params_sh, state_sh, replicated),
            donate_argnums=(0, 1),
        )
        self.batches = task.data.batches(0, 1, 0, lg.batch_size)

    def step(self) -> float:
        import jax

        batch, _ = next(self.batches)
        batch = jax.device_put(batch, self.batch_sh)
        self.params, self.opt_state, loss = self.step_fn(self.params, self.opt_state, batch)
        return float(loss)


def learner_step(core: Any) -> str:
    """One iteration of the Ray learner's loop (runtime/learner/host.py `_train`); returns what it
    did with offers: "begin" (host copies of a due fragment started), "collect" (the previous
    step's copies turned into encoded deltas), both, or "none"."""
    loss = core.dispatch_step(*core.next_batch())
    offers = core.collect_offers()
    float(loss)
    core.begin_offers()
    began = bool(core.pending)
    return {(False, False): "none", (True, False): "begin", (False, True): "collect"}.get(
        (began, bool(offers)), "both"
    )


def timed_run(loop: str, step: Any, steps: int, tokens_per_step: int) -> dict[str, Any]:
    """`steps` timed steps after one untimed one (which compiles in the first pair). Wall time
    is the measure; the process's CPU time (every thread: XLA's pool too) and the load average
    are recorded beside it, since other work on the machine stretches wall time only."""
    step()
    times, cpu, kinds = [], [], []
    load = os.getloadavg()[0]
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        kind = step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        kinds.append(kind if isinstance(kind, str) else "none")
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return {
        "loop": loop,
        "steps": steps,
        "seconds": seconds,
        "tokens_per_s": steps * tokens_per_step / seconds,
        "cpu_seconds": cpu_seconds,
        "tokens_per_cpu_s": steps * tokens_per_step / cpu_seconds,
        "step_s": times,
        "step_cpu_s": cpu,
        "kinds": kinds,
        "load_avg_1min": [load, os.getloadavg()[0]],
    }


# -- the learner process's memory (a child process) -------------------------------------------


def rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def learner_memory(spec: dict[str, Any]) -> dict[str, Any]:
    """A learner process as on Ray: the task and layout from shapes alone, the parameters
    received as host float32 arrays (here from a file), then the learner's loop until the
    largest fragment has been handed off. It starts as a restarted learner does, its cursor
    two steps before that fragment falls due, so three steps (the first compiles) hold every
    kind of step: plain, beginning the copies, collecting the offer."""
    import jax
    import numpy as np

    from ray_diloco.algorithm import setup, wire
    from ray_diloco.algorithm.fragments import due_fragments
    from ray_diloco.algorithm.learner_core import LearnerCore
    from ray_diloco.config import build_config

    cfg = build_config(spec["config"])
    lg, d = cfg.learners[0], cfg.diloco
    task = setup.task_of(cfg)
    tree = setup.layout_of(cfg, task)
    plan = setup.fragment_plan(cfg, task)
    layout = setup.learner_layout(cfg, task, tree, lg)
    assert layout.num_devices == DEVICES, jax.devices()
    largest = max(range(plan.num_fragments), key=lambda p: plan.sizes[p])
    due = next(
        s
        for s in range(2, 2 + d.sync_every)
        if largest in due_fragments(s, d.sync_every, d.num_fragments)
    )
    rss_runtime = rss()
    with np.load(spec["init"]) as npz:
        init = {k: npz[k] for k in npz.files}
    rss_received = rss()
    cursor = (due - 2) * setup.tokens_per_step(task, lg)
    core = LearnerCore(
        cfg, lg, task, tree, plan, snapshot_of(plan, init), cursor=cursor, layout=layout
    )
    rss_placed = rss()
    steps, per_step, offered = 3, [], 0
    for _ in range(steps):
        batch = core.next_batch()
        loss = core.dispatch_step(*batch)
        offers = core.collect_offers()
        float(loss)
        core.begin_offers()
        offered = max([offered, *(wire.tree_bytes(enc) for _, enc in offers)])
        per_step.append({"step": core.step, "rss": rss(), "offers": len(offers)})
    peak = peak_rss()
    # The compiled step is in the cache: lowering again compiles nothing.
    stats = core.step_fn.lower(core.params, core.opt_state, core.layout.batch(batch[0]))
    stats = stats.compile().memory_analysis()
    base = sum(v.nbytes for values in core.base_values for v in values.values())
    aliased = all(
        np.shares_memory(core.base_values[p][k], init[k])
        for p, paths in enumerate(plan.fragments)
        for k in paths
    )
    n = tree.num_params()
    components = {
        "runtime": rss_runtime,
        "base_copies": base,
        "state_on_devices": all_shard_bytes(core.params) + all_shard_bytes(core.opt_state),
        # Outputs that alias a donated input (the new params and moments) take no new memory.
        "step_outputs": (stats.output_size_in_bytes - stats.alias_size_in_bytes) * DEVICES,
        "step_temporaries": stats.temp_size_in_bytes * DEVICES,
        "offer_in_flight": 8 * plan.sizes[largest] + offered,
    }
    return {
        "num_params": n,
        "peak_rss": peak,
        "peak_bytes_per_param": peak / n,
        "components": components,
        "unattributed": peak - sum(components.values()),
        "base_values_alias_received": aliased,
        "rss_runtime": rss_runtime,
        "rss_received": rss_received,
        "rss_placed": rss_placed,
        "per_step": per_step,
        "steps": steps,
        "started_at_step": due - 2,
        "largest_fragment": {"fragment": largest, "params": plan.sizes[largest], "due": due},
        "compiled_per_device": {
            "argument": stats.argument_size_in_bytes,
            "output": stats.output_size_in_bytes,
            "alias": stats.alias_size_in_bytes,
            "temp": stats.temp_size_in_bytes,
        },
    }


COMPONENT_NAMES = {
    "runtime": "RSS before the model (Python, JAX, devices, task)",
    "base_copies": "host base copies (core.base_values, float32)",
    "state_on_devices": "params + Adam moments, all 4 devices",
    "step_outputs": "the step's outputs beyond its donated inputs",
    "step_temporaries": "the step's XLA temporaries (gathered weights, grads, ...)",
    "offer_in_flight": "largest fragment's offer (host copy, delta, wire)",
}


def run_child(config: dict[str, Any], init: dict[str, Any], tmp: Path) -> dict[str, Any]:
    import numpy as np

    np.savez(tmp / "init.npz", **init)
    spec = {"config": config, "init": str(tmp / "init.npz")}
    (tmp / "child.json").write_text(json.dumps(spec))
    out = tmp / "child-result.json"
    cmd = [sys.executable, __file__, "--child", str(tmp / "child.json"), str(out)]
    subprocess.run(cmd, check=True)
    (tmp / "init.npz").unlink()
    return dict(json.loads(out.read_text()))


# -- results ------------------------------------------------------------------------------------


def _mb(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def verdict(value: float, goal: float, at_most: bool) -> str:
    return "met" if (value <= goal if at_most else value >= goal) else "missed"


def summarise(
    memory: dict[str, Any], runs: list[dict[str, Any]], child: dict[str, Any]
) -> dict[str, Any]:
    sharded, replicated = memory["sharded"], memory["replicated"]
    bytes_ratio = sharded["measured"]["total"] / replicated["measured"]["total"]
    arithmetic_ratio = sharded["arithmetic"]["total"] / replicated["arithmetic"]["total"]
    pairs = sorted({r["pair"] for r in runs})
    ratios = []
    for pair in pairs:
        by = {r["loop"]: r for r in runs if r["pair"] == pair}
        ratios.append(by["ray-diloco"]["tokens_per_s"] / by["bare"]["tokens_per_s"])
    learner = [r for r in runs if r["loop"] == "ray-diloco"]
    by_kind: dict[str, list[float]] = {}
    cpu_by_kind: dict[str, list[float]] = {}
    for r in learner:
        for kind, t, c in zip(r["kinds"], r["step_s"], r["step_cpu_s"], strict=True):
            by_kind.setdefault(kind, []).append(t)
            cpu_by_kind.setdefault(kind, []).append(c)
    handoff = [t for kind, ts in by_kind.items() if kind != "none" for t in ts]
    plain = by_kind.get("none", [])
    medians = {kind: statistics.median(ts) for kind, ts in by_kind.items()}
    handoff_ratio = statistics.median(handoff) / statistics.median(plain)
    cpu_medians = {kind: statistics.median(cs) for kind, cs in cpu_by_kind.items()}
    cpu_handoff = [c for kind, cs in cpu_by_kind.items() if kind != "none" for c in cs]
    tokens = {
        loop: statistics.median(r["tokens_per_s"] for r in runs if r["loop"] == loop)
        for loop in ("bare", "ray-diloco")
    }
    cpu_ratios = []
    for pair in pairs:
        by = {r["loop"]: r for r in runs if r["pair"] == pair}
        cpu_ratios.append(by["ray-diloco"]["tokens_per_cpu_s"] / by["bare"]["tokens_per_cpu_s"])
    loads = [x for r in runs for x in r["load_avg_1min"]]
    return {
        "bytes_ratio": bytes_ratio,
        "bytes_ratio_arithmetic": arithmetic_ratio,
        "tokens_ratio_per_pair": ratios,
        "tokens_ratio": statistics.median(ratios),
        "tokens_per_cpu_s_ratio_per_pair": cpu_ratios,
        "tokens_per_cpu_s_ratio": statistics.median(cpu_ratios),
        "load_avg_1min_range": [min(loads), max(loads)],
        "tokens_per_s_median": tokens,
        "step_s_median_by_kind": medians,
        "steps_by_kind": {kind: len(ts) for kind, ts in by_kind.items()},
        "handoff_ratio": handoff_ratio,
        "handoff_ratio_by_kind": {k: m / medians["none"] for k, m in medians.items()},
        "step_cpu_s_median_by_kind": cpu_medians,
        "handoff_cpu_ratio": statistics.median(cpu_handoff) / cpu_medians["none"],
        "handoff_cpu_ratio_by_kind": {k: m / cpu_medians["none"] for k, m in cpu_medians.items()},
        "peak_bytes_per_param": child["peak_bytes_per_param"],
    }


def table_rows(
    memory: dict[str, Any], summary: dict[str, Any], child: dict[str, Any]
) -> list[dict[str, Any]]:
    s, g = summary, GOALS
    sh, rep = memory["sharded"], memory["replicated"]
    rows = [
        {
            "measure": "per-device params + optimizer state, sharded (fsdp 4)",
            "value": f"{_mb(sh['measured']['total'])} "
            f"(arithmetic {_mb(sh['arithmetic']['total'])})",
        },
        {
            "measure": "per-device params + optimizer state, replicated (data 4)",
            "value": f"{_mb(rep['measured']['total'])} "
            f"(arithmetic {_mb(rep['arithmetic']['total'])})",
        },
        {
            "measure": "sharded / replicated, per device",
            "value": f"**{s['bytes_ratio']:.3f}x** (arithmetic {s['bytes_ratio_arithmetic']:.3f}x)",
            "goal": f"<= {g['bytes_ratio']}x",
            "met": verdict(s["bytes_ratio"], g["bytes_ratio"], at_most=True),
        },
        {
            "measure": "tokens/s, bare jitted FSDP loop (median)",
            "value": f"{s['tokens_per_s_median']['bare']:,.1f}",
        },
        {
            "measure": "tokens/s, ray-diloco learner (median)",
            "value": f"{s['tokens_per_s_median']['ray-diloco']:,.1f}",
        },
        {
            "measure": "ray-diloco / bare tokens/s (median of pairs)",
            "value": f"**{s['tokens_ratio']:.3f}** (pairs: "
            + ", ".join(f"{r:.3f}" for r in s["tokens_ratio_per_pair"])
            + ")",
            "goal": f">= {g['tokens_ratio']}",
            "met": verdict(s["tokens_ratio"], g["tokens_ratio"], at_most=False),
        },
        {
            "measure": "ray-diloco / bare tokens per CPU-second (median of pairs)",
            "value": f"{s['tokens_per_cpu_s_ratio']:.3f} (pairs: "
            + ", ".join(f"{r:.3f}" for r in s["tokens_per_cpu_s_ratio_per_pair"])
            + ")",
        },
        {
            "measure": "1-minute load average over the runs (2 cores, other work included)",
            "value": "{:.1f} .. {:.1f}".format(*s["load_avg_1min_range"]),
        },
    ]
    for kind in ("none", "begin", "collect", "both"):
        if kind in s["step_s_median_by_kind"]:
            what = {"none": "no hand-off", "begin": "begins a fragment's host copies"}.get(
                kind, "collects a fragment (delta, int4 encoding)" if kind == "collect" else kind
            )
            rows.append(
                {
                    "measure": f"step time, {what} (median of {s['steps_by_kind'][kind]})",
                    "value": f"{s['step_s_median_by_kind'][kind]:.3f} s"
                    + (
                        ""
                        if kind == "none"
                        else f" ({s['handoff_ratio_by_kind'][kind]:.3f}x no hand-off)"
                    ),
                }
            )
    rows += [
        {
            "measure": "hand-off steps / other steps, median step time",
            "value": f"**{s['handoff_ratio']:.3f}x**",
            "goal": f"<= {g['handoff_ratio']}x",
            "met": verdict(s["handoff_ratio"], g["handoff_ratio"], at_most=True),
        },
        {
            "measure": "hand-off steps / other steps, median CPU time per step",
            "value": f"{s['handoff_cpu_ratio']:.3f}x ("
            + ", ".join(
                f"{k} {r:.3f}x" for k, r in s["handoff_cpu_ratio_by_kind"].items() if k != "none"
            )
            + ")",
        },
        {
            "measure": "peak RSS of the learner process",
            "value": f"**{child['peak_bytes_per_param']:.1f} B/param** "
            f"({_mb(child['peak_rss'])} for {child['num_params']:,} params)",
            "goal": "none (reported)",
            "met": "-",
        },
    ]
    n = child["num_params"]
    for key, name in COMPONENT_NAMES.items():
        rows.append(
            {
                "measure": f"  of which: {name}",
                "value": f"{child['components'][key] / n:.1f} B/param",
            }
        )
    rows.append(
        {
            "measure": "  of which: unattributed (peak minus the above)",
            "value": f"{child['unattributed'] / n:.1f} B/param",
        }
    )
    return rows


def _size(mib: float) -> str:
    return f"{mib:,.0f}" if mib >= 10 else f"{mib:.3g}"


def plot(
    memory: dict[str, Any],
    runs: list[dict[str, Any]],
    summary: dict[str, Any],
    child: dict[str, Any],
    path: Path,
) -> None:
    from matplotlib.figure import Figure

    from ray_diloco.sim.figures import save_figure

    fig = Figure(figsize=(16, 11))
    (mem, tps), (steps, rss_ax) = fig.subplots(2, 2)
    below = {"loc": "upper center", "bbox_to_anchor": (0.5, -0.13), "fontsize": 9}

    bars = [
        ("replicated\nmeasured", memory["replicated"]["measured"]),
        ("replicated\narithmetic", memory["replicated"]["arithmetic"]),
        ("sharded\nmeasured", memory["sharded"]["measured"]),
        ("sharded\narithmetic", memory["sharded"]["arithmetic"]),
    ]
    xs = list(range(len(bars)))
    params = [b["params"] / 2**20 for _, b in bars]
    opt = [b["opt_state"] / 2**20 for _, b in bars]
    mem.bar(xs, params, color="tab:blue", label="parameters")
    mem.bar(xs, opt, bottom=params, color="tab:orange", label="optimizer state (Adam's moments)")
    for x, (p, o) in enumerate(zip(params, opt, strict=True)):
        mem.text(x, p + o, _size(p + o), ha="center", va="bottom", fontsize=9)
    mem.set_xticks(xs, [name for name, _ in bars])
    mem.set_ylabel("MiB on one device (device 0)")
    mem.set_ylim(0, 1.12 * max(p + o for p, o in zip(params, opt, strict=True)))
    mem.set_title(
        f"per-device parameters + optimizer state\nsharded / replicated = "
        f"{summary['bytes_ratio']:.3f}x (goal <= {GOALS['bytes_ratio']}x)"
    )
    mem.legend(ncol=2, **below)
    mem.grid(axis="y", alpha=0.3)

    pairs = sorted({r["pair"] for r in runs})
    for loop, colour, marker in (("bare", "tab:gray", "s"), ("ray-diloco", "tab:green", "o")):
        ys = [next(r for r in runs if r["pair"] == p and r["loop"] == loop) for p in pairs]
        label = "bare jitted FSDP loop" if loop == "bare" else "ray-diloco learner (LearnerCore)"
        tps.plot(pairs, [r["tokens_per_s"] for r in ys], marker=marker, color=colour, label=label)
    top = max(r["tokens_per_s"] for r in runs)
    for p, ratio in zip(pairs, summary["tokens_ratio_per_pair"], strict=True):
        tps.text(p, 1.04 * top, f"{ratio:.3f}", ha="center", fontsize=9)
    first = {r["pair"]: r["loop"] for r in reversed(runs)}
    tps.set_xticks(pairs, [f"pair {p}\n({first[p]} first)" for p in pairs])
    tps.set_xlim(pairs[0] - 0.4, pairs[-1] + 0.4)
    tps.set_ylabel("tokens/s (steady state)")
    tps.set_ylim(0, 1.12 * top)
    tps.set_title(
        f"tokens/s per pair, ratio above each\nray-diloco / bare: median "
        f"{summary['tokens_ratio']:.3f} (goal >= {GOALS['tokens_ratio']}); per CPU-second "
        f"{summary['tokens_per_cpu_s_ratio']:.3f}"
    )
    tps.legend(ncol=2, **below)
    tps.grid(alpha=0.3)

    colours = {"none": "tab:green", "begin": "tab:blue", "collect": "tab:red", "both": "tab:purple"}
    names = {
        "none": "no hand-off",
        "begin": "begins a fragment's\nhost copies",
        "collect": "collects the offer\n(delta, int4)",
    }
    bare_steps = [t for r in runs if r["loop"] == "bare" for t in r["step_s"]]
    groups = [("bare loop", bare_steps, "tab:gray")]
    for kind in ("none", "begin", "collect", "both"):
        ts = [
            t
            for r in runs
            if r["loop"] == "ray-diloco"
            for k, t in zip(r["kinds"], r["step_s"], strict=True)
            if k == kind
        ]
        if ts:
            groups.append((f"ray-diloco:\n{names.get(kind, kind)}", ts, colours[kind]))
    for i, (_, ts, colour) in enumerate(groups):
        spread = [i + 0.25 * ((j * 0.618) % 1 - 0.5) for j in range(len(ts))]
        steps.scatter(spread, ts, color=colour, alpha=0.7, s=22)
        steps.hlines(statistics.median(ts), i - 0.3, i + 0.3, color="black", linewidth=2)
    steps.plot([], [], color="black", linewidth=2, label="median")
    steps.set_xticks(range(len(groups)), [name for name, _, _ in groups], fontsize=9)
    steps.set_ylabel("step time (s)")
    steps.set_ylim(0, None)
    steps.set_title(
        "every timed step (count in the labels' order: "
        + ", ".join(str(len(ts)) for _, ts, _ in groups)
        + f")\nhand-off / other ray-diloco steps = {summary['handoff_ratio']:.3f}x "
        f"(goal <= {GOALS['handoff_ratio']}x)"
    )
    steps.legend(loc="lower right", fontsize=9)
    steps.grid(axis="y", alpha=0.3)

    n = child["num_params"]
    items = [(COMPONENT_NAMES[k], v / n) for k, v in child["components"].items()]
    items.append(("unattributed (peak minus the above)", child["unattributed"] / n))
    ys = list(range(len(items)))
    rss_ax.barh(ys, [v for _, v in items], color="tab:blue")
    for y, (_, v) in zip(ys, items, strict=True):
        rss_ax.text(max(v, 0), y, f" {v:.1f}", va="center", fontsize=9)
    peak = child["peak_bytes_per_param"]
    rss_ax.axvline(peak, color="tab:red", linewidth=2, label=f"peak RSS: {peak:.1f} B/param")
    rss_ax.set_yticks(ys, [name for name, _ in items], fontsize=8)
    rss_ax.invert_yaxis()
    rss_ax.set_xlim(min(0, *(v for _, v in items)) * 1.1, 1.15 * peak)
    rss_ax.set_xlabel("bytes per parameter")
    rss_ax.set_title(
        f"learner process (child): peak RSS {_mb(child['peak_rss'])}\nfor {n:,} parameters, "
        "by component"
    )
    rss_ax.legend(**below)
    rss_ax.grid(axis="x", alpha=0.3)
    save_figure(fig, path, dpi=100)


def write(
    out: Path, name: str, rows: list[dict[str, Any]], meta: dict[str, Any]
) -> tuple[Path, Path]:
    """JSON and markdown (the table with its command, machine and date)."""
    md = write_results(out, name, rows, ["measure", "value", "goal", "met"], meta)
    return out / f"{name}.json", md


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=None, help="pairs of runs (bare, ray-diloco)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # the learner process
    args = p.parse_args()
    if args.child:
        spec, out = (Path(x) for x in args.child)
        Path(out).write_text(json.dumps(learner_memory(json.loads(spec.read_text()))))
        return

    import jax
    import numpy as np

    from ray_diloco.algorithm.learner_core import LearnerCore
    from ray_diloco.algorithm.setup import Setup, learner_layout
    from ray_diloco.config import build_config

    name = "sharded_learner-quick" if args.quick else "sharded_learner"
    setting = dict(SETTINGS["quick" if args.quick else "full"])
    setting["pairs"] = args.pairs or setting["pairs"]
    setting["steps"] = args.steps or setting["steps"]
    if len(jax.devices()) != DEVICES:
        raise SystemExit(f"expected {DEVICES} CPU devices, JAX has {jax.devices()}")
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sharded_learner-") as tmp_dir:
        tmp = Path(tmp_dir)
        data = prepare_data(setting, tmp / "data")
        print(data["printed"], flush=True)
        tree = config_tree(setting, str(tmp / "data"), SHARDED)
        cfg = build_config(tree)
        setup = Setup.build(cfg)
        # Pure host arrays (Setup.build's are views of the initialising device buffers).
        init = {k: np.array(v, np.float32) for k, v in setup.init.items()}
        setup.init = init
        num_params = setup.num_params()
        print(f"{num_params:,} parameters; the learner process's memory (child)", flush=True)
        child = run_child(tree, init, tmp)
        print(f"learner process: peak RSS {child['peak_bytes_per_param']:.1f} B/param", flush=True)

        memory: dict[str, Any] = {}
        rep_cfg = build_config(config_tree(setting, str(tmp / "data"), REPLICATED))
        rep_layout = learner_layout(rep_cfg, setup.task, setup.layout, rep_cfg.learners[0])
        rep = LearnerCore(
            rep_cfg,
            rep_cfg.learners[0],
            setup.task,
            setup.layout,
            setup.plan,
            snapshot_of(setup.plan, init),
            layout=rep_layout,
        )
        memory["replicated"] = layout_bytes(rep, setup.layout)
        del rep
        gc.collect()
        core = LearnerCore(
            cfg,
            cfg.learners[0],
            setup.task,
            setup.layout,
            setup.plan,
            snapshot_of(setup.plan, init),
        )
        memory["sharded"] = layout_bytes(core, setup.layout)
        bare = BareLoop(cfg, setup.task, init, list(core.layout.mesh.devices.flat))
        if bare.specs != core.layout.specs:
            differ = [k for k in bare.specs if bare.specs[k] != core.layout.specs[k]]
            raise SystemExit(f"the bare loop's FSDP specs differ from the learner's: {differ}")

        runs: list[dict[str, Any]] = []
        loops = {"bare": bare.step, "ray-diloco": lambda: learner_step(core)}
        for pair in range(setting["pairs"]):
            order = ["bare", "ray-diloco"] if pair % 2 == 0 else ["ray-diloco", "bare"]
            for loop in order:
                run = timed_run(loop, loops[loop], setting["steps"], core.tokens_per_step)
                runs.append({"pair": pair, **run})
                print(f"pair {pair} {loop}: {run['tokens_per_s']:,.1f} tokens/s", flush=True)

    summary = summarise(memory, runs, child)
    rows = table_rows(memory, summary, child)
    meta = {
        "setting": setting,
        "config": {**tree, "task_args": {**tree["task_args"], "data_dir": "<temporary>"}},
        "data": {k: v for k, v in data.items() if k != "printed"},
        "num_params": num_params,
        "tokens_per_step": core.tokens_per_step,
        "devices": [str(d) for d in core.layout.mesh.devices.flat],
        "fragments": {"params": list(setup.plan.sizes)},
        "goals": GOALS,
        "summary": summary,
        "memory": memory,
        "runs": runs,
        "learner_process": child,
        "wall_s": time.perf_counter() - t_start,
    }
    json_path, md = write(args.out, name, rows, meta)
    plot(memory, runs, summary, child, args.out / f"{name}.png")
    print(f"{json_path}, {md}, {args.out / f'{name}.png'}")


if __name__ == "__main__":
    main()
