"""Layer: cluster (pure Python; no Ray, no JAX). `ray-diloco plan`: a job against its cluster.

Starts nothing. From the job's config, the cluster files (`files.py`) and the fragment sizes of
the run's fragment plan it works out what a run would do before anyone pays for TPUs:
- where each learner group goes: the slice pool (a `ray up` TPU node type or a KubeRay worker
  group) of its shape in its region, hosts, chips per host and placement strategy, the way
  `runtime/resources.py` reserves it (one bundle per host, bundle i on TPU worker i);
- that the synchronizer and the supervisor go on the head (both pin themselves to it);
- the bytes per second each region's link to the synchronizer carries at `step_time_s`
  (`learner_link_loads`), against the link's bandwidth (`links`: emulated, `cluster.links`:
  the real network);
- an estimate of the synchronizer's memory (`synchronizer_memory_bytes`) against the head's;
- each learner's bytes per chip (parameters, gradients, optimizer state and activations on its
  mesh) against its chip's HBM: figures `ray-diloco plan` computes with JAX
  (`algorithm/memory.py`, shapes only) and passes in as numbers, as it does the fragment sizes;
- every problem found on the way, the cluster files' own included.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ray_diloco.algorithm import wire
from ray_diloco.cluster.files import ClusterSpec, HeadNode, SlicePool
from ray_diloco.config import LearnerGroupConfig, LinkConfig, RunConfig, WireDtype

if TYPE_CHECKING:  # plain numbers; the module that computes them needs JAX, this one must not
    from ray_diloco.algorithm.memory import ChipMemory

LOCAL_REGION = "local"
# Ray keeps 30% of a node's memory for its object store by default; the head's GCS, dashboard,
# job driver and supervisor take a few GiB more. What is left is the synchronizer's.
OBJECT_STORE_FRACTION = 0.3
HEAD_PROCESSES_BYTES = 4 * 2**30
SYNC_PROCESS_BYTES = 2 * 2**30  # the synchronizer's Python, JAX and Orbax before any parameter
F32 = 4


@dataclass(frozen=True)
class LearnerSite:
    """Where one learner group would go."""

    learner: LearnerGroupConfig
    pool: SlicePool | None  # None: no slice of its shape left in its region (see problems)
    strategy: str


@dataclass(frozen=True)
class LinkLoad:
    """The traffic between one region's learners and the synchronizer, bytes per second.
    `down` is an upper bound: every round closing with `quorum_min` contributions."""

    region: str
    learners: tuple[str, ...]
    up: float
    down: float
    link: LinkConfig | None
    kind: str  # "local" (the synchronizer's region), "emulated", "real" or "none"

    @property
    def use(self) -> float | None:
        """Busiest direction over the link's bandwidth (None without a link)."""
        if self.link is None:
            return None
        return max(self.up, self.down) * 8 / (self.link.bandwidth_gbps * 1e9)


@dataclass
class Plan:
    cfg: RunConfig
    cluster: ClusterSpec
    num_params: int
    fragment_sizes: tuple[int, ...]
    head: HeadNode | None = None
    sites: list[LearnerSite] = field(default_factory=list)
    loads: list[LinkLoad] = field(default_factory=list)
    sync_memory: int = 0
    chip_memory: Mapping[str, ChipMemory] = field(default_factory=dict)  # by learner name
    problems: list[str] = field(default_factory=list)


def make_plan(
    cfg: RunConfig,
    cluster: ClusterSpec,
    fragment_sizes: Sequence[int],
    chip_memory: Mapping[str, ChipMemory] | None = None,
) -> Plan:
    """The plan of `cfg` on `cluster`; `chip_memory` (`algorithm.memory.learner_memory`)
    adds each learner's memory row and its check against the chip's HBM."""
    plan = Plan(
        cfg,
        cluster,
        sum(fragment_sizes),
        tuple(fragment_sizes),
        chip_memory=dict(chip_memory or {}),
    )
    plan.problems += cluster.problems
    plan.head = _head(cfg, cluster, plan.problems)
    plan.sites = _place_learners(cfg, cluster, plan.problems)
    plan.loads = learner_link_loads(cfg, fragment_sizes, _sync_region(cfg, plan.head))
    for load in plan.loads:
        _check_link(load, plan.problems)
    plan.sync_memory = synchronizer_memory_bytes(cfg, plan.num_params)
    _check_memory(plan)
    for i, lg in enumerate(cfg.learners):
        _check_chip_memory(i, lg, plan.chip_memory.get(lg.name), plan.problems)
    return plan


def _sync_region(cfg: RunConfig, head: HeadNode | None) -> str:
    return head.region if head is not None and head.region else cfg.synchronizer.region


