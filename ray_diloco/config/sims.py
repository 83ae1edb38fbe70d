"""The simulators' sections: `goodput_sim` (`ray-diloco simulate-goodput`) and
`bandwidth_sim` (`ray-diloco simulate-bandwidth`). They describe a simulated fleet, not the run."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ray_diloco.config.base import WireDtype, _Frozen


class GoodputSimConfig(_Frozen):
    """Goodput simulation at scale (docs/algorithm.md section 10; `ray-diloco simulate-goodput`).

    The defaults are calibrated: each cost is set from what is published or standard for a
    large TPU job with hot spares and in-memory checkpoints (the reasons are in the field
    descriptions), once for the whole sweep (150k to 2.4M chips, M = 2 to 16), and with them
    the sweep lands within 3 points of the published 1.2M-chip anchors (data-parallel 27%,
    elastic data-parallel 58%, 8 learners 88%). `PRESETS["slow-repair"]` in
    `sim/goodput_sim.py` keeps the earlier, ten times harsher settings.
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
        description="until a hot spare stands in for a failed slice: the optical circuit "
        "switch reconfigures cubes into a new torus in ~10 s, with spare cubes kept in every "
        "superpod for hot standbys (Gemini report, 2023)",
    )
    recovery_sigma: float = Field(
        0.5,
        gt=0,
        description="lognormal shape / pareto tail index; 0.5: a scripted swap from a spare "
        "pool varies less than repairs (sigma ~1 and more)",
    )
    restart_cost_s: float = Field(
        50.0,
        ge=0,
        description="data-parallel restart once every slice is back: a re-mesh (20 s) plus "
        "every host restoring its state from a peer's in-memory copy (~30 s); with the swap, "
        "about a minute per failure, what the published 27% implies",
    )
    checkpoint_interval_s: float = Field(
        0.0,
        ge=0,
        description="data-parallel checkpoint period; 0: every step, in memory on peers "
        "(Gemini's redundant in-memory copies), so a failure loses only the step in flight, "
        "folded into restart_cost_s",
    )
    reconfig_pause_s: float = Field(
        20.0,
        ge=0,
        description="one elastic re-mesh (elastic data-parallel, or a learner taking a slice "
        "in or out): 'tens of seconds' as reported for Gemini",
    )
    learner_mode: Literal["spare", "shrink", "restart"] = Field(
        "spare",
        description="what a learner does when one of its slices fails. spare: pauses for the "
        "hot spare, re-meshes with it (reconfig_pause_s) and goes on with its state; shrink: "
        "re-meshes onto its healthy slices and goes on with fewer chips; restart: dies, "
        "comes back learner_restart_s after the slice, and loses its unmerged work",
    )
    learner_restart_s: float = Field(
        120.0, ge=0, description="learner_mode=restart: one learner rejoining"
    )
    round_period_s: float = Field(
        3600.0,
        gt=0,
        description="how often a learner offers its work to the RoundBook: its fragment rounds "
        "coalesced into one offer. The book costs tens of us of CPU per offer, so this sets "
        "the sweep's run time. A spare or shrink learner keeps its state through a pause, so "
        "the period sets the resolution of the rounds, not the goodput (120 s gives the same "
        "to 0.1 point, ~30x slower); a restart learner loses up to one period at each death",
    )
    straggler_cv: float = Field(0.05, ge=0, description="std/mean of a learner's round time")
    sync_time_s: float = Field(1.0, ge=0, description="virtual merge + publish time per round")
    quorum_min: int = Field(1, ge=1)
    uptime_window_s: float = Field(
        10.0,
        gt=0,
        description="uptime: the fraction of windows of this length in which the global model "
        "advanced (a data-parallel job kept training; for decoupled, quorum_min learners ran)",
    )
    duration_days: float = Field(30.0, gt=0)
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
