"""Layer: runtime (Ray shell). Where learner groups and the synchronizer run.

`reserve_learner_group` turns one `LearnerGroupConfig` into a ready placement group with one
bundle per host: a plain `ray.util.placement_group` for CPU/GPU learners, a
`ray.util.tpu.SlicePlacementGroup` (one whole slice, gang-scheduled) for TPU learners. Region
pinning uses the node label `ray.io/availability-region` (set from `RAY_NODE_REGION` when a node
starts). `host_options` gives the `.options(...)` kwargs that put host actor *i* on bundle *i*;
for multi-host TPU slices bundle *i* is pinned to `ray.io/tpu-worker-id == i`, so the host index
is the slice's worker id (the JAX process id). Nothing here decides anything: the supervisor
calls these functions, and `release` undoes them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from ray.util.tpu import SlicePlacementGroup, get_tpu_worker_resources

from ray_diloco.config import LearnerGroupConfig
from ray_diloco.config.slices import SliceShape
from ray_diloco.runtime.errors import PlacementTimeoutError

logger = logging.getLogger(__name__)

LOCAL_REGION = "local"
REGION_LABEL = "ray.io/availability-region"
SLICE_LABEL = "ray.io/tpu-slice-name"
WORKER_ID_LABEL = "ray.io/tpu-worker-id"
TOPOLOGY_LABEL = "ray.io/tpu-topology"
# Ray 2.60 renices every worker process to 15 (`RAY_worker_niceness`) so that its own daemons
# stay responsive. For our actors that is the wrong trade: beside any process at the default
# priority a nice-15 process gets about 1/28 of its CPU share (CFS weights 36 vs 1024), so on a
# shared machine a learner booted 20x slower (boot 110-125 s and compile 70-80 s against 6 s and
# 4 s idle, 2 busy processes on 2 cores) and missed every startup timeout. The run's actors ask
# for niceness 0, as Ray's job manager does for the job driver it starts; Ray's daemons keep it.
ACTOR_ENV = {"RAY_worker_niceness": "0"}
ACCELERATOR_LABEL = "ray.io/accelerator-type"
HEAD_RESOURCE = "node:__internal_head__"
TPU_RESOURCE = "TPU"


@dataclass
class LearnerPlacement:
    """A learner group's reservation: the placement group and how to start a host on it."""

    learner: str
    accelerator: str
    region: str
    placement_group: PlacementGroup
    host_options_list: tuple[dict[str, Any], ...]
    bundle_resources: dict[str, float]
    slice_handle: SlicePlacementGroup | None = None  # TPU only; its shutdown() frees everything
    slice_name: str | None = None  # TPU only, when we chose the slice ourselves (region pin)
    released: bool = False

    @property
    def num_hosts(self) -> int:
        """Hosts actually reserved (for TPUs: the slice shape's hosts, which is `lg.num_hosts`)."""
        return len(self.host_options_list)


def reserve_learner_group(
    lg: LearnerGroupConfig,
    *,
    name_prefix: str = "",
    detached: bool = False,
    timeout_s: float = 60.0,
    emulated: bool = False,
) -> LearnerPlacement:
    """Reserve one bundle per host of learner `lg` and wait until all are placed.

    `detached=True` lets the placement group outlive the creating driver (named
    `<name_prefix>-<learner>`), so a restarted supervisor can find or remove it. `emulated`
    marks TPU hosts that are CPU stand-ins (tests, laptops): their actors get
    `JAX_PLATFORMS=cpu`. Raises `PlacementTimeoutError` naming what is missing when the
    group is not ready within `timeout_s`.
    """
    name = f"{name_prefix}-{lg.name}" if name_prefix else lg.name
    lifetime = "detached" if detached else None
    deadline = time.monotonic() + timeout_s
    logger.info("reserving learner %s (%s %s)", lg.name, lg.accelerator, lg.topology or "")
    if lg.slice_shape is not None:
        return _reserve_tpu(lg, lg.slice_shape, name, lifetime, deadline, timeout_s, emulated)
    return _reserve_plain(lg, name, lifetime, deadline, timeout_s)


def host_options(placement: LearnerPlacement, host_index: int) -> dict[str, Any]:
    """Kwargs for `HostActor.options(**host_options(p, i))`: bundle i, its CPUs/chips, env."""
    opts = dict(placement.host_options_list[host_index])
    if "resources" in opts:
        opts["resources"] = dict(opts["resources"])
    opts["runtime_env"] = {"env_vars": dict(opts["runtime_env"]["env_vars"])}
    return opts


def release(placement: LearnerPlacement) -> None:
    """Remove the group's placement group(s); safe to call twice or after Ray removed them.

    Ray kills actors still placed in a removed group (they fail with ActorDiedError)."""
    if placement.released:
        return
    placement.released = True
    try:
        if placement.slice_handle is not None:
            placement.slice_handle.shutdown()  # worker PG + any head PG, idempotent
        elif placement_state(placement) != "REMOVED":
            remove_placement_group(placement.placement_group)
    except Exception:  # a release must never mask the failure that caused it
        logger.warning("releasing placement of learner %s failed", placement.learner, exc_info=True)


