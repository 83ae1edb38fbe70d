"""The simulators' sections: `goodput_sim` (`ray-diloco simulate-goodput`) and
`bandwidth_sim` (`ray-diloco simulate-bandwidth`). They describe a simulated fleet, not the run."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ray_diloco.config.base import WireDtype, _Frozen


class GoodputSimConfig(_Frozen):
    """Goodput simulation at scale (docs/algorithm.md section 10; `ray-diloco simulate-goodput`).

    Every cost is a term of a stated physical model (docs/goodput.md gives the reason or the
    source of each): detecting a failure, swapping in a hot-spare slice, restarting and
    compiling, reloading state, recomputing the work since the last checkpoint, re-meshing,
    and, for Decoupled DiLoCo, the synchronizer's cadence, link and merge times and its own
    shards' failures. One term, `restart_cost_s`, is calibrated, against one column of the
    published figure (data-parallel, 27% at 1.2M chips: `goodput_sweep.calibrate`); every other
    published cell is an out-of-sample check. `PRESETS` in `sim/goodput_sim.py` holds the
    other settings the sweep reports (slow repairs, a bandwidth-limited synchronizer).
    """

    chips: int = Field(1_200_000, ge=1)
    num_learners: int = Field(8, ge=1)
    chips_per_slice: int = Field(256, ge=1, description="the unit that fails and is replaced")
    mtbi_chip_days: float = Field(
        365.0,
        gt=0,
        description="mean time between interruptions of one chip: one chip-year, the published "
        "setting (1.2M chips then see a slice failure every ~26 s)",
    )
    recovery: Literal["lognormal", "exponential", "pareto"] = "lognormal"
    recovery_median_s: float = Field(
        10.0,
        gt=0,
        description="rescheduling a slice: until a hot spare stands in for a failed one; the "
        "optical circuit switch reconfigures cubes into a new torus in ~10 s, with spare cubes "
        "kept in every superpod for hot standbys (Gemini report, 2023)",
    )
    recovery_sigma: float = Field(
        0.5,
        gt=0,
        description="lognormal shape / pareto tail index; 0.5: a scripted swap from a spare "
        "pool varies less than repairs (sigma ~1 and more)",
    )
    detect_s: float = Field(
        5.0,
        ge=0,
        description="from a chip failing to the controller acting on it: a heartbeat timeout "
        "(this project's synchronizer.heartbeat_timeout_s); paid by every system at every "
        "failure, before any other cost",
    )
    restart_cost_s: float = Field(
        15.0,
        ge=0,
        description="restarting a job's processes once its slices are back: process start, "
        "runtime and distributed init, and the compile from the persistent compilation cache. "
        "The one calibrated term: goodput_sweep.calibrate sets it so data-parallel gives the "
        "published 27% at 1.2M chips (short for a restart of that size: see docs/goodput.md)",
    )
    state_gb_per_chip: float = Field(
        16.0,
        ge=0,
        description="training state one chip holds (parameters and optimizer state shards) "
        "that a restarted job reloads",
    )
    reload_gbps: float = Field(
        100.0,
        gt=0,
        description="per chip, reloading that state from a peer's in-memory copy (Gemini's "
        "redundant in-memory copies) over the data-centre network",
    )
    checkpoint_interval_s: float = Field(
        0.0,
        ge=0,
        description="data-parallel checkpoint period: a failure loses the work since the last "
        "one. 0: every step, in memory on peers, so a failure loses the step in flight",
    )
    reconfig_pause_s: float = Field(
        10.0,
        ge=0,
        description="one re-mesh without a restart (elastic data-parallel, a learner taking a "
        "slice in or out): every host loads the program for the new mesh from the compilation "
        "cache and the collectives across the remaining slices are formed again; no switch is "
        "reconfigured (slices talk over the data-centre network, and each keeps its torus) and "
        "no state moves (each slice holds a whole replica). Argued, not measured: less than a "
        "restart (restart_cost_s), which also starts the processes; docs/goodput.md gives "
        "what each published cell implies",
    )
    learner_mode: Literal["spare", "shrink", "restart"] = Field(
        "shrink",
        description="what a learner does when one of its slices fails. shrink (the published "
        "pattern: M learners on N chips are M elastic jobs on N/M): re-meshes onto its healthy "
        "slices and goes on with fewer chips; spare: pauses for the hot spare and re-meshes "
        "with it; restart: dies and comes back with the slice after a restart "
        "(restart_cost_s) and fetching every fragment, losing its unmerged work",
    )
    step_time_s: float = Field(
        1.7,
        gt=0,
        description="one inner step (bandwidth_sim's 12B-model step). With diloco.sync_every = "
        "H, a fragment's round comes every H steps: 40.8 s at H = 24",
    )
    straggler_cv: float = Field(
        0.02,
        ge=0,
        description="spread (std/mean) of the learners' step times, fixed per learner; with "
        "sync_schedule=offer it moves their offers out of phase",
    )
    sync_schedule: Literal["pull", "offer"] = Field(
        "pull",
        description="when learners contribute a fragment. pull: the synchronizer asks every "
        "learner for fragment p on its own schedule, every H steps (the published design as "
        "docs/algorithm.md section 5 reconstructs it); offer: each learner offers p when it is due "
        "on its own step count (this project's runtime). simulate-goodput takes diloco.schedule "
        "instead when the run config sets it",
    )
    model_params: float = Field(
        12e9, gt=0, description="parameters; sets the bytes a fragment puts on the link"
    )
    link_gbps: float = Field(
        10.0,
        gt=0,
        description="each learner's link to the synchronizer, each way; its fragments cross "
        "it one after another",
    )
    link_latency_ms: float = Field(10.0, ge=0, description="one-way latency of that link")
    merge_s: float = Field(
        1.0,
        ge=0,
        description="merging one fragment's round and taking the outer step on a synchronizer "
        "shard's CPU (RDA and Nesterov over 500M parameters: a few GB of memory traffic)",
    )
    shard_mtbf_days: float = Field(
        365.0,
        gt=0,
        description="mean time between failures of the synchronizer shard that owns a "
        "fragment: one CPU host, a host-year",
    )
    shard_restart_s: float = Field(
        60.0,
        ge=0,
        description="a synchronizer shard's outage: restart and restore its fragments and "
        "book from its checkpoint and round log (no committed round is lost); no round of its "
        "fragments commits meanwhile",
    )
    quorum_min: int = Field(1, ge=1)
    uptime_window_s: float = Field(
        60.0,
        gt=0,
        description="uptime: the share of windows of this length in which the global model "
        "advanced (a data-parallel job kept training; for decoupled, a round committed). A "
        "minute holds at least one round of a fragment at the default cadence",
    )
    duration_days: float = Field(
        1.0,
        gt=0,
        description="simulated time; a day holds ~3,200 slice failures at 1.2M chips and ~2,100 "
        "rounds of a fragment, so the sweep's cells move by tenths of a point with the seed",
    )
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> GoodputSimConfig:
        if self.recovery == "pareto" and self.recovery_sigma <= 1.0:
            raise ValueError(
                f"goodput_sim.recovery_sigma={self.recovery_sigma} is the pareto tail index; "
                "at <= 1 the mean recovery time is infinite. Set goodput_sim.recovery_sigma=2"
            )
        if self.quorum_min > self.num_learners:
            raise ValueError(
                f"goodput_sim.quorum_min={self.quorum_min} exceeds goodput_sim.num_learners="
                f"{self.num_learners}; no round could ever close. Lower goodput_sim.quorum_min"
            )
        if self.chips < self.num_learners * self.chips_per_slice:
            raise ValueError(
                f"goodput_sim.chips={self.chips} is less than one slice "
                f"({self.chips_per_slice} chips) per learner for {self.num_learners} learners; "
                "raise goodput_sim.chips or lower goodput_sim.chips_per_slice"
            )
        return self


class BandwidthSimConfig(_Frozen):
    """Cross-datacenter bandwidth of data-parallel training against Decoupled DiLoCo
    (docs/algorithm.md section 9; `ray-diloco simulate-bandwidth`). The defaults are this
    project's method settings; `PRESETS` in `sim/bandwidth_sim.py` holds the assumptions that
    reproduce the published pair (198 vs 0.84 Gbps across 8 datacenters)."""

    model_params: float = Field(
        12e9, gt=0, description="parameters; 12B, the model of the published four-region run"
    )
    step_time_s: float = Field(
        1.7,
        gt=0,
        description="inner step time. Not published; 1.7 s puts a 12B model's bfloat16 "
        "all-reduce across 8 datacenters at the published 198 Gbps",
    )
    datacenters: int = Field(8, ge=2, description="sites the run spans, one WAN link each")
    learners_per_datacenter: int = Field(1, ge=1)
    dp_wire: WireDtype = Field(
        "bfloat16", description="data-parallel gradient dtype in the all-reduce"
    )
    sync_every: int = Field(24, ge=1, description="H")
    num_fragments: int = Field(24, ge=1, description="P; P = H: one fragment due per step")
    overlap_steps: int = Field(
        2, ge=0, description="tau: steps a fragment's exchange overlaps with (0: none)"
    )
    wire_up: WireDtype = Field("int4", description="outer gradients, learner to synchronizer")
    wire_down: WireDtype | None = Field(
        "int4",
        description="published fragments: int4 differences as `diloco.publish_delta`, or None "
        "for full values",
    )
    int4_block_size: int = Field(64, ge=2)
    latency_ms: float = Field(
        20.0, ge=0, description="one-way WAN latency between datacenters (US cross-country)"
    )

    @model_validator(mode="after")
    def _check(self) -> BandwidthSimConfig:
        if self.num_fragments > self.sync_every:
            raise ValueError(
                f"bandwidth_sim.num_fragments={self.num_fragments} > bandwidth_sim.sync_every="
                f"{self.sync_every}: a fragment would be due more than once per window; use "
                "num_fragments <= sync_every"
            )
        return self
