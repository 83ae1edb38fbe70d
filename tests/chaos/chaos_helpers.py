"""Shared pieces of the chaos tests: the run config, running it on the module's cluster, and
the checks every fault kind must pass (issue 4).

The run: the tiny model on synthetic data, decoupled with K = 1, two learners in two regions
of the emulated cluster: `v5p` on the v5p slice (two hosts, one jax.distributed job, us-east5)
and `eu`, a one-host CPU learner on a europe-west4 host behind an emulated WAN link. Learners
run at a fifth of their compute speed (sleeping the rest), so four JAX processes leave CPU for
the restarts on two cores. Chaos times count from the moment every learner trains.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray_diloco.config import RunConfig, build_config
from ray_diloco.control.events import Event, FaultInjected, RoundClosed, RunFinished
from ray_diloco.control.goodput import uptime
from ray_diloco.control.recovery import FaultOutcome, fault_outcomes
from ray_diloco.control.tape import read_tape

REGIONS = {"v5p": "us-east5", "eu": "europe-west4"}
# |held-out loss - fault-free reference run (same seed)|: the Ray runs are not step-for-step
# deterministic (wall-clock arrival order) and a fault costs a learner some rounds.
LOSS_TOLERANCE = 0.35


def chaos_tree(budget: int, faults: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "name": "chaos",
        "seed": 0,
        "token_budget": budget,
        "model": {"d_model": 32, "num_layers": 2, "num_heads": 2, "d_ff": 64, "seq_len": 16},
        "data": {"source": "synthetic", "eval_batches": 2, "eval_batch_size": 8},
        "diloco": {
            "mode": "decoupled",
            "sync_every": 6,
            "num_fragments": 2,
            "overlap_steps": 1,
            "quorum_min": 1,
            "norm_guard_warmup_rounds": 3,
        },
        "learners": [
            {
                "name": "v5p",
                "accelerator": "tpu-v5p",
                "topology": "2x2x2",
                "num_hosts": 2,
                "region": REGIONS["v5p"],
                "batch_size": 8,
                "speed": 0.2,
            },
            {"name": "eu", "region": REGIONS["eu"], "batch_size": 8, "speed": 0.2},
        ],
        "links": {REGIONS["eu"]: {"bandwidth_gbps": 0.05, "latency_ms": 20}},
        "synchronizer": {"checkpoint_every_rounds": 10, "heartbeat_timeout_s": 5},
        "supervisor": {"heartbeat_timeout_s": 2.0, "restart_backoff_s": 0.2},
        "chaos": {"enabled": bool(faults), "seed": 0, "schedule": faults},
        "checkpoint": {"keep": 2},
        "metrics": {"log_every_s": 1, "eval_every_s": 2, "export_ray_metrics": False},
    }


def chaos_config(
    tmp_path: Path, name: str, budget: int, faults: list[dict[str, Any]]
) -> RunConfig:
    tree = chaos_tree(budget, faults)
    tree.update(run_dir=str(tmp_path / name))
    tree["synchronizer"]["name"] = f"sync-{name}"
    return build_config(tree, f"chaos test {name}")


@dataclass
class ChaosRun:
    cfg: RunConfig
    summary: dict[str, Any]
    events: list[Event]
    outcomes: list[FaultOutcome]
    wall_s: float

    def outcome(self, kind: str) -> FaultOutcome:
        (o,) = [o for o in self.outcomes if o.fault == kind]
        return o


def run_chaos(cfg: RunConfig) -> ChaosRun:
    from ray_diloco.driver import run_training

    started = time.monotonic()
    summary = run_training(cfg, progress=lambda line: None)
    events = read_tape(Path(cfg.run_dir) / "events.jsonl")
    outcomes = fault_outcomes(events, REGIONS)
    return ChaosRun(cfg, summary, events, outcomes, time.monotonic() - started)


def training_uptime(run: ChaosRun) -> float:
    """Uptime from the first closed round to the end of the run, in the summary's windows:
    the start (processes booting, compiling) is not a failure to advance."""
    rounds = [e.t for e in run.events if isinstance(e, RoundClosed)]
    end = max(e.t for e in run.events if isinstance(e, RunFinished | RoundClosed))
    return uptime(rounds, rounds[0], end, run.summary["uptime_window_s"])


def check_run(
    run: ChaosRun,
    reference_loss: float,
    *,
    rejections: set[str] = frozenset(),  # type: ignore[assignment]
    full_uptime: bool = True,
) -> None:
    """What every chaos run must show (issue 4)."""
    s = run.summary
    assert s["tokens"] >= run.cfg.token_budget, s["stop_reason"]
    assert s["stop_reason"] == "token budget reached"
    # the fault, its detection and its recovery, in that order on the tape
    injected = [e for e in run.events if isinstance(e, FaultInjected)]
    assert injected, "no fault was injected"
    for o in run.outcomes:
        assert o.detected_t is not None, f"{o.fault} never detected: {o}"
        assert o.recovered_t is not None, f"{o.fault} never recovered: {o}"
        assert o.t <= o.detected_t <= o.recovered_t
    if full_uptime:
        assert training_uptime(run) == 1.0
    # nothing non-finite or fenced was merged: the global model is finite, rejections are the
    # expected kinds only, and the ledger neither lost nor double-counted tokens
    assert s["heldout_loss"] == s["heldout_loss"] and abs(s["heldout_loss"]) < 1e3
    assert set(s["rejected"]) <= set(rejections) | {"stale_version", "empty"}, s["rejected"]
    assert s["ledger_violations"] == []
    for name, acct in s["learners"].items():
        assert acct["tokens"] == acct["final_cursor"], (name, acct)
    assert s["tokens"] == sum(a["tokens"] for a in s["learners"].values())
    assert abs(s["heldout_loss"] - reference_loss) <= LOSS_TOLERANCE, (
        s["heldout_loss"],
        reference_loss,
    )


class NodeReplacer:
    """Emulates the cloud replacing a lost TPU host: once a host node of the cluster is dead,
    remove it from the `Cluster` and add a host with the same slice identity."""

    def __init__(self, tpu_cluster: Any) -> None:
        self.tpu = tpu_cluster
        self.replaced: list[tuple[str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-replacer", daemon=True)

    def __enter__(self) -> NodeReplacer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        import ray

        while not self._stop.wait(0.5):
            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            for key, node in list(self.tpu.hosts.items()):
                if node.node_id not in alive:
                    self.tpu.cluster.remove_node(node, allow_graceful=False)
                    self.tpu.add_slice_host(*key)
                    self.replaced.append(key)