def _head(cfg: RunConfig, cluster: ClusterSpec, problems: list[str]) -> HeadNode | None:
    if not cluster.heads:
        problems.append(
            "no Ray head in the cluster files: the synchronizer and the supervisor run on it"
        )
        return None
    head = cluster.heads[0]
    if len(cluster.heads) > 1:
        problems.append(
            "the cluster files start "
            f"{len(cluster.heads)} Ray heads ({', '.join(h.source for h in cluster.heads)}): "
            "that is several Ray clusters, and learners reach only their own cluster's "
            "synchronizer; join the other nodes to one head"
        )
    if head.region and cfg.synchronizer.region != head.region:
        problems.append(
            f"synchronizer.region={cfg.synchronizer.region} but the synchronizer runs on the "
            f"head, in {head.region}; set synchronizer.region: {head.region}"
        )
    return head


def _place_learners(cfg: RunConfig, cluster: ClusterSpec, problems: list[str]) -> list[LearnerSite]:
    """Assign each TPU learner a slice of its shape in its region, first come first served."""
    free = {pool.source: pool.max_slices for pool in cluster.pools}
    sites = []
    for lg in cfg.learners:
        shape = lg.slice_shape
        if shape is None:
            strategy = "SPREAD" if lg.num_hosts > 1 else "PACK"
            sites.append(LearnerSite(lg, None, f"{strategy} over CPU nodes"))
            continue
        strategy = "SPREAD, bundle i on TPU worker i" if shape.num_hosts > 1 else "one bundle"
        fits = [
            p
            for p in cluster.pools
            if p.shape == shape and lg.region in (LOCAL_REGION, p.region) and free[p.source] > 0
        ]
        if not fits:
            problems.append(_no_slice(lg, cluster))
            sites.append(LearnerSite(lg, None, strategy))
            continue
        pool = fits[0]
        free[pool.source] -= 1
        if pool.cpus_per_host is not None and lg.cpus_per_host > pool.cpus_per_host:
            problems.append(
                f"learner {lg.name!r}: cpus_per_host={lg.cpus_per_host:g} but {pool.source} "
                f"has {pool.cpus_per_host:g} CPUs per host; lower cpus_per_host"
            )
        sites.append(LearnerSite(lg, pool, strategy))
    return sites


def _no_slice(lg: LearnerGroupConfig, cluster: ClusterSpec) -> str:
    shape = lg.slice_shape
    assert shape is not None
    want = (
        f"learner {lg.name!r} needs a {lg.accelerator} {shape.topology} slice of {shape.describe()}"
    )
    where = "anywhere" if lg.region == LOCAL_REGION else f"in region {lg.region}"
    here = [p for p in cluster.pools if lg.region in (LOCAL_REGION, p.region)]
    other_shape = [
        p
        for p in here
        if p.shape.accelerator == shape.accelerator and p.shape.topology == shape.topology
    ]
    if other_shape:
        p = other_shape[0]
        return (
            f"{want} {where}, but {p.source} has {p.shape.describe()}; set num_hosts: "
            f"{p.shape.num_hosts} or change the cluster file"
        )
    same = [p for p in cluster.pools if p.shape == shape]
    if same and all(p.region != lg.region for p in same):
        regions = sorted({str(p.region) for p in same})
        return f"too few hosts {where}: {want}; the cluster has that shape only in {regions}"
    if same:
        return (
            f"too few hosts {where}: {want}; the slices of that shape there are taken by "
            "learners listed before it (raise max_workers / maxReplicas)"
        )
    return f"too few hosts {where}: {want}; no cluster file has that shape"


def fragment_wire_bytes(cfg: RunConfig, fragment_sizes: Sequence[int]) -> tuple[int, int]:
    """(up, down) bytes of one offer and one publication of every fragment once: contributions
    go on `wire_dtype`, publications as `publish_delta` differences, or in float32 or bfloat16
    (`wire.publish_dtype`) when it is none (the steady state: a joining learner's first one
    is a full value). Counted per fragment; the per-leaf block rounding of the real encoding
    adds < 5 bytes a leaf."""
    d = cfg.diloco
    up = sum(wire.wire_bytes(n, d.wire_dtype, d.int4_block_size) for n in fragment_sizes)
    down = sum(wire.wire_bytes(n, _down_dtype(cfg), d.int4_block_size) for n in fragment_sizes)
    return up, down


def _down_dtype(cfg: RunConfig) -> WireDtype:
    d = cfg.diloco
    return wire.publish_dtype(d.wire_dtype) if d.publish_delta == "none" else d.publish_delta