def placement_state(placement: LearnerPlacement) -> str:
    """GCS state of the group's placement group: PENDING, CREATED, RESCHEDULING, REMOVED...

    RESCHEDULING means a host's node died and Ray waits for a replacement; UNKNOWN when the
    GCS could not be asked (Ray shut down).
    """
    try:
        table = placement_group_table(placement.placement_group)
    except Exception:
        logger.debug("placement_group_table failed for %s", placement.learner, exc_info=True)
        return "UNKNOWN"
    return str(table.get("state", "UNKNOWN"))


def actor_runtime_env(env: dict[str, str] | None = None) -> dict[str, Any]:
    """The `runtime_env` of every actor of a run: `ACTOR_ENV` plus `env`."""
    return {"env_vars": {**ACTOR_ENV, **(env or {})}}


def head_pin_options() -> dict[str, Any]:
    """Options that pin a (detached) actor to the head node, never onto a learner host."""
    return {"resources": {HEAD_RESOURCE: 0.001}}


def region_options(region: str) -> dict[str, Any]:
    """Options that place an actor (e.g. the synchronizer) in `region`; {} for "local"."""
    if region == LOCAL_REGION:
        return {}
    return {"label_selector": {REGION_LABEL: region}}


def _reserve_plain(
    lg: LearnerGroupConfig, name: str, lifetime: str | None, deadline: float, timeout_s: float
) -> LearnerPlacement:
    bundle = {"CPU": float(lg.cpus_per_host)}
    if lg.accelerator == "gpu":
        bundle["GPU"] = float(lg.host_devices)  # the host's mesh: every GPU it was given
    n = lg.num_hosts
    selector = [{REGION_LABEL: lg.region}] * n if lg.region != LOCAL_REGION else None
    pg = placement_group(
        [dict(bundle) for _ in range(n)],
        strategy="SPREAD" if n > 1 else "PACK",
        name=name,
        lifetime=lifetime,
        bundle_label_selector=selector,
    )
    if not _wait_ready(pg, lg.name, deadline):
        remove_placement_group(pg)  # a pending PG would grab resources later
        raise PlacementTimeoutError(_timeout_message(lg, timeout_s, n, bundle))
    env = {"JAX_PLATFORMS": "cpu"} if lg.accelerator == "cpu" else None
    opts = tuple(_options(pg, i, bundle, env) for i in range(n))
    return LearnerPlacement(lg.name, lg.accelerator, lg.region, pg, opts, bundle)


def _reserve_tpu(
    lg: LearnerGroupConfig,
    shape: SliceShape,
    name: str,
    lifetime: str | None,
    deadline: float,
    timeout_s: float,
    emulated: bool,
) -> LearnerPlacement:
    # The slice shape (config/slices.py) says how many hosts of how many chips; Ray computes
    # the bundles from it, so both agree (tests/unit/test_slices.py checks every shape).
    version, topology, chips_per_vm = shape.version, shape.topology, shape.chips_per_host
    cpus = {"CPU": lg.cpus_per_host}
    n, bundle = get_tpu_worker_resources(topology, version, cpus, chips_per_vm=chips_per_vm)
    spec: dict[str, Any] = {
        "topology": topology,
        "accelerator_version": version,
        "resources_per_bundle": cpus,
        "strategy": "SPREAD",
        "name": name,
        "lifetime": lifetime,
        "chips_per_vm": chips_per_vm,
    }
    # Pin bundle i to worker i of the slice, so the host index is the JAX process id.
    base = [{WORKER_ID_LABEL: str(i)} if n > 1 else {} for i in range(n)]
    if lg.region != LOCAL_REGION:
        base = [{**sel, REGION_LABEL: lg.region} for sel in base]
    # Ray's head reservation ignores our selectors and the hosts' chip count (v6e 2x4 has two
    # shapes with the same head resource), so for several hosts we pick an intact slice of
    # this shape ourselves (named slices skip the head step); PG creation stays all-or-nothing.
    # A one-host slice needs no head step: its bundle asks for all the chips of one host.
    pick_slice = n > 1
    while True:
        candidates = _slices(shape, lg.region) if pick_slice else [None]
        for k, slice_name in enumerate(candidates):
            share = (deadline - time.monotonic()) / (len(candidates) - k)
            sel = [{**s, SLICE_LABEL: slice_name} for s in base] if slice_name else base
            handle = _try_slice(lg.name, spec, sel, share)
            if handle is not None and handle.placement_group is not None:
                pg = handle.placement_group
                env = {"JAX_PLATFORMS": "cpu"} if emulated else None
                chips = {TPU_RESOURCE: float(bundle[TPU_RESOURCE])}
                opts = tuple(_options(pg, i, bundle, env, chips) for i in range(n))
                return LearnerPlacement(
                    lg.name, lg.accelerator, lg.region, pg, opts, dict(bundle), handle, slice_name
                )
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise PlacementTimeoutError(_timeout_message(lg, timeout_s, n, bundle, shape))
        time.sleep(min(1.0, remaining))  # no intact slice in the region yet; nodes may join


