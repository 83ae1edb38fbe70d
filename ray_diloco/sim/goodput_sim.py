"""Layer: sim (pure, no Ray, no JAX). Discrete-event goodput simulator at scale
(docs/algorithm.md sections 9 and 10; the model, term by term, in docs/goodput.md).

Systems react to the same failure trace (`goodput_trace.make_trace`); each is a job, or a set
of jobs, of `goodput_jobs` (a failure stops a running job for the cost of its recovery; one
during a stall holds it until that slice too is back and recovered; every job loses its step
in flight). Every failure first costs `detect_s`.

- `data_parallel`: one SPMD job over every slice. It stops at a failure, waits for the slice
  (the hot-spare swap), restarts (`restart_cost_s`), reloads its state (`state_gb_per_chip`
  at `reload_gbps`) and loses the work since its last checkpoint (every
  `checkpoint_interval_s` of running time; 0: every step, so the step in flight).
- `elastic_dp`: slice-granular. A failure pauses the whole job `reconfig_pause_s` to re-mesh
  onto the healthy slices; it goes on with fewer chips until the slice rejoins at a re-mesh.
- `decoupled`: M learners of about N/M chips (contiguous groups of slices), each its own job
  (`learner_mode`: shrink, spare, or restart), and the synchronizer between them
  (`goodput_sync.FragmentSim`: one fragment's rounds at the real cadence through the real
  `RoundBook`). Only work that a committed round merged counts.
- `elastic_dp_per_learner`: the comparison of section 10, elastic data-parallel on N/M chips,
  run as M independent elastic jobs, one on each learner's slices, goodput averaged.

Goodput = productive chip-seconds / (N chips * duration). Uptime = the share of windows of
`uptime_window_s` in which the global model advanced: kept training time for the
data-parallel systems (work later lost to a restart does not count), a committed round of the
fragment for `decoupled` (0 when none commits), on windows no shorter than the fragment's
window (a link-bound cadence commits less often, on schedule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ray_diloco.config import DilocoConfig, GoodputSimConfig, SynchronizerConfig
from ray_diloco.sim.goodput_jobs import Activity, Slices, cluster, groups, shrinking, waiting
from ray_diloco.sim.goodput_sync import FragmentSim, cadence, commit_uptime
from ray_diloco.sim.goodput_trace import SECONDS_PER_DAY, FailureTrace, make_trace, window_uptime

# Settings the sweep reports beside the defaults: repairs and restarts ten times slower and
# learners that die at every failure; and a synchronizer whose learners' links carry a
# fragment each way in more than the H steps of a window.
PRESETS: dict[str, dict[str, Any]] = {
    "calibrated": {},
    "slow-repair": {
        "recovery_median_s": 100.0,
        "recovery_sigma": 1.0,
        "restart_cost_s": 540.0,
        "checkpoint_interval_s": 600.0,
        "reconfig_pause_s": 100.0,
        "learner_mode": "restart",
    },
    "slow-link": {"link_gbps": 0.5},
}


@dataclass(frozen=True)
class SystemResult:
    """One system's outcome on one trace."""

    system: str  # data_parallel | elastic_dp | decoupled | elastic_dp_per_learner
    chips: int  # allocated chips, the whole cluster
    learners: int  # independent jobs the chips are split into (1 for the baselines)
    goodput: float
    uptime: float
    failures: int  # slice failures in the trace
    restarts: int  # job restarts, re-meshes, or learner incarnations after the first
    rounds: int = 0  # rounds of the simulated fragment committed by the RoundBook (decoupled)
    # decoupled: the learners' computed chip-seconds over the cluster's (the goodput if every
    # trained step counted, as a time-based measure counts it), the share of that work that
    # committed rounds merged, and the seconds between two rounds of a fragment
    trained: float | None = None
    merged_share: float | None = None
    window_s: float | None = None
    sync: dict[str, Any] | None = None  # decoupled: `goodput_sync.SyncOutcome.diagnostics`


def reload_s(cfg: GoodputSimConfig) -> float:
    """Reloading one chip's training state from a peer's in-memory copy."""
    return cfg.state_gb_per_chip * 8 / cfg.reload_gbps


