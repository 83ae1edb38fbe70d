"""The run's sections and the whole run (`RunConfig`): one frozen pydantic tree validated once
at the boundary. Every component receives only its own sub-config."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from ray_diloco.config import slices
from ray_diloco.config.base import _Frozen
from ray_diloco.config.chaos import ChaosConfig
from ray_diloco.config.diloco import DilocoConfig
from ray_diloco.config.mesh import MeshConfig
from ray_diloco.config.metrics import MetricsConfig
from ray_diloco.config.sims import BandwidthSimConfig, GoodputSimConfig


class InnerOptimizerConfig(_Frozen):
    """The default inner optimizer (a task may bring its own): AdamW with linear warm-up and
    cosine decay to `final_lr_fraction * lr`. `decay_tokens`: the tokens the schedule decays
    over (held at its end afterwards); default the token budget. Set it when the budget may
    grow past the planned run (a run resumed with a larger budget, an open-ended chaos run)."""

    lr: float = Field(3e-3, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    b1: float = Field(0.9, ge=0, lt=1)
    b2: float = Field(0.95, ge=0, lt=1)
    warmup_steps: int = Field(20, ge=0)
    final_lr_fraction: float = Field(0.1, ge=0, le=1)
    grad_clip_norm: float = Field(1.0, gt=0)
    decay_tokens: int | None = Field(None, ge=1)


class OuterOptimizerConfig(_Frozen):
    """SGD with Nesterov momentum, one state per fragment (docs/algorithm.md section 6)."""

    lr: float = Field(0.7, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    nesterov: bool = True
    warmup_rounds: int = Field(
        0,
        ge=0,
        description="outer lr ramps linearly over each fragment's first rounds (0: none)",
    )


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
    devices_per_host: int | None = Field(
        None,
        ge=1,
        description="JAX devices a host trains on; default a TPU slice's chips per host, else 1 "
        "(CPU hosts get that many emulated devices)",
    )
    mesh: MeshConfig = MeshConfig()

    @model_validator(mode="before")
    @classmethod
    def _tpu_hosts(cls, data: Any) -> Any:
        """A TPU learner's hosts come from its slice shape (config/slices.py): `num_hosts`
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
    def host_devices(self) -> int:
        """JAX devices on each host of this learner."""
        if self.devices_per_host is not None:
            return self.devices_per_host
        shape = self.slice_shape
        return shape.chips_per_host if shape is not None else 1

    @property
    def num_devices(self) -> int:
        """Devices of the learner's mesh: every device of every host."""
        return self.num_hosts * self.host_devices

    @property
    def mesh_sizes(self) -> dict[str, int]:
        return self.mesh.sizes(self.num_devices)

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
        shape = self.slice_shape
        if shape is not None and self.host_devices != shape.chips_per_host:
            raise ValueError(
                f"learner {self.name!r}: devices_per_host={self.devices_per_host} but a "
                f"{shape.pod_type} host has {shape.chips_per_host} chips; leave it out"
            )
        try:
            sizes = self.mesh_sizes
        except ValueError as err:
            raise ValueError(f"learner {self.name!r}: {err}") from None
        split = sizes["data"] * sizes["fsdp"]
        if self.batch_size % split:
            raise ValueError(
                f"learner {self.name!r}: batch_size={self.batch_size} must divide over the "
                f"mesh's data x fsdp = {split} devices; make it a multiple of {split}"
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
        description="unanswered offers per learner and shard; past it a newer offer of a "
        "fragment replaces the unsent one and carries its work",
    )


class SupervisorConfig(_Frozen):
    """Failure detection adapts to load (control/detector.py): a learner host or a
    synchronizer shard is hung when silent for `heartbeat_timeout_factor` times the 99th
    percentile of its recent gaps between answers, at least `heartbeat_timeout_s` and at most
    `heartbeat_timeout_max_s`; a new incarnation gets `startup_timeout_factor` times the
    longest boot seen in the run, at least `startup_timeout_s`."""

    heartbeat_timeout_s: float = Field(2.0, gt=0, description="the floor: an idle machine's")
    heartbeat_timeout_factor: float = Field(3.0, ge=1)
    heartbeat_timeout_max_s: float = Field(30.0, gt=0, description="a hang is found by then")
    startup_timeout_s: float = Field(60.0, gt=0, description="a new incarnation's first answer")
    startup_timeout_factor: float = Field(2.0, ge=1)
    poll_interval_s: float = Field(0.25, gt=0)
    restart_backoff_s: float = Field(0.5, ge=0)
    restart_backoff_max_s: float = Field(10.0, ge=0)
    max_crash_restarts: int = Field(5, ge=0)
    max_preemption_restarts: int = Field(20, ge=0)

    @model_validator(mode="after")
    def _check(self) -> SupervisorConfig:
        if self.heartbeat_timeout_max_s < self.heartbeat_timeout_s:
            raise ValueError(
                f"supervisor.heartbeat_timeout_max_s={self.heartbeat_timeout_max_s} is below "
                f"supervisor.heartbeat_timeout_s={self.heartbeat_timeout_s}; raise it"
            )
        return self


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
        if d.schedule == "pull" and d.mode != "decoupled":
            raise ValueError(
                f"diloco.schedule=pull needs diloco.mode=decoupled, not {d.mode!r}: a "
                "synchronous learner blocks on the fragments it offers on its own count"
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
