"""Top level: the run's configuration, one frozen pydantic tree validated once at the boundary.

Every component receives only its own sub-config. YAML files in `jobs/` are loaded with
`load_config(path, overrides)`, where overrides are dotted `a.b=c` strings (values parsed as
YAML scalars). Errors name the field and the fix; nothing here imports jax or ray.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ray_diloco.cluster import slices


class ConfigError(ValueError):
    """A configuration problem, with a message that names the field and the fix."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class InnerOptimizerConfig(_Frozen):
    """The default inner optimizer (a task may bring its own): AdamW with linear warm-up and
    cosine decay to `final_lr_fraction * lr`."""

    lr: float = Field(3e-3, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    b1: float = Field(0.9, ge=0, lt=1)
    b2: float = Field(0.95, ge=0, lt=1)
    warmup_steps: int = Field(20, ge=0)
    final_lr_fraction: float = Field(0.1, ge=0, le=1)
    grad_clip_norm: float = Field(1.0, gt=0)


class OuterOptimizerConfig(_Frozen):
    """SGD with Nesterov momentum, one state per fragment (algorithm.md section 6)."""

    lr: float = Field(0.7, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    nesterov: bool = True


Mode = Literal["decoupled", "synchronous", "data_parallel"]
WireDtype = Literal["float32", "bfloat16", "int8", "int4"]


class DilocoConfig(_Frozen):
    """The method's knobs; names follow algorithm.md."""

    mode: Mode = "decoupled"
    sync_every: int = Field(24, ge=1, description="H: inner steps between two syncs of a fragment")
    num_fragments: int = Field(24, ge=1, description="P")
    overlap_steps: int = Field(2, ge=0, description="tau")
    quorum_min: int = Field(1, ge=1, description="K")
    grace_fraction: float = Field(0.5, ge=0, lt=1, description="gamma")
    grace_max_s: float = Field(5.0, ge=0)
    merge: Literal["rda", "mean"] = "rda"
    mixing_alpha: float = Field(0.0, ge=0, lt=1)
    late_policy: Literal["next_round", "drop"] = "next_round"
    # Who receives a merged fragment. "all": every live learner (algorithm.md section 5).
    # "contributors": only the learners whose contributions the round merged (one version back
    # per contribution, as in Streaming DiLoCo), so no learner's local progress on a fragment
    # is overwritten by rounds it took no part in, and fewer bytes move down; a learner whose
    # contribution is refused gets the newest version at once. Measured better with a grace
    # window but far worse with K = 1 and no grace (learners' bases go stale, and deltas are
    # anchored at the current global value): see the README's quality table.
    publish_to: Literal["all", "contributors"] = "all"
    staleness_penalty: float = Field(0.0, ge=0)
    max_staleness_versions: int = Field(4, ge=0)
    norm_guard: float = Field(10.0, gt=1)
    norm_guard_warmup_rounds: int = Field(5, ge=0)
    wire_dtype: WireDtype = "bfloat16"
    int4_block_size: int = Field(64, ge=2)


Accelerator = Literal["cpu", "tpu-v5p", "tpu-v6e", "gpu"]


class LearnerGroupConfig(_Frozen):
    """One learner: a group of hosts with its own batch size, placement and emulated speed."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    accelerator: Accelerator = "cpu"
    topology: str | None = None
    num_hosts: int = Field(1, ge=1)
    region: str = "local"
    batch_size: int = Field(32, description="examples per inner step, whole learner")
    speed: float = Field(1.0, gt=0, description="emulated speed factor; 0.82 is 18% slower")
    jitter: float = Field(0.0, ge=0, lt=1, description="relative per-step time noise (std)")
    cpus_per_host: float = Field(1.0, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _tpu_hosts(cls, data: Any) -> Any:
        """A TPU learner's hosts come from its slice shape (cluster/slices.py): `num_hosts`
        may be left out when the topology has one shape, and must be given (and fit) when
        it has two (v6e 2x4: one 8-chip host or two 4-chip hosts)."""
        if not isinstance(data, dict):
            return data
        accel, topology = data.get("accelerator"), data.get("topology")
        if not (isinstance(accel, str) and accel.startswith("tpu") and isinstance(topology, str)):
            return data
        hosts = data.get("num_hosts")
        try:
            shape = slices.resolve(accel, topology, hosts if isinstance(hosts, int) else None)
        except slices.UnknownShape as err:
            raise ValueError(f"learner {data.get('name')!r}: {err}") from None
        return {**data, "topology": shape.topology, "num_hosts": shape.num_hosts}

    @property
    def slice_shape(self) -> slices.SliceShape | None:
        """The TPU slice this learner runs on (None for CPU and GPU learners)."""
        if not self.accelerator.startswith("tpu") or self.topology is None:
            return None
        return slices.resolve(self.accelerator, self.topology, self.num_hosts)

    @model_validator(mode="after")
    def _check(self) -> LearnerGroupConfig:
        if self.batch_size <= 0:
            raise ValueError(
                f"learner {self.name!r}: batch_size={self.batch_size} must be >= 1 example"
            )
        if self.accelerator.startswith("tpu") and not self.topology:
            raise ValueError(
                f"learner {self.name!r}: accelerator {self.accelerator} needs a topology "
                "such as '2x2x2' (v5p) or '2x4' (v6e)"
            )
        if self.batch_size % self.num_hosts:
            raise ValueError(
                f"learner {self.name!r}: batch_size={self.batch_size} must divide evenly "
                f"over num_hosts={self.num_hosts}"
            )
        return self


class LinkConfig(_Frozen):
    """Emulated WAN link between a region and the synchronizer's region."""

    bandwidth_gbps: float = Field(gt=0)
    latency_ms: float = Field(0.0, ge=0)


class ShardPlacement(_Frozen):
    """Where the synchronizer's shards run, to spread them over CPU nodes of a real cluster:
    each shard asks for `num_cpus` and the custom `resources`, on a node whose labels include
    `labels`; with any of them set the shards are spread over the matching nodes instead of
    pinned to the head (or `synchronizer.region`)."""

    num_cpus: float = Field(0.0, ge=0)
    resources: dict[str, float] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)

    @property
    def pinned(self) -> bool:
        return bool(self.num_cpus or self.resources or self.labels)


class ClusterConfig(_Frozen):
    """The real cluster a job runs on, for `ray-diloco plan` (training itself ignores it)."""

    files: tuple[str, ...] = Field(
        (), description="cluster files: `ray up` YAMLs or KubeRay manifests, relative to cwd"
    )
    # The real network between a region and the synchronizer's region, as you expect it: the
    # plan checks each region's traffic against it. Unlike `links` nothing is emulated.
    links: dict[str, LinkConfig] = Field(default_factory=dict)


class SynchronizerConfig(_Frozen):
    name: str = "synchronizer"
    namespace: str = "ray_diloco"
    region: str = Field("local", description="the head's region (the synchronizer runs there)")
    checkpoint_every_rounds: int = Field(48, ge=1)
    heartbeat_timeout_s: float = Field(5.0, gt=0)
    step_time_ema: float = Field(0.2, gt=0, le=1)
    num_shards: int = Field(
        1, ge=1, description="detached actors the fragments are split over, by balanced bytes"
    )
    placement: ShardPlacement = ShardPlacement()
    max_offers_in_flight: int = Field(
        4,
        ge=1,
        description="offers a learner has sent to one shard and not seen answered; beyond it a "
        "newer offer of a fragment replaces the unsent one (its work is merged with it) and "
        "others wait, so a slow synchronizer never makes a learner wait or hold more",
    )


class SupervisorConfig(_Frozen):
    heartbeat_timeout_s: float = Field(2.0, gt=0)
    startup_timeout_s: float = Field(60.0, gt=0, description="a new incarnation's first answer")
    poll_interval_s: float = Field(0.25, gt=0)
    restart_backoff_s: float = Field(0.5, ge=0)
    restart_backoff_max_s: float = Field(10.0, ge=0)
    max_crash_restarts: int = Field(5, ge=0)
    max_preemption_restarts: int = Field(20, ge=0)


FaultKind = Literal[
    "kill_host",
    "kill_group",
    "remove_node",
    "hang_host",
    "straggler",
    "cut_link",
    "slow_link",
    "corrupt_nan",
    "corrupt_norm",
    "kill_synchronizer",
]


class ScheduledFault(_Frozen):
    at_s: float = Field(ge=0)
    kind: FaultKind
    target: str | None = Field(
        None, description="learner name, region or synchronizer shard; None picks by seed"
    )
    duration_s: float = Field(0.0, ge=0)
    factor: float = Field(1.0, gt=0, description="slowdown factor for straggler/slow_link")
    during_checkpoint: bool = Field(
        False,
        description="kill_synchronizer only: start a checkpoint write and kill while it runs",
    )

    @model_validator(mode="after")
    def _checkpoint_kill(self) -> ScheduledFault:
        if self.during_checkpoint and self.kind != "kill_synchronizer":
            raise ValueError(
                f"during_checkpoint applies to kill_synchronizer only, not {self.kind}; remove it"
            )
        return self


class ChaosConfig(_Frozen):
    enabled: bool = False
    seed: int = 0
    mtbf_s: float | None = Field(None, gt=0, description="mean time between failures per learner")
    kinds: tuple[FaultKind, ...] = ("kill_host",)
    schedule: tuple[ScheduledFault, ...] = ()
    fault_duration_s: float = Field(3.0, ge=0)
    # Failure costs the in-process reference run charges (a Ray run measures them instead).
    restart_s: float = Field(1.0, ge=0, description="detection + restart + compile, virtual s")
    dp_checkpoint_every_steps: int = Field(50, ge=1, description="data-parallel checkpoints")


class CheckpointConfig(_Frozen):
    enabled: bool = True
    keep: int = Field(2, ge=1)


class MembershipChange(_Frozen):
    """A learner joining (`join`: its group config) or leaving (`leave`: its name) at `at_s`
    seconds of the run: the reference run and the supervisor both carry it out."""

    at_s: float = Field(ge=0)
    join: LearnerGroupConfig | None = None
    leave: str | None = None

    @model_validator(mode="after")
    def _one(self) -> MembershipChange:
        if (self.join is None) == (self.leave is None):
            raise ValueError("a membership change needs exactly one of join: {...} or leave: NAME")
        return self


class ElasticConfig(_Frozen):
    """Learners joining and leaving a running job, and the data leases that follow them
    (algorithm/leases.py)."""

    lease_tokens: int = Field(
        65_536, ge=1, description="tokens of the task's data in one lease (a learner's read-ahead)"
    )
    lease_ahead: int = Field(2, ge=1, description="leases a learner holds beyond its cursor")
    data_parts: int | None = Field(
        None, ge=1, description="parts the data is cut into; None: the configured learners'"
    )
    min_learners: int = Field(
        1, ge=1, description="a learner out of restarts leaves while more than this remain"
    )
    max_learners: int = Field(64, ge=1, description="never more learners than this")
    scavenge: bool = Field(
        False, description="start a learner from `templates` on every free node that fits one"
    )
    templates: tuple[LearnerGroupConfig, ...] = ()
    scavenge_interval_s: float = Field(2.0, gt=0)
    schedule: tuple[MembershipChange, ...] = ()
    # The reference run's data-parallel baseline re-meshes on every membership change (new
    # collectives, a recompiled step): Gemini reports tens of seconds per elastic
    # reconfiguration; 30 inner steps is that at a one-second step.
    remesh_steps: int = Field(30, ge=0, description="data-parallel pause per change, in steps")


class MetricsConfig(_Frozen):
    eval_every_s: float = Field(10.0, gt=0)
    log_every_s: float = Field(2.0, gt=0)
    export_ray_metrics: bool = True


class GoodputSimConfig(_Frozen):
    """Goodput simulation at scale (algorithm.md section 10; `ray-diloco simulate-goodput`).

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
    (algorithm.md section 9; `ray-diloco simulate-bandwidth`). The defaults are this
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
        None,
        description="published fragments; None: what the synchronizer publishes for wire_up "
        "(wire.publish_dtype: bfloat16 unless the wire is float32)",
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


class RunConfig(_Frozen):
    """The whole run."""

    name: str = "run"
    seed: int = 0
    run_dir: str = "runs/latest"
    token_budget: int = Field(2_000_000, ge=1)
    step_time_s: float = Field(0.05, gt=0, description="virtual inner-step time in simulate")
    # How a Ray learner emulates its speed. "compute": a step lasts its measured compute time
    # / speed (heterogeneity relative to this machine). "step_time": it lasts step_time_s /
    # speed, as on the reference run's virtual clock (or its compute time, if longer), so a
    # run takes the same wall time on any machine fast enough (the chaos tests rely on it).
    pace: Literal["compute", "step_time"] = "compute"
    sync_time_s: float = Field(0.01, ge=0, description="virtual merge+publish time in simulate")
    # What gets trained (ray_diloco/task.py): a factory named by import path, called with
    # `task_args` as keyword arguments. The default is the built-in byte-level language model
    # on the Python standard library's source (no download).
    task: str = "ray_diloco.tasks.byte_lm:make_task"
    task_args: dict[str, Any] = Field(default_factory=dict)
    inner: InnerOptimizerConfig = InnerOptimizerConfig()
    outer: OuterOptimizerConfig = OuterOptimizerConfig()
    diloco: DilocoConfig = DilocoConfig()
    learners: tuple[LearnerGroupConfig, ...] = Field(
        default_factory=lambda: tuple(LearnerGroupConfig(name=f"learner-{i}") for i in range(4))
    )
    links: dict[str, LinkConfig] = Field(default_factory=dict)
    cluster: ClusterConfig = ClusterConfig()
    synchronizer: SynchronizerConfig = SynchronizerConfig()
    supervisor: SupervisorConfig = SupervisorConfig()
    chaos: ChaosConfig = ChaosConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    elastic: ElasticConfig = ElasticConfig()
    metrics: MetricsConfig = MetricsConfig()
    goodput_sim: GoodputSimConfig = GoodputSimConfig()
    bandwidth_sim: BandwidthSimConfig = BandwidthSimConfig()

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        names = [lg.name for lg in self.learners]
        if not names:
            raise ValueError("learners: at least one learner group is needed")
        if len(set(names)) != len(names):
            raise ValueError(f"learners: names must be unique, got {names}")
        d = self.diloco
        if d.quorum_min > len(names):
            raise ValueError(
                f"diloco.quorum_min={d.quorum_min} exceeds the {len(names)} learners; "
                f"set diloco.quorum_min <= {len(names)}"
            )
        if d.num_fragments > d.sync_every:
            raise ValueError(
                f"diloco.num_fragments={d.num_fragments} > diloco.sync_every={d.sync_every}: "
                "a fragment would be due more than once per window; use num_fragments <= sync_every"
            )
        if d.overlap_steps >= d.sync_every:
            raise ValueError(
                f"diloco.overlap_steps={d.overlap_steps} must be < diloco.sync_every="
                f"{d.sync_every} so a fragment returns before it is due again"
            )
        known = set(names)
        for change in sorted(self.elastic.schedule, key=lambda c: c.at_s):
            if change.join is not None:
                if change.join.name in known:
                    raise ValueError(
                        f"elastic.schedule: learner {change.join.name!r} joins at "
                        f"{change.at_s}s but that name is taken; give it a new name"
                    )
                known.add(change.join.name)
            elif change.leave not in known:
                raise ValueError(
                    f"elastic.schedule: {change.leave!r} leaves at {change.at_s}s but no learner "
                    f"of that name is in the run by then; known: {sorted(known)}"
                )
        if len(known) > self.elastic.max_learners:
            raise ValueError(
                f"elastic.max_learners={self.elastic.max_learners} is below the "
                f"{len(known)} learners the config names; raise it"
            )
        shards = self.synchronizer.num_shards
        if shards > d.num_fragments:
            raise ValueError(
                f"synchronizer.num_shards={shards} exceeds diloco.num_fragments="
                f"{d.num_fragments}: every shard owns at least one fragment; lower num_shards"
            )
        shard_names = (None, *(str(i) for i in range(shards)))
        for fault in self.chaos.schedule:
            if fault.kind == "kill_synchronizer" and fault.target not in shard_names:
                raise ValueError(
                    f"chaos.schedule: kill_synchronizer target {fault.target!r} is not a shard; "
                    f"use a shard index 0..{shards - 1} or leave it empty (shard 0)"
                )
        joiners = [c.join for c in self.elastic.schedule if c.join is not None]
        everyone = (*self.learners, *joiners, *self.elastic.templates)
        regions = sorted({lg.region for lg in everyone})
        for section, table in (("links", self.links), ("cluster.links", self.cluster.links)):
            for region in table:
                if region not in regions:
                    raise ValueError(
                        f"{section}.{region}: no learner is in region {region!r}; "
                        f"known regions: {regions}"
                    )
        for region in self.links.keys() & self.cluster.links.keys():
            raise ValueError(
                f"links.{region} emulates a WAN on top of the network and cluster.links."
                f"{region} declares the real one; keep one of them"
            )
        return self

    @property
    def num_learners(self) -> int:
        return len(self.learners)

    @property
    def data_parts(self) -> int:
        """Parts the task's data is cut into: by default one per configured learner, which
        then reads its own part (a run whose learners never change reads fixed shards)."""
        return self.elastic.data_parts or self.num_learners


def _set_dotted(tree: dict[str, Any], dotted: str) -> None:
    if "=" not in dotted:
        raise ConfigError(f"--set {dotted!r}: expected key.path=value, e.g. diloco.quorum_min=2")
    key, raw = dotted.split("=", 1)
    parts = key.strip().split(".")
    node: Any = tree
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"--set {key}: {'.'.join(parts[: i + 1])} is not a list index")
            node = node[int(part)]
            continue
        node = node.setdefault(part, {})
        if not isinstance(node, dict | list):
            raise ConfigError(f"--set {key}: {'.'.join(parts[: i + 1])} is not a section")
    value = yaml.safe_load(raw)
    if isinstance(node, list):
        node[int(parts[-1])] = value
    else:
        node[parts[-1]] = value


def format_validation_error(err: ValidationError, source: str, prefix: str = "") -> str:
    """One line per problem, each naming the dotted field (after `prefix`) and the fix."""
    lines = [f"invalid configuration ({source}):"]
    for e in err.errors():
        loc = prefix + ".".join(str(p) for p in e["loc"]) if e["loc"] else "<root>"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key; check the spelling against the schema"
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def build_config(tree: dict[str, Any], source: str = "<dict>") -> RunConfig:
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source)) from None


def load_config(path: str | Path | None, overrides: tuple[str, ...] | list[str] = ()) -> RunConfig:
    """Load a YAML config (or the defaults when `path` is None) and apply dotted overrides."""
    tree: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} not found; pass --config jobs/local.yaml")
        loaded = yaml.safe_load(p.read_text())
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{p}: top level must be a mapping of sections")
        tree = loaded or {}
        source = str(p)
    apply_overrides(tree, overrides)
    return build_config(tree, source)


def apply_overrides(tree: dict[str, Any], overrides: tuple[str, ...] | list[str]) -> None:
    """Apply dotted `key.path=value` overrides to a config tree (in place)."""
    if overrides and "learners" not in tree and any(o.startswith("learners.") for o in overrides):
        tree["learners"] = [lg.model_dump() for lg in RunConfig().learners]
    for o in overrides:
        _set_dotted(tree, o)


def dump_config(cfg: RunConfig, path: Path) -> None:
    """Write the validated config as JSON (run_dir/config.json)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg.model_dump(mode="json"), indent=2, sort_keys=True))
