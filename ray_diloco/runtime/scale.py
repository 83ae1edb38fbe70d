"""Layer: runtime (Ray shell). What `ray-diloco scale RUN_DIR` does (its parser:
cli/scale.py): learners join and leave a running job.

The run dir's config.json names the run's supervisor; the command connects to the cluster
(`--address`, else RAY_ADDRESS, else the newest Ray on this machine, which is where an
embedded local run lives) and asks the supervisor, which carries the change out on its
control loop: a new learner starts from the newest global fragments and reads data from the
pool; a leaving one offers its unsent work first and gives its unread data back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ray_diloco.config import ConfigError, build_config, parse_yaml
from ray_diloco.control.protocol import SupervisorStatus


def parse_spec(text: str) -> dict[str, Any]:
    """'name=eu-2,region=eu-west,batch_size=32' -> a learner dict (values read as YAML)."""
    spec: dict[str, Any] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(
                f"--add {text!r}: expected key=value pairs separated by commas, e.g. "
                "'name=eu-2,region=eu-west,batch_size=32'"
            )
        spec[key.strip()] = parse_yaml(value, f"--add {key.strip()}")
    if "name" not in spec:
        raise ConfigError(f"--add {text!r}: the learner needs a name=...")
    return spec


def scale(run_dir: str, add: list[str], remove: list[str], show: bool, address: str | None) -> int:
    """Add the learners of the `add` specs, remove the `remove` names, then print the learners
    and their states when `show` or when nothing was asked."""
    config = Path(run_dir) / "config.json"
    if not config.is_file():
        raise ConfigError(f"{config} not found; give the run_dir of a running job")
    try:
        cfg = build_config(json.loads(config.read_text()), str(config))
    except json.JSONDecodeError as err:
        raise ConfigError(f"{config}: not a run config ({err})") from None
    specs = [parse_spec(s) for s in add]
    import ray

    from ray_diloco.runtime.connect import connect
    from ray_diloco.runtime.supervisor.actor import supervisor_name

    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    connect(address, cfg.synchronizer.namespace, log_to_driver=False)
    name = supervisor_name(cfg)
    try:
        sup: Any = ray.get_actor(name, namespace=cfg.synchronizer.namespace)
    except ValueError:
        raise ConfigError(
            f"{run_dir}: no running job (its supervisor {name!r} is not in namespace "
            f"{cfg.synchronizer.namespace!r} at {address})"
        ) from None
    try:
        for spec in specs:
            joined: str = ray.get(sup.add_learner.remote(spec), timeout=60)
            print(f"learner {joined} joins the run")
        for learner in remove:
            ray.get(sup.remove_learner.remote(learner), timeout=60)
            print(f"learner {learner} leaves the run (gracefully)")
    except ray.exceptions.RayTaskError as err:
        raise ConfigError(str(err.cause) if err.cause else str(err)) from None
    if show or not (specs or remove):
        status: SupervisorStatus = ray.get(sup.status.remote(), timeout=60)
        for learner, row in sorted(status.learners.items()):
            print(f"{learner:16s} {row.state.value:10s} incarnation {row.incarnation}")
    return 0