def learner_link_loads(
    cfg: RunConfig, fragment_sizes: Sequence[int], sync_region: str
) -> list[LinkLoad]:
    """Bytes per second on each region's link at `step_time_s` (a learner's step lasts
    `step_time_s / speed`). Up: every fragment once per `sync_every` steps per learner, of the
    fastest learner's steps when the synchronizer pulls (`schedule: pull`: every learner answers
    every pull). Down with `publish_to: all`: every round to every learner; a round needs
    `quorum_min` contributions (all learners in synchronous mode), so at most contributions / K
    rounds. With `publish_to: contributors`: one version back per contribution."""
    up_bytes, down_bytes = fragment_wire_bytes(cfg, fragment_sizes)
    pulled = cfg.diloco.schedule == "pull"
    fastest = max(lg.speed for lg in cfg.learners)
    windows = {
        lg.name: (fastest if pulled else lg.speed) / (cfg.diloco.sync_every * cfg.step_time_s)
        for lg in cfg.learners
    }  # sync windows per second, i.e. offers of each fragment per second
    quorum = cfg.num_learners if cfg.diloco.mode == "synchronous" else cfg.diloco.quorum_min
    rounds = sum(windows.values()) / quorum
    loads = []
    for region in sorted({lg.region for lg in cfg.learners}):
        names = tuple(lg.name for lg in cfg.learners if lg.region == region)
        up = sum(windows[n] for n in names) * up_bytes
        if cfg.diloco.publish_to == "all":
            down = len(names) * rounds * down_bytes
        else:
            down = sum(windows[n] for n in names) * down_bytes
        link, kind = _link(cfg, region, sync_region)
        loads.append(LinkLoad(region, names, up, down, link, kind))
    return loads


def _link(cfg: RunConfig, region: str, sync_region: str) -> tuple[LinkConfig | None, str]:
    if region in cfg.links:
        return cfg.links[region], "emulated"
    if region in cfg.cluster.links:
        return cfg.cluster.links[region], "real"
    if region in (sync_region, LOCAL_REGION):
        return None, "local"
    return None, "none"


def _check_link(load: LinkLoad, problems: list[str]) -> None:
    if load.kind == "none":
        problems.append(
            f"region {load.region} has no link to the synchronizer's region: its traffic "
            f"({_rate(load.up)} up, up to {_rate(load.down)} down) is not checked; declare the "
            f"network you expect in cluster.links.{load.region} (bandwidth_gbps, latency_ms)"
        )
    use = load.use
    if use is not None and use > 1 and load.link is not None:
        need = max(load.up, load.down) * 8 / 1e9
        problems.append(
            f"region {load.region}'s link is saturated: it needs {need:.2f} Gbps and has "
            f"{load.link.bandwidth_gbps:g}; raise sync_every, num_fragments' wire compression "
            "(diloco.wire_dtype) or the link"
        )


def synchronizer_memory_bytes(cfg: RunConfig, num_params: int) -> int:
    """An estimate of the synchronizer's resident memory: float32 copies of the parameters
    (sync_core.py): the global values, the outer momentum, the published versions it keeps
    (`max_staleness_versions` + 1), one contribution waiting per learner, a checkpoint being
    written (values and momentum) and the initial parameters it was built from; plus its
    process (Python, JAX, Orbax)."""
    copies = 1 + 1 + (cfg.diloco.max_staleness_versions + 1) + cfg.num_learners + 2 + 1
    return F32 * num_params * copies + SYNC_PROCESS_BYTES


def _check_memory(plan: Plan) -> None:
    head = plan.head
    if head is None:
        return
    if head.memory_bytes is None:
        plan.problems.append(
            f"{head.source}: its memory is unknown, so the synchronizer's "
            f"~{_size(plan.sync_memory)} is not checked; give the head a memory resource"
        )
        return
    room = head.memory_bytes * (1 - OBJECT_STORE_FRACTION) - HEAD_PROCESSES_BYTES
    if plan.sync_memory > room:
        plan.problems.append(
            f"the synchronizer needs ~{_size(plan.sync_memory)} but the head has "
            f"{_size(int(room))} left after its object store and Ray's own processes "
            f"({head.source}); use a bigger head or lower diloco.max_staleness_versions"
        )


def _check_chip_memory(
    index: int, lg: LearnerGroupConfig, mem: ChipMemory | None, problems: list[str]
) -> None:
    """A TPU learner whose chip cannot hold its share is a problem; the fixes offered are the
    ones that lower that share: sharding what `data` replicates, more chips, fewer examples
    per chip (activations only, while a chip has more than one)."""
    shape = lg.slice_shape
    if mem is None or shape is None or mem.total <= shape.hbm_bytes:
        return
    fixes = ["use a bigger slice"]
    if lg.mesh_sizes["data"] > 1:
        mesh = f"learners.{index}.mesh"
        axes = f"{mesh}.data=1" if lg.mesh.tensor == -1 else f"{mesh}.data=1, {mesh}.fsdp=-1"
        fixes.insert(0, f"shard it ({axes})")
    if mem.activations and mem.examples > 1:
        fixes.append(f"a smaller batch (learners.{index}.batch_size)")
    bound = "" if mem.activations is not None else "at least "
    problems.append(
        f"learner {lg.name!r}: {bound}{_gb(mem.total)} per chip (params {_gb(mem.params)}, "
        f"grads {_gb(mem.grads)}, optimizer {_gb(mem.opt_state)}, {_activations(mem)}) "
        f"exceeds a {shape.version} chip's {_hbm(shape.hbm_bytes)} HBM; "
        f"{', '.join(fixes[:-1])}{' or ' if len(fixes) > 1 else ''}{fixes[-1]}"
    )