def data_parallel(cfg: GoodputSimConfig, trace: FailureTrace) -> SystemResult:
    # Recomputation: the work since the last checkpoint (every step: the step in flight).
    every = cfg.checkpoint_interval_s if cfg.checkpoint_interval_s > 0 else cfg.step_time_s
    job = waiting(cluster(trace), cfg.detect_s + cfg.restart_cost_s + reload_s(cfg), every)
    return SystemResult(
        system="data_parallel",
        chips=job.total_chips,
        learners=1,
        goodput=job.goodput(),
        uptime=_uptime(cfg, job),
        failures=trace.num_failures,
        restarts=job.num_stalls,
    )


def _uptime(cfg: GoodputSimConfig, job: Activity) -> float:
    return window_uptime(job.starts, job.ends, job.duration_s, cfg.uptime_window_s)


def elastic_dp(cfg: GoodputSimConfig, trace: FailureTrace) -> SystemResult:
    job = shrinking(cluster(trace), cfg.detect_s + cfg.reconfig_pause_s, cfg.step_time_s)
    return SystemResult(
        "elastic_dp",
        job.total_chips,
        1,
        job.goodput(),
        _uptime(cfg, job),
        trace.num_failures,
        job.num_stalls,
    )


def learner_bounds(trace: FailureTrace, num_learners: int) -> list[int]:
    """Bounds b of the learners' contiguous slice ranges [b[k], b[k+1]), sizes differing by
    at most one."""
    if num_learners > trace.num_slices:
        raise ValueError(
            f"{num_learners} learners need at least as many slices; the cluster has "
            f"{trace.num_slices}. Raise goodput_sim.chips or lower goodput_sim.chips_per_slice"
        )
    return [int(b) for b in np.linspace(0, trace.num_slices, num_learners + 1).round()]


def elastic_per_learner(cfg: GoodputSimConfig, trace: FailureTrace) -> SystemResult:
    """M independent elastic jobs, one on each learner's slices: elastic data-parallel on
    N/M chips, averaged over M draws of the same trace (the comparison of section 10)."""
    slices = groups(trace, learner_bounds(trace, cfg.num_learners))
    pause = cfg.detect_s + cfg.reconfig_pause_s
    jobs = [shrinking(g, pause, cfg.step_time_s) for g in slices]
    return SystemResult(
        "elastic_dp_per_learner",
        int(trace.slice_chips.sum()),
        cfg.num_learners,
        sum(j.work for j in jobs) / (trace.slice_chips.sum() * trace.duration_s),
        float(np.mean([_uptime(cfg, j) for j in jobs])),
        trace.num_failures,
        sum(j.num_stalls for j in jobs),
    )


def learner_activity(cfg: GoodputSimConfig, job: Slices, fetch_s: float = 0.0) -> Activity:
    """One learner on its slices, reacting to failures as `cfg.learner_mode` says; a
    restarted learner also fetches every fragment (`fetch_s`) before its first step."""
    step = cfg.step_time_s  # every mode loses the step in flight
    if cfg.learner_mode == "shrink":
        return shrinking(job, cfg.detect_s + cfg.reconfig_pause_s, step)
    if cfg.learner_mode == "spare":
        return waiting(job, cfg.detect_s + cfg.reconfig_pause_s, step)
    return waiting(job, cfg.detect_s + cfg.restart_cost_s + fetch_s, step)


class InfeasibleError(ValueError):
    """A configuration in which no round can commit: a guard, not a 0% result."""


def learner_mtbf_s(cfg: GoodputSimConfig) -> float:
    """Mean time between failures of one learner of N/M chips."""
    chips = cfg.chips / cfg.num_learners
    return cfg.mtbi_chip_days * SECONDS_PER_DAY / chips


# The rounds the published figure measured, which the sweep reproduces: the adaptive grace window,
# a non-contributor's unsent work overwritten by the new version, bases at most 4 versions
# behind. This project's default keeps unsent work (docs/decisions/022-pulled-rounds.md); a run
# config's own rule is simulated when one is given.
PUBLISHED_RULE = {"grace_fraction": 0.5, "keep_unsent_work": False, "max_staleness_versions": 4}
PUBLISHED_METHOD = DilocoConfig(**PUBLISHED_RULE)


