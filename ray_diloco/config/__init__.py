"""Layer: config (pydantic only). The run's configuration, one frozen pydantic tree validated once
at the boundary.

Every component receives only its own sub-config. YAML files in `jobs/` are loaded with
`load_config(path, overrides)`, where overrides are dotted `a.b=c` strings (values parsed as
YAML scalars). Errors name the field and the fix; nothing here imports jax or ray.

`base.py` (the error, the frozen model), `schema.py` (the run's sections and `RunConfig`),
`chaos.py` (fault injection), `metrics.py` (what a run exports), `mesh.py` (a learner's mesh),
`sims.py` (the simulators' sections), `files.py` (YAML, overrides, error lines, the dump).
"""

from ray_diloco.config.base import ConfigError, WireDtype
from ray_diloco.config.chaos import ChaosConfig, FaultKind, ScheduledFault
from ray_diloco.config.diloco import DilocoConfig, Mode
from ray_diloco.config.files import (
    add_config_args,
    apply_overrides,
    build_config,
    check_output_dir,
    config_digest,
    dump_config,
    format_validation_error,
    load_config,
    parse_yaml,
    whole_number,
)
from ray_diloco.config.metrics import MetricsConfig, WandbConfig
from ray_diloco.config.schema import (
    Accelerator,
    CheckpointConfig,
    ClusterConfig,
    ElasticConfig,
    InnerOptimizerConfig,
    LearnerGroupConfig,
    LinkConfig,
    MembershipChange,
    MeshConfig,
    OuterOptimizerConfig,
    RunConfig,
    SupervisorConfig,
    SynchronizerConfig,
)
from ray_diloco.config.sims import BandwidthSimConfig, GoodputSimConfig

__all__ = [
    "Accelerator",
    "BandwidthSimConfig",
    "ChaosConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "ConfigError",
    "DilocoConfig",
    "ElasticConfig",
    "FaultKind",
    "GoodputSimConfig",
    "InnerOptimizerConfig",
    "LearnerGroupConfig",
    "LinkConfig",
    "MembershipChange",
    "MeshConfig",
    "MetricsConfig",
    "Mode",
    "OuterOptimizerConfig",
    "RunConfig",
    "ScheduledFault",
    "SupervisorConfig",
    "SynchronizerConfig",
    "WandbConfig",
    "WireDtype",
    "add_config_args",
    "apply_overrides",
    "build_config",
    "check_output_dir",
    "config_digest",
    "dump_config",
    "format_validation_error",
    "load_config",
    "parse_yaml",
    "whole_number",
]