def _try_slice(
    learner: str, spec: dict[str, Any], selectors: list[dict[str, str]], wait_s: float
) -> SlicePlacementGroup | None:
    """One slice reservation attempt; None (and nothing left behind) if not ready in time."""
    started = time.monotonic()
    try:
        handle = SlicePlacementGroup(
            **spec,
            head_reservation_timeout_s=max(wait_s, 0.1),
            bundle_label_selector=selectors if any(selectors) else None,
        )
    except TimeoutError:  # no slice head free; Ray already removed its pending head PG
        logger.info("learner %s: no free slice head within %.1f s", learner, wait_s)
        return None
    pg = handle.placement_group
    if pg is not None and _wait_ready(pg, learner, started + wait_s):
        handle.release_head_pgs()  # the worker PG now holds the slice
        return handle
    handle.shutdown()
    return None


def _wait_ready(pg: PlacementGroup, learner: str, deadline: float) -> bool:
    remaining = max(deadline - time.monotonic(), 0.0)
    logger.info("waiting up to %.1f s for placement of learner %s", remaining, learner)
    ready, _ = ray.wait([pg.ready()], timeout=remaining)
    return bool(ready)


def _options(
    pg: PlacementGroup,
    index: int,
    bundle: dict[str, float],
    env: dict[str, str] | None,
    resources: dict[str, float] | None = None,
) -> dict[str, Any]:
    opts: dict[str, Any] = {
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=index
        ),
        "num_cpus": bundle.get("CPU", 0.0),
    }
    if bundle.get("GPU"):
        opts["num_gpus"] = bundle["GPU"]
    if resources:
        opts["resources"] = resources
    opts["runtime_env"] = actor_runtime_env(env)
    return opts


def _alive_nodes() -> list[dict[str, Any]]:
    return [node for node in ray.nodes() if node.get("Alive")]


def _slices(shape: SliceShape, region: str) -> list[str]:
    """Intact slices (all hosts alive) of `shape` in `region` (any region for "local"), by
    node labels and each host's TPU chips."""
    accel = f"TPU-{shape.version.upper()}"
    hosts: dict[str, int] = {}
    for node in _alive_nodes():
        labels = node.get("Labels") or {}
        if (
            labels.get(ACCELERATOR_LABEL) == accel
            and labels.get(TOPOLOGY_LABEL) == shape.topology
            and node.get("Resources", {}).get(TPU_RESOURCE) == shape.chips_per_host
            and region in (LOCAL_REGION, labels.get(REGION_LABEL))
            and labels.get(SLICE_LABEL)
        ):
            hosts[labels[SLICE_LABEL]] = hosts.get(labels[SLICE_LABEL], 0) + 1
    return sorted(s for s, count in hosts.items() if count >= shape.num_hosts)


def _timeout_message(
    lg: LearnerGroupConfig,
    timeout_s: float,
    n: int,
    bundle: dict[str, float],
    shape: SliceShape | None = None,
) -> str:
    """Say what is missing: hosts that fit the bundle in the region, per resource."""
    local = lg.region == LOCAL_REGION
    where = "the cluster" if local else f"region {lg.region!r}"
    nodes = [
        node["Resources"]
        for node in _alive_nodes()
        if local or (node.get("Labels") or {}).get(REGION_LABEL) == lg.region
    ]
    fit = [r for r in nodes if all(r.get(k, 0) >= v for k, v in bundle.items())]
    missing = [
        f"no node has {v:g} {k} (largest: {max((r.get(k, 0) for r in nodes), default=0):g})"
        for k, v in bundle.items()
        if not any(r.get(k, 0) >= v for r in nodes)
    ]
    if not nodes:
        missing = [f"no alive node in {where}" + ("" if local else " (RAY_NODE_REGION label)")]
    elif not missing:
        missing = [f"{len(fit)} node(s) fit one host when idle, {n} needed; others busy"]
    need = f"{n} host(s) of {bundle}"
    if shape is not None:
        intact = _slices(shape, lg.region)
        need = (
            f"one idle TPU-{shape.version.upper()} {shape.topology} slice ({need}); "
            f"intact: {intact or 'none'}"
        )
    available = {k: v for k, v in ray.available_resources().items() if "memory" not in k}
    available = {k: v for k, v in available.items() if not k.startswith("node:")}
    return (
        f"learner {lg.name!r} ({lg.accelerator}, topology {lg.topology}, region {lg.region}): "
        f"placement group not ready after {timeout_s:.1f} s. Needs {need} in {where}; "
        f"missing: {'; '.join(missing)}. Available now: {available}. Add or free those "
        "resources, or lower num_hosts/cpus_per_host."
    )