def check_feasible(cfg: GoodputSimConfig, diloco: DilocoConfig | None = None) -> None:
    """Raise `InfeasibleError` where restarting learners cannot get their work into rounds: a
    fragment's window (H steps, or what the link allows) at least as long as a learner's mean
    time between failures means most incarnations die before their first contribution, and
    their counters die with them. Learners that shrink or wait for a spare keep their state
    through every pause, so their work reaches a round whatever the failure rate (goodput
    then falls like exp(-lambda d), never to a silent 0)."""
    diloco = diloco or PUBLISHED_METHOD
    mtbf = learner_mtbf_s(cfg)
    window = cadence(cfg, diloco).window_s
    if cfg.learner_mode == "restart" and window >= mtbf:
        raise InfeasibleError(
            f"goodput_sim: a fragment's window ({window:.0f} s: H x step_time, or the link) "
            f"is at least a learner's mean time between failures ({mtbf:.0f} s: "
            f"{cfg.chips / cfg.num_learners:,.0f} chips per learner at mtbi_chip_days="
            f"{cfg.mtbi_chip_days:g}), so restarting learners die before they contribute and "
            "almost no round commits. Raise goodput_sim.num_learners, lower "
            "goodput_sim.step_time_s or diloco.sync_every, or set goodput_sim.learner_mode=shrink"
        )


class DecoupledSim:
    """M learners (their activity from the failure trace) and the synchronizer between them
    (`goodput_sync.FragmentSim`)."""

    def __init__(
        self,
        cfg: GoodputSimConfig,
        trace: FailureTrace,
        diloco: DilocoConfig | None = None,
        sync: SynchronizerConfig | None = None,
    ) -> None:
        self.cfg, self.trace = cfg, trace
        self.diloco = diloco or PUBLISHED_METHOD
        self.sync = sync or SynchronizerConfig()
        fetch = cadence(cfg, self.diloco).fetch_s
        slices = groups(trace, learner_bounds(trace, cfg.num_learners))
        self.jobs = [learner_activity(cfg, g, fetch) for g in slices]
        self.fragment = FragmentSim(cfg, self.jobs, self.diloco, self.sync)

    @property
    def book(self) -> Any:
        return self.fragment.book

    def run(self) -> SystemResult:
        cfg, dur = self.cfg, self.trace.duration_s
        out = self.fragment.run()
        chips = int(self.trace.slice_chips.sum())
        computed = sum(j.work for j in self.jobs)
        if cfg.learner_mode == "restart":
            restarts = sum(max(0, len(j.starts) - 1) for j in self.jobs)
        else:
            restarts = sum(j.num_stalls for j in self.jobs)
        return SystemResult(
            system="decoupled",
            chips=chips,
            learners=cfg.num_learners,
            goodput=out.merged_chip_s / (chips * dur),
            # A fragment's round is due once a window: a window of the cadence without one
            # is downtime however long it is.
            uptime=commit_uptime(out.commits_s, dur, max(cfg.uptime_window_s, out.window_s)),
            failures=self.trace.num_failures,
            restarts=restarts,
            rounds=out.rounds,
            trained=computed / (chips * dur),
            merged_share=out.merged_chip_s / computed if computed else 0.0,
            window_s=out.window_s,
            sync=out.diagnostics,
        )


def decoupled(
    cfg: GoodputSimConfig,
    trace: FailureTrace,
    diloco: DilocoConfig | None = None,
    sync: SynchronizerConfig | None = None,
) -> SystemResult:
    return DecoupledSim(cfg, trace, diloco, sync).run()


def simulate(
    cfg: GoodputSimConfig,
    diloco: DilocoConfig | None = None,
    sync: SynchronizerConfig | None = None,
    trace: FailureTrace | None = None,
) -> list[SystemResult]:
    """Every system on one trace of `cfg.chips` chips (drawn from `cfg.seed` unless given).
    Raises `InfeasibleError` where no round of the decoupled system could commit."""
    check_feasible(cfg, diloco)
    trace = trace if trace is not None else make_trace(cfg)
    return [
        data_parallel(cfg, trace),
        elastic_dp(cfg, trace),
        decoupled(cfg, trace, diloco, sync),
        elastic_per_learner(cfg, trace),
    ]