def _activations(mem: ChipMemory) -> str:
    if mem.activations is None:
        return f"activations not estimated: the task's data is not readable here ({mem.unread})"
    per = "example" if mem.examples == 1 else "examples"
    return f"activations {_gb(mem.activations)} at {mem.examples} {per} per chip"


def _memory_row(lg: LearnerGroupConfig, mem: ChipMemory) -> str:
    shape = lg.slice_shape
    hbm = (
        f"of a {shape.version} chip's {_hbm(shape.hbm_bytes)} HBM"
        if shape is not None
        else f"({lg.accelerator}: the device's memory is not known here, not checked)"
    )
    if mem.activations is None:
        return (
            f"per chip: params+grads+optimizer {_gb(mem.held)}, {_activations(mem)}; total at "
            f"least {_gb(mem.total)} {hbm}"
        )
    return (
        f"per chip: params+grads+optimizer {_gb(mem.held)}, {_activations(mem)} (what backprop "
        f"keeps); total {_gb(mem.total)} {hbm}"
    )


def render(plan: Plan) -> str:
    cfg, head = plan.cfg, plan.head
    d = cfg.diloco
    sizes = plan.fragment_sizes
    lines = [
        f"plan: {cfg.name} on {', '.join(plan.cluster.files)}",
        f"model: {plan.num_params:,} parameters in {len(sizes)} fragments "
        f"(largest {max(sizes):,}); {d.mode}, H={d.sync_every}, K={d.quorum_min}, "
        f"wire {d.wire_dtype} up / {_down_dtype(cfg)} down, publish to "
        f"{d.publish_to}",
    ]
    if head is not None:
        ft = "on (Redis)" if head.gcs_fault_tolerance else "off"
        lines += [
            f"head: region {head.region}, {_cpus(head.cpus)} CPUs, "
            f"{_size(head.memory_bytes)} ({head.source}); GCS fault tolerance {ft}",
            f"  synchronizer  on the head; memory ~{_size(plan.sync_memory)} (estimate)",
            "  supervisor    on the head, with the job's driver",
        ]
    lines.append("learners:")
    for site in plan.sites:
        lg = site.learner
        shape = lg.slice_shape
        what = (
            f"{lg.accelerator} {shape.topology}: {shape.describe()}"
            if shape is not None
            else f"{lg.accelerator}: {lg.num_hosts} host(s) x {lg.cpus_per_host:g} CPUs"
        )
        where = f"on {site.pool.source}" if site.pool is not None else "NOT PLACED (see problems)"
        zone = f" ({site.pool.zone})" if site.pool is not None and site.pool.zone else ""
        lines += [
            f"  {lg.name:<10} {what} in {lg.region}{zone}; {site.strategy}",
            f"  {'':<10} {where}",
        ]
        mem = plan.chip_memory.get(lg.name)
        if mem is not None:
            lines.append(f"  {'':<10} {_memory_row(lg, mem)}")
    lines.append(
        f"links to the synchronizer at step_time_s={cfg.step_time_s:g} "
        f"(down: at most, every round with K contributions):"
    )
    for load in plan.loads:
        link = "-" if load.link is None else f"{load.link.bandwidth_gbps:g} Gbps {load.kind}"
        use = "" if load.use is None else f", {100 * load.use:.1f}% used"
        lines.append(
            f"  {load.region:<14} {len(load.learners)} learner(s): {_rate(load.up)} up, "
            f"{_rate(load.down)} down; link {link if load.kind != 'local' else 'local'}{use}"
        )
    lines.append(f"problems: {len(plan.problems) or 'none'}")
    lines += [f"  - {p}" for p in plan.problems]
    return "\n".join(lines)


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e6:.2f} MB/s ({bytes_per_s * 8 / 1e6:.1f} Mbps)"


def _gb(nbytes: int) -> str:
    """Chip memory in GB of 10**9 bytes, the unit Google's TPU docs give HBM in."""
    return f"{nbytes / 1e9:.1f} GB"


def _hbm(nbytes: int) -> str:
    return f"{nbytes / 1e9:g} GB"


def _size(nbytes: int | None) -> str:
    return "unknown memory" if nbytes is None else f"{nbytes / 2**30:.1f} GiB"


def _cpus(cpus: float | None) -> str:
    return "?" if cpus is None else f"{cpus:g}"
