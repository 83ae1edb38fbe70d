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


class ConfigError(ValueError):
    """A configuration problem, with a message that names the field and the fix."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelConfig(_Frozen):
    """Decoder-only byte-level transformer (algorithm/model.py)."""

    vocab_size: int = Field(256, ge=2)
    d_model: int = Field(96, ge=8)
    num_layers: int = Field(4, ge=1)
    num_heads: int = Field(4, ge=1)
    d_ff: int = Field(384, ge=8)
    seq_len: int = Field(64, ge=4)
    tie_embeddings: bool = False

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.d_model % self.num_heads:
            raise ValueError(
                f"model.d_model={self.d_model} is not divisible by model.num_heads="
                f"{self.num_heads}; pick a head count that divides d_model"
            )
        return self

    @property
    def num_leaves(self) -> int:
        """Parameter leaves of algorithm/model.py: token and position embeddings, 8 per block
        (2 norms, q/k/v/o, up/down), the final norm and, unless tied, the output projection.
        A unit test pins this against the real model."""
        return 2 + 8 * self.num_layers + 1 + (0 if self.tie_embeddings else 1)


class DataConfig(_Frozen):
    """Byte-level corpus (algorithm/data.py). `paths` empty means: the Python stdlib source."""

    source: Literal["files", "synthetic"] = "files"
    paths: tuple[str, ...] = ()
    heldout_fraction: float = Field(0.02, gt=0.0, lt=0.5)
    max_corpus_bytes: int = Field(24_000_000, ge=10_000)
    eval_batches: int = Field(8, ge=1)
    eval_batch_size: int = Field(32, ge=1)


class InnerOptimizerConfig(_Frozen):
    """AdamW with linear warm-up and cosine decay to `final_lr_fraction * lr`."""

    lr: float = Field(3e-3, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    b1: float = Field(0.9, ge=0, lt=1)
    b2: float = Field(0.95, ge=0, lt=1)
    warmup_steps: int = Field(20, ge=0)
    final_lr_fraction: float = Field(0.1, ge=0, le=1)
    grad_clip_norm: float = Field(1.0, gt=0)


class OuterOptimizerConfig(_Frozen):
    """SGD with Nesterov momentum, one state per fragment (algorithm.md section 6)."""

    # lr 1.0 and a momentum warm-up measured best (README: the quality benchmark's sweep);
    # the DiLoCo paper's lr 0.7 / momentum 0.9 was tuned for H = 500 and full rounds.
    lr: float = Field(1.0, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    nesterov: bool = True
    # Momentum ramps linearly from 0 over this many outer steps of a fragment (0: none).
    momentum_warmup_steps: int = Field(10, ge=0)


Mode = Literal["decoupled", "synchronous", "data_parallel"]
WireDtype = Literal["float32", "bfloat16", "int8", "int4", "int2"]


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
    # "contributors" (default): only the learners whose contributions the round merged (one
    # version back per contribution, as in Streaming DiLoCo), so no learner's local progress on
    # a fragment is overwritten by rounds it took no part in, and fewer bytes move down; a
    # learner whose contribution is refused gets the newest version at once. Measured better
    # with round_step: share (README, "Where this departs from algorithm.md").
    publish_to: Literal["all", "contributors"] = "contributors"
    staleness_penalty: float = Field(0.0, ge=0)
    # Versions of a fragment a contribution's base may lag behind (fencing). With K = 1 and
    # publish_to: contributors a learner's base lags about M versions by construction.
    max_staleness_versions: int = Field(16, ge=0)
    # Outer gradient of a contribution. "current" (default, measured better): G_now - theta
    # (algorithm.md section 6). "base": the learner's own update, G_base - theta, so a
    # contribution based on an older version adds its work instead of pulling G toward theta.
    anchor: Literal["current", "base"] = "current"
    # Step size of a round. "full": every round takes a whole outer step. "share": a round
    # that merged a share s of a full round's tokens (every live learner's sync_every steps)
    # takes a fraction s of an outer step (outer.py), so K = 1 rounds do not add up.
    round_step: Literal["full", "share"] = "share"
    # Norm guard: a contribution whose own update per inner step exceeds norm_guard times the
    # median of the fragment's recent accepted ones (after the inner warm-up) is refused, once
    # norm_guard_min_samples of them are known (algorithm.md section 7).
    norm_guard: float = Field(10.0, gt=1)
    norm_guard_min_samples: int = Field(8, ge=1)
    wire_dtype: WireDtype = "int4"
    # Publications down: a float dtype sends new global values; a quantized one (int8, int4,
    # int2) sends each learner the difference to the value it holds, with error feedback, and
    # full values (in bfloat16, float32 if wire_dtype is) to a learner that holds nothing known
    # (algorithm/downstream.py). None: full values in bfloat16 (float32 if wire_dtype is).
    publish_dtype: WireDtype | None = "int4"
    int4_block_size: int = Field(64, ge=2, description="block of one scale, int4 and int2")


Accelerator = Literal["cpu", "tpu-v5p", "tpu-v6e", "gpu"]


class LearnerGroupConfig(_Frozen):
    """One learner: a group of hosts with its own batch size, placement and emulated speed."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    accelerator: Accelerator = "cpu"
    topology: str | None = None
    num_hosts: int = Field(1, ge=1)
    region: str = "local"
    batch_size: int = Field(32, description="sequences per inner step, whole learner")
    speed: float = Field(1.0, gt=0, description="emulated speed factor; 0.82 is 18% slower")
    jitter: float = Field(0.0, ge=0, lt=1, description="relative per-step time noise (std)")
    cpus_per_host: float = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _check(self) -> LearnerGroupConfig:
        if self.batch_size <= 0:
            raise ValueError(
                f"learner {self.name!r}: batch_size={self.batch_size} must be >= 1 sequence"
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


class SynchronizerConfig(_Frozen):
    name: str = "synchronizer"
    namespace: str = "ray_diloco"
    region: str = "local"
    checkpoint_every_rounds: int = Field(48, ge=1)
    heartbeat_timeout_s: float = Field(5.0, gt=0)
    step_time_ema: float = Field(0.2, gt=0, le=1)


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
    target: str | None = Field(None, description="learner name or region; None picks by seed")
    duration_s: float = Field(0.0, ge=0)
    factor: float = Field(1.0, gt=0, description="slowdown factor for straggler/slow_link")


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


class MetricsConfig(_Frozen):
    eval_every_s: float = Field(10.0, gt=0)
    log_every_s: float = Field(2.0, gt=0)
    export_ray_metrics: bool = True


class GoodputSimConfig(_Frozen):
    """Goodput simulation at scale (algorithm.md section 10; `ray-diloco simulate-goodput`).

    Recovery delays are heavy-tailed by default (lognormal): every distribution is set by its
    median, so switching `recovery` keeps the typical delay and changes only the tail.
    """

    chips: int = Field(1_200_000, ge=1)
    num_learners: int = Field(8, ge=1)
    chips_per_slice: int = Field(256, ge=1, description="the unit that fails and is replaced")
    mtbi_chip_days: float = Field(365.0, gt=0, description="mean time between interruptions")
    recovery: Literal["lognormal", "exponential", "pareto"] = "lognormal"
    # Default: a failed slice is swapped for a hot spare (median 60 s, heavy tail). With repair
    # in place (median ~15 min) every system spends most of its time down at >= 150k chips.
    recovery_median_s: float = Field(60.0, gt=0)
    recovery_sigma: float = Field(1.0, gt=0, description="lognormal shape / pareto tail index")
    restart_cost_s: float = Field(600.0, ge=0, description="data-parallel restart from checkpoint")
    checkpoint_interval_s: float = Field(
        600.0, ge=0, description="data-parallel checkpoint period; 0: no work lost on a failure"
    )
    reconfig_pause_s: float = Field(120.0, ge=0, description="elastic data-parallel re-mesh")
    learner_restart_s: float = Field(120.0, ge=0, description="one learner rejoining")
    round_period_s: float = Field(120.0, gt=0, description="time between two syncs of a fragment")
    straggler_cv: float = Field(0.05, ge=0, description="std/mean of a learner's round time")
    sync_time_s: float = Field(1.0, ge=0, description="virtual merge + publish time per round")
    quorum_min: int = Field(1, ge=1)
    uptime_window_s: float | None = Field(
        None, gt=0, description="uptime counts windows of this length; None: 2 x round_period_s"
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

    @property
    def uptime_window(self) -> float:
        return self.uptime_window_s if self.uptime_window_s is not None else 2 * self.round_period_s


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
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    inner: InnerOptimizerConfig = InnerOptimizerConfig()
    outer: OuterOptimizerConfig = OuterOptimizerConfig()
    diloco: DilocoConfig = DilocoConfig()
    learners: tuple[LearnerGroupConfig, ...] = Field(
        default_factory=lambda: tuple(LearnerGroupConfig(name=f"learner-{i}") for i in range(4))
    )
    links: dict[str, LinkConfig] = Field(default_factory=dict)
    synchronizer: SynchronizerConfig = SynchronizerConfig()
    supervisor: SupervisorConfig = SupervisorConfig()
    chaos: ChaosConfig = ChaosConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    metrics: MetricsConfig = MetricsConfig()
    goodput_sim: GoodputSimConfig = GoodputSimConfig()

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
        if d.num_fragments > self.model.num_leaves:
            raise ValueError(
                f"diloco.num_fragments={d.num_fragments} exceeds the model's "
                f"{self.model.num_leaves} parameter leaves (a leaf is never split); lower "
                "diloco.num_fragments or raise model.num_layers"
            )
        if d.overlap_steps >= d.sync_every:
            raise ValueError(
                f"diloco.overlap_steps={d.overlap_steps} must be < diloco.sync_every="
                f"{d.sync_every} so a fragment returns before it is due again"
            )
        for region in self.links:
            if region not in {lg.region for lg in self.learners}:
                raise ValueError(
                    f"links.{region}: no learner is in region {region!r}; "
                    f"known regions: {sorted({lg.region for lg in self.learners})}"
                )
        return self

    @property
    def num_learners(self) -> int:
        return len(self.learners)

    @property
    def tokens_per_step(self) -> dict[str, int]:
        return {lg.name: lg.batch_size * self.model.seq_len for lg in self.learners}


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


def _format_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid configuration ({source}):"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key; check the spelling against ray_diloco/config.py"
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def build_config(tree: dict[str, Any], source: str = "<dict>") -> RunConfig:
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_error(err, source)) from None


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
    if overrides and "learners" not in tree and any(o.startswith("learners.") for o in overrides):
        tree["learners"] = [lg.model_dump() for lg in RunConfig().learners]
    for o in overrides:
        _set_dotted(tree, o)
    return build_config(tree, source)


def dump_config(cfg: RunConfig, path: Path) -> None:
    """Write the validated config as JSON (run_dir/config.json)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg.model_dump(mode="json"), indent=2, sort_keys=True))
