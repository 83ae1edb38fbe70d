"""Shared pieces of the chaos tests: the run config, running it on the module's cluster, and
the checks every fault kind must pass.

The run: the tiny model on synthetic data, decoupled with K = 1, two learners in two regions
of the emulated cluster: `us`, a one-host CPU learner on a us-east5 host, and `eu`, one on a
europe-west4 host behind an emulated WAN link. With `multi_host=True` the `us` learner is `v5p`
instead: the whole v5p slice (two hosts, one jax.distributed job). Steps are paced by step
time (`pace: step_time`): 40 ms for `us`, 44 ms for `eu`, mostly sleep, so a run lasts the same
wall time on any machine and the restarts get CPU on two cores. Chaos times count from the
moment every learner trains.

A chaos run trains its token budget and then on, up to `CEILING` times it, until every
injected fault has recovered (or was superseded by the next): how long a restart takes (a boot
and a compile: under 10 s on an idle machine, over 50 s at load 13 on 2 cores) depends on the
machine's load, the healthy learner's pace does not. Its learning-rate schedule decays over the
budget (`inner.decay_tokens`), as the reference run's does, and is held at its end after.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ray_diloco.config import RunConfig, build_config
from ray_diloco.control.events import Event, FaultInjected, RoundClosed
from ray_diloco.control.goodput import uptime
from ray_diloco.control.protocol import SupervisorStatus
from ray_diloco.control.recovery import FaultOutcome, fault_outcomes
from ray_diloco.control.tape import read_tape
from tests.stop_helpers import stop_after

REGIONS = {"us": "us-east5", "v5p": "us-east5", "eu": "europe-west4"}
# Held-out loss may exceed the fault-free in-process reference run's (same config and seed) by
# this much. Ray runs are not step-for-step deterministic (wall-clock arrival order), and at
# these budgets the loss curve is steep: a run that lost ground ends far up it. Measured on
# 2 cores with step-time pacing:
# - fault-free, one-host learners: 2.15, 2.12, 2.40 (reference 2.21) and 1.43 (reference 1.54);
#   with the two-host v5p learner 1.91, 1.96, 2.15 (reference 1.65), and 2.27 once with a host
#   killed: its decoupled runs land higher on Ray although a synchronous two-host run matches
#   the reference to 1e-4 (tests/ray/test_train.py), so the gap is in wall-clock timing, not in
#   the SPMD numerics (an open question);
# - a 4 s link fault (reference 2.04): 1.60, 1.76 (cut) and 1.69, 2.01 (slow) idle; 1.98, 1.89
#   (cut) and 2.02 (slow) at load 9; but 2.64 (cut) once in CI, beside the Ray tests,
#   when the one-fault bound was +0.6 (the runs had stood at 2.6 a third of the
#   way through their budget; that run's cause is not known);
# - the storm (reference 0.943): 0.87, 1.09, 1.13, 1.17, 1.37, 1.38, 1.52, 1.58 idle; when its
#   synchronizer kill lands while both learners restart, the shard falls back to its checkpoint
#   (up to 13 merged rounds rolled back, the outer momentum the checkpoint's): the highest.
# A merged NaN or stale garbage ends far above it (the untrained model is at 5.56). These runs
# had `round_step: full` or `fraction`; the references were the sqrt step's
# (2.170 one-host, 2.285 two-host, 0.940 storm). One CI-equivalent run on it: one-host runs
# 1.08-2.27 (the lowest trained on past 72k tokens while a fault recovered), the two-host kill
# 1.67, the storm 0.62. The storm's budget is 120k tokens (reference 1.684):
# 1.18 idle, 1.66 beside two busy processes (`--cpu-load 2`). Since the mixing default
# (`diloco.mixing_alpha: 0.25`) the references are 1.866 one-host, 1.946 two-host
# and 1.232 for the storm.
LOSS_TOLERANCE = 0.9
MIN_UPTIME_WINDOW_S = 4.0
# 8, not 4: a two-host learner's restart (boot, then compile) took 121 s at load ~25 while the
# healthy learner trained through 4x the budget before it was back (a clean-clone
# suite run beside a 4-learner training run). A passing run stops at its settling, not here.
CEILING = 8
SETTLED = "token budget reached and every fault settled"
UNNOTICED_GRACE_S = 20.0


def chaos_tree(
    budget: int, faults: list[dict[str, Any]], multi_host: bool = False
) -> dict[str, Any]:
    # Slightly different speeds and some jitter, as real learners: their offers of a fragment
    # then rarely arrive together, in the reference run as on Ray.
    us: dict[str, Any] = {"name": "us", "region": REGIONS["us"], "batch_size": 8, "speed": 1.0}
    eu: dict[str, Any] = {"name": "eu", "region": REGIONS["eu"], "batch_size": 8, "speed": 0.9}
    for lg in (us, eu):
        lg["jitter"] = 0.1
    if multi_host:
        # Its SPMD steps over gloo take 60-70 ms on 2 cores: paced at 73 ms (speed 0.55), it is
        # as slow on Ray as on the reference run's virtual clock, whatever the machine.
        us |= {"name": "v5p", "accelerator": "tpu-v5p", "topology": "2x2x2", "num_hosts": 2}
        us |= {"speed": 0.55}
    return {
        "name": "chaos",
        "seed": 0,
        "token_budget": budget,
        "inner": {"decay_tokens": budget},
        "step_time_s": 0.04,
        "pace": "step_time",
        "task_args": {
            "model": {"d_model": 32, "num_layers": 2, "num_heads": 2, "d_ff": 64, "seq_len": 16},
            "data": {"source": "synthetic", "eval_batches": 2, "eval_batch_size": 8},
        },
        "diloco": {
            "mode": "decoupled",
            "sync_every": 6,
            "num_fragments": 2,
            "overlap_steps": 1,
            "quorum_min": 1,
            # Two learners, as the cluster jobs: an answer's base is at most a round behind, and
            # work a slowed link delivers past 4 versions is refused, so the learner is seen
            # starving (at the default 8 a 4 s slow link let late work merge, unnoticed).
            "max_staleness_versions": 4,
        },
        "learners": [us, eu],
        "links": {REGIONS["eu"]: {"bandwidth_gbps": 0.05, "latency_ms": 20}},
        "synchronizer": {"checkpoint_every_rounds": 30, "heartbeat_timeout_s": 5},
        "supervisor": {"heartbeat_timeout_s": 2.0, "restart_backoff_s": 0.2},
        "chaos": {"enabled": bool(faults), "seed": 0, "schedule": faults},
        "checkpoint": {"keep": 2},
        "metrics": {"log_every_s": 1, "eval_every_s": 2, "export_ray_metrics": False},
    }


def chaos_config(
    tmp_path: Path,
    name: str,
    budget: int,
    faults: list[dict[str, Any]],
    multi_host: bool = False,
) -> RunConfig:
    """The run's config, with its budget raised to `CEILING` times `budget` (`run_chaos` stops
    it)."""
    tree = chaos_tree(budget, faults, multi_host)
    tree.update(run_dir=str(tmp_path / name), token_budget=budget * CEILING)
    tree["synchronizer"]["name"] = f"sync-{name}"
    return build_config(tree, f"chaos test {name}")


@dataclass
class ChaosRun:
    cfg: RunConfig
    summary: dict[str, Any]
    events: list[Event]
    outcomes: list[FaultOutcome]
    wall_s: float

    @property
    def budget(self) -> int:
        """The planned budget (`chaos_config` raised `token_budget` to the ceiling)."""
        return self.cfg.inner.decay_tokens or self.cfg.token_budget

    def outcome(self, kind: str) -> FaultOutcome:
        (o,) = [o for o in self.outcomes if o.fault == kind]
        return o


def run_chaos(cfg: RunConfig, may_go_unnoticed: frozenset[str] = frozenset()) -> ChaosRun:
    """Run `cfg` until its planned budget (`inner.decay_tokens`) is spent and every scheduled
    fault played out (`settled`), and a quarter of that budget past the moment they had.
    Faults of the kinds `may_go_unnoticed` (transient ones: a straggler, a link fault) that were
    never detected count as played out `UNNOTICED_GRACE_S` after they were first seen so."""
    from ray_diloco.runtime.driver import run_training

    budget = cfg.inner.decay_tokens or cfg.token_budget
    scheduled = len(cfg.chaos.schedule)
    unnoticed_since: dict[tuple[str, float], float] = {}

    def played_out(f: dict[str, Any]) -> bool:
        if f["recovered_t"] is not None or f["superseded"]:
            return True
        if f["fault"] not in may_go_unnoticed or f["detected_t"] is not None:
            return False
        first = unnoticed_since.setdefault((f["fault"], f["t"]), time.monotonic())
        return time.monotonic() - first >= UNNOTICED_GRACE_S

    # Once the faults played out, a quarter of the budget more: a recovery that came after the
    # budget was spent (a synchronizer restart the learners trained through) must also show
    # the training that follows it.
    stop = stop_after(lambda sup: settled(sup, scheduled, played_out), budget, SETTLED)
    started = time.monotonic()
    summary = run_training(cfg, progress=lambda line: None, stop_when=stop)
    events = read_tape(Path(cfg.run_dir) / "events.jsonl")
    outcomes = fault_outcomes(events, REGIONS)
    return ChaosRun(cfg, summary, events, outcomes, time.monotonic() - started)


def settled(
    sup: SupervisorStatus, scheduled: int, played_out: Callable[[dict[str, Any]], bool]
) -> bool:
    """From the supervisor's status: every one of the `scheduled` faults was injected or
    skipped (one that cannot be: a host on the head node), and each injected one played out:
    recovered, superseded (taken down again before it was over), or as `played_out` says."""
    if sup.chaos_injected + sup.chaos_skipped < scheduled:
        return False
    return all([played_out(f) for f in sup.faults])  # (each one: it starts their clocks)


def training_uptime(events: list[Event], summary: dict[str, Any]) -> float:
    """Uptime from the first to the last closed round: the start (processes booting,
    compiling) is not a failure to advance, nor is the end (no round closes once the budget is
    spent). Windows are the run's own (two sync periods, about 1 s here) but at least
    `MIN_UPTIME_WINDOW_S`: on two cores, a restarted learner compiling next to the survivor can
    starve it of CPU for a few seconds, which says nothing about the algorithm."""
    rounds = [e.t for e in events if isinstance(e, RoundClosed)]
    window = max(summary["uptime_window_s"], MIN_UPTIME_WINDOW_S)
    return uptime(rounds, rounds[0], rounds[-1], window)


def check_run(
    run: ChaosRun,
    reference_loss: float,
    *,
    rejections: set[str] = frozenset(),  # type: ignore[assignment]
    full_uptime: bool = True,
    may_go_unnoticed: frozenset[str] = frozenset(),
) -> None:
    """What every chaos run must show; `may_go_unnoticed` as for `run_chaos`."""
    s = run.summary
    unsettled = [o for o in run.outcomes if o.recovered_t is None and not o.superseded]
    assert s["stop_reason"] == SETTLED, (s["stop_reason"], unsettled)
    assert s["tokens"] >= run.budget
    # the fault, its detection and its recovery, in that order on the tape
    injected = [e for e in run.events if isinstance(e, FaultInjected)]
    assert injected, "no fault was injected"
    for o in run.outcomes:
        if o.recovered_t is None and o.superseded:
            continue
        if o.detected_t is None and o.fault in may_go_unnoticed:
            continue
        assert o.detected_t is not None, f"{o.fault} never detected: {o}"
        assert o.recovered_t is not None, f"{o.fault} never recovered: {o}"
        assert o.t <= o.detected_t <= o.recovered_t
    if full_uptime:
        assert training_uptime(run.events, run.summary) == pytest.approx(1.0)
    # nothing non-finite or fenced was merged: the global model is finite, rejections are the
    # expected kinds only, and the ledger neither lost nor double-counted tokens
    assert s["heldout_loss"] == s["heldout_loss"] and abs(s["heldout_loss"]) < 1e3
    # Stale deltas (a lost version, a late arrival) and a dead incarnation's deltas still in
    # flight are fenced, and the norm guard may refuse an honest but large one (a learner's
    # first after a restart): all protective. A NaN is refused only where a test injects one.
    allowed = {"stale_version", "old_incarnation", "empty", "norm_outlier"}
    assert set(s["rejected"]) <= set(rejections) | allowed, s["rejected"]
    assert s["ledger_violations"] == []
    for name, acct in s["learners"].items():
        assert acct["tokens"] == acct["final_cursor"], (name, acct)
    assert s["tokens"] == sum(a["tokens"] for a in s["learners"].values())
    # Quality: no worse than the fault-free reference run. (Faulted runs often end lower: a
    # restarted learner restarts from the global model with fresh optimizer moments.)
    assert s["heldout_loss"] <= reference_loss + LOSS_TOLERANCE, (
        s["heldout_loss"],
        reference_loss,
        quality_context(s),
    )


def quality_context(s: dict[str, Any]) -> dict[str, Any]:
    """What explains a run's held-out loss, for the message of a failed quality check: what
    was refused or dropped, each learner's merges, and the last evaluations."""
    return {
        "tokens": s["tokens"],
        "rejected": s["rejected"],
        "tokens_dropped": s["tokens_dropped"],
        "mean_contributors": s["mean_contributors"],
        "learners": {
            n: {k: a[k] for k in ("tokens", "contributions_merged", "restarts")}
            for n, a in s["learners"].items()
        },
        "last_evals": [
            {k: e[k] for k in ("t", "tokens", "rounds", "heldout_loss")} for e in s["evals"][-4:]
        ],
    }


class NodeReplacer:
    """Emulates the cloud replacing lost TPU hosts: every host node of the cluster that died is
    removed from the `Cluster` and a host with the same slice identity added, on exit or when
    `replace_dead()` is called. (`Cluster.add_node` must run on the main thread: it installs
    signal handlers.)"""

    def __init__(self, tpu_cluster: Any) -> None:
        self.tpu = tpu_cluster
        self.replaced: list[tuple[str, int]] = []

    def __enter__(self) -> NodeReplacer:
        return self

    def __exit__(self, *exc: object) -> None:
        deadline = time.monotonic() + 10.0  # the GCS declares a dead node in ~1.5 s here
        while not self.replace_dead() and exc[0] is None and time.monotonic() < deadline:
            time.sleep(0.5)

    def replace_dead(self) -> int:
        """Replace the host nodes the GCS reports dead now; returns how many."""
        import ray

        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        dead = [k for k, node in self.tpu.hosts.items() if node.node_id not in alive]
        for key in dead:
            self.tpu.cluster.remove_node(self.tpu.hosts[key], allow_graceful=False)
            self.tpu.add_slice_host(*key)
            self.replaced.append(key)
        return len(dead)
