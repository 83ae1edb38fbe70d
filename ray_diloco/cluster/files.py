"""Layer: cluster (pure Python). Reads the cluster files of `cluster_configs/` into one picture.

Two formats, both the tools' own: a `ray up` file (Ray's GCP launcher: a head node type and TPU
node types, one zone per file) and a KubeRay manifest (a RayCluster, or a RayJob with its
`rayClusterSpec`; other documents in the file, a Secret or a volume claim, are skipped). A job
may name several files: the pieces of one Ray cluster (a `ray up` head and a slice in another
region that joins it). Each becomes a `ClusterSpec`: where the Ray head is (region, CPUs,
memory), which TPU slices the cluster can have (shape from `slices.py`, region, how many) and
the problems seen in the files themselves (a shape no learner can use, a node without a region
label, a TPU container without the port and env KubeRay's TPU samples give it, the dashboard open
to the network, authentication off). A file that cannot be read as either format raises
`ClusterFileError`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ray_diloco.config import ConfigError, slices
from ray_diloco.config.slices import SliceShape

REGION_ENV = "RAY_NODE_REGION"
ZONE_ENV = "RAY_NODE_ZONE"
GKE_ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
GKE_TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
GKE_MACHINE_LABEL = "node.kubernetes.io/instance-type"
GKE_TPU_RESOURCE = "google.com/tpu"
# What every KubeRay TPU sample gives a TPU worker container: the TPU runtime's port (named mxla)
# and, for a v6e slice over several hosts, JAX on the TPU and host CPU with libtpu in PJRT
# compatibility mode.
TPU_PORT, TPU_PORT_NAME = 8081, "mxla"
MULTIHOST_V6E_ENV = {"JAX_PLATFORMS": "tpu,cpu", "ENABLE_PJRT_COMPATIBILITY": "true"}
LOCAL_DASHBOARD_HOSTS = ("127.0.0.1", "localhost")
# GiB per vCPU of the GCE machine families a head may use (n2-standard-16: 64 GiB).
_GIB_PER_VCPU = {"standard": 4, "highmem": 8, "highcpu": 1}
_QUANTITY = re.compile(r"^([0-9.]+(?:e[0-9]+)?)([A-Za-z]*)$")
_UNITS = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}


class ClusterFileError(ConfigError):
    """A cluster file that cannot be read; the message names the file and the fix."""


@dataclass(frozen=True)
class HeadNode:
    source: str  # "file: what", for messages
    region: str | None
    zone: str | None
    cpus: float | None
    memory_bytes: int | None
    gcs_fault_tolerance: bool


@dataclass(frozen=True)
class SlicePool:
    """Slices of one shape the cluster can have: a `ray up` TPU node type or a KubeRay TPU
    worker group (one replica = one slice)."""

    source: str
    region: str | None
    zone: str | None
    shape: SliceShape
    max_slices: int
    cpus_per_host: float | None


@dataclass(frozen=True)
class ClusterSpec:
    files: tuple[str, ...]
    heads: tuple[HeadNode, ...]
    pools: tuple[SlicePool, ...]
    problems: tuple[str, ...]


def read_cluster_files(paths: Sequence[str | Path]) -> ClusterSpec:
    """The Ray cluster the files make together."""
    heads: list[HeadNode] = []
    pools: list[SlicePool] = []
    problems: list[str] = []
    for path in paths:
        h, p, issues = _read_one(Path(path))
        heads += h
        pools += p
        problems += issues
    return ClusterSpec(tuple(str(p) for p in paths), tuple(heads), tuple(pools), tuple(problems))


def _read_one(path: Path) -> tuple[list[HeadNode], list[SlicePool], list[str]]:
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except OSError as err:
        raise ClusterFileError(f"cluster file {path}: cannot read it ({err.strerror})") from None
    except yaml.YAMLError as err:
        raise ClusterFileError(f"cluster file {path}: not valid YAML ({err})") from None
    if len(docs) == 1 and isinstance(docs[0], dict) and "available_node_types" in docs[0]:
        return _RayUp(str(path), docs[0]).read()
    specs = [_kuberay_spec(d) for d in docs if isinstance(d, dict)]
    found = [s for s in specs if s is not None]
    if not found:
        raise ClusterFileError(
            f"cluster file {path}: neither a `ray up` file (available_node_types) nor a KubeRay "
            "manifest (kind RayCluster, or RayJob with rayClusterSpec); name one of those"
        )
    heads: list[HeadNode] = []
    pools: list[SlicePool] = []
    problems: list[str] = []
    for name, spec in found:
        h, p, issues = _KubeRay(f"{path} ({name})", spec).read()
        heads += h
        pools += p
        problems += issues
    return heads, pools, problems


def _kuberay_spec(doc: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]] | None:
    if not str(doc.get("apiVersion", "")).startswith("ray.io/"):
        return None
    name = f"{doc.get('kind')} {(doc.get('metadata') or {}).get('name', '?')}"
    spec = doc.get("spec") or {}
    if doc.get("kind") == "RayCluster":
        return name, spec
    if doc.get("kind") == "RayJob" and spec.get("rayClusterSpec"):
        return name, spec["rayClusterSpec"]
    return None


class _RayUp:
    """A `ray up` file: one zone, a head node type, worker node types."""

    def __init__(self, source: str, config: Mapping[str, Any]) -> None:
        self.source, self.config = source, config
        provider = config.get("provider") or {}
        self.region, self.zone = provider.get("region"), provider.get("availability_zone")
        self.problems: list[str] = []
        if provider.get("type") != "gcp":
            self.problems.append(f"{source}: provider {provider.get('type')!r}; only gcp is read")

    def read(self) -> tuple[list[HeadNode], list[SlicePool], list[str]]:
        types = self.config.get("available_node_types") or {}
        head_type = self.config.get("head_node_type")
        if head_type not in types:
            raise ClusterFileError(
                f"cluster file {self.source}: head_node_type {head_type!r} is not one of "
                f"available_node_types {sorted(types)}; name one of them"
            )
        head_cmds = list(self.config.get("head_start_ray_commands") or [])
        worker_cmds = list(self.config.get("worker_start_ray_commands") or [])
        starts_head = any("--head" in str(c) for c in head_cmds)
        heads, pools = [], []
        for name, node_type in types.items():
            is_head = name == head_type
            cmds = head_cmds if is_head else worker_cmds
            self._check_start(f"node type {name!r}", cmds)
            if is_head and starts_head:
                heads.append(self._head(name, node_type))
                self._check_dashboard(head_cmds)
            pool = self._pool(name, node_type, 1 if is_head else None)
            if pool is not None:
                pools.append(pool)
        return heads, pools, self.problems

    def _check_start(self, what: str, cmds: Iterable[Any]) -> None:
        text = " ".join(str(c) for c in cmds)
        if "ray start" not in text:
            return
        region = _env_in(text, REGION_ENV)
        if region is None:
            self.problems.append(
                f"{self.source}: {what}: `ray start` sets no {REGION_ENV}, so its nodes get no "
                "region label and no learner pinned to a region can use them; set "
                f"{REGION_ENV}={self.region}"
            )
        elif region != self.region:
            self.problems.append(
                f"{self.source}: {what}: {REGION_ENV}={region} but provider.region is "
                f"{self.region}; make them agree"
            )
        if _env_in(text, "RAY_AUTH_MODE") != "token":
            self.problems.append(
                f"{self.source}: {what}: token authentication is off; start Ray with "
                "RAY_AUTH_MODE=token and the same ~/.ray/auth_token on every node"
            )

    def _check_dashboard(self, cmds: Iterable[Any]) -> None:
        match = re.search(r"--dashboard-host[= ](\S+)", " ".join(str(c) for c in cmds))
        if match and match.group(1) not in LOCAL_DASHBOARD_HOSTS:
            self.problems.append(
                f"{self.source}: the dashboard listens on {match.group(1)}, open to the "
                "network; use --dashboard-host=127.0.0.1 and reach it with `ray dashboard`"
            )

    def _head(self, name: str, node_type: Mapping[str, Any]) -> HeadNode:
        resources = node_type.get("resources") or {}
        machine = (node_type.get("node_config") or {}).get("machineType")
        memory = resources.get("memory") or _machine_memory(machine)
        return HeadNode(
            f"{self.source}: head node type {name!r}",
            self.region,
            self.zone,
            resources.get("CPU"),
            int(memory) if memory else None,
            gcs_fault_tolerance="RAY_REDIS_ADDRESS"
            in str(self.config.get("head_start_ray_commands")),
        )

    def _pool(self, name: str, node_type: Mapping[str, Any], count: int | None) -> SlicePool | None:
        node_config = node_type.get("node_config") or {}
        pod_type = node_config.get("acceleratorType")
        accel_config = node_config.get("acceleratorConfig")
        if pod_type is None and isinstance(accel_config, Mapping):
            version = str(accel_config.get("type", "")).lower()
            topology = str(accel_config.get("topology", ""))
            cores = 2 if version in ("v5p", "v4") else 1
            pod_type = f"{version}-{slices.topology_chips(topology) * cores}"
        if pod_type is None:
            return None  # a CPU node type
        try:
            shape = slices.tpu_vm_shape(str(pod_type))
        except slices.UnknownShape as err:
            self.problems.append(f"{self.source}: node type {name!r}: {err}")
            return None
        return SlicePool(
            f"{self.source}: node type {name!r}",
            self.region,
            self.zone,
            shape,
            count if count is not None else int(node_type.get("max_workers", 0)),
            (node_type.get("resources") or {}).get("CPU"),
        )


class _KubeRay:
    """A RayCluster spec: the head group and its worker groups (TPU ones become pools)."""

    def __init__(self, source: str, spec: Mapping[str, Any]) -> None:
        self.source, self.spec = source, spec
        self.problems: list[str] = []

    def read(self) -> tuple[list[HeadNode], list[SlicePool], list[str]]:
        head_group = self.spec.get("headGroupSpec") or {}
        container, _ = _container(head_group)
        env = _env(container)
        limits = (container.get("resources") or {}).get("limits") or {}
        head = HeadNode(
            f"{self.source}: head group",
            env.get(REGION_ENV),
            env.get(ZONE_ENV),
            _quantity(limits.get("cpu")),
            _int(_quantity(limits.get("memory"))),
            gcs_fault_tolerance=bool(self.spec.get("gcsFaultToleranceOptions")),
        )
        self._check_region("head group", env)
        self._check_security(head_group)
        pools = []
        for group in self.spec.get("workerGroupSpecs") or []:
            pool = self._pool(group)
            if pool is not None:
                pools.append(pool)
        return [head], pools, self.problems

    def _check_region(self, what: str, env: Mapping[str, str]) -> None:
        if REGION_ENV not in env:
            self.problems.append(
                f"{self.source}: {what}: no {REGION_ENV} in the container's env, so its pods get "
                "no region label and no learner pinned to a region can use them; set it to the "
                "GKE cluster's region"
            )

    def _check_security(self, head_group: Mapping[str, Any]) -> None:
        mode = (self.spec.get("authOptions") or {}).get("mode")
        if mode != "token":
            self.problems.append(
                f"{self.source}: token authentication is off; set spec.authOptions.mode: token"
            )
        if head_group.get("serviceType") in ("LoadBalancer", "NodePort"):
            self.problems.append(
                f"{self.source}: the head service is a {head_group['serviceType']}, open beyond "
                "the cluster; keep ClusterIP and use `kubectl port-forward`"
            )

    def _pool(self, group: Mapping[str, Any]) -> SlicePool | None:
        name = group.get("groupName", "?")
        what = f"worker group {name!r}"
        container, pod = _container(group)
        selector = pod.get("nodeSelector") or {}
        gke_accel = selector.get(GKE_ACCELERATOR_LABEL)
        if gke_accel is None:
            return None  # a CPU group
        env = _env(container)
        self._check_region(what, env)
        accel = next((a for a, g in slices.GKE_ACCELERATORS.items() if g == gke_accel), None)
        topology = str(selector.get(GKE_TOPOLOGY_LABEL, ""))
        hosts = int(group.get("numOfHosts", 1))
        try:
            if accel is None:
                raise slices.UnknownShape(
                    f"{GKE_ACCELERATOR_LABEL}={gke_accel} is not a known accelerator; known: "
                    f"{sorted(slices.GKE_ACCELERATORS.values())}"
                )
            shape = slices.resolve(accel, topology, hosts)
        except slices.UnknownShape as err:
            self.problems.append(f"{self.source}: {what}: {err}")
            return None
        limits = (container.get("resources") or {}).get("limits") or {}
        chips = _int(_quantity(limits.get(GKE_TPU_RESOURCE)))
        if chips != shape.chips_per_host:
            self.problems.append(
                f"{self.source}: {what}: {GKE_TPU_RESOURCE}={chips} per pod, but {accel} "
                f"{shape.topology} on {hosts} host(s) has {shape.chips_per_host} chips per host"
            )
        self._check_tpu_container(what, container, env, shape)
        machine = selector.get(GKE_MACHINE_LABEL)
        if machine is not None and machine != shape.gke_machine_type:
            self.problems.append(
                f"{self.source}: {what}: {GKE_MACHINE_LABEL}={machine}, but {shape.describe()} "
                f"of {accel} {shape.topology} is {shape.gke_machine_type}"
            )
        return SlicePool(
            f"{self.source}: {what}",
            env.get(REGION_ENV),
            env.get(ZONE_ENV),
            shape,
            int(group.get("maxReplicas", group.get("replicas", 1))),
            _quantity(limits.get("cpu")),
        )

    def _check_tpu_container(
        self, what: str, container: Mapping[str, Any], env: Mapping[str, str], shape: SliceShape
    ) -> None:
        ports = container.get("ports") or []
        if not any(isinstance(p, Mapping) and p.get("containerPort") == TPU_PORT for p in ports):
            self.problems.append(
                f"{self.source}: {what}: the container exposes no containerPort {TPU_PORT}, the "
                "TPU runtime's port in KubeRay's TPU samples; add ports: "
                f"[{{containerPort: {TPU_PORT}, name: {TPU_PORT_NAME}}}]"
            )
        if shape.accelerator == "tpu-v6e" and shape.num_hosts > 1:
            wrong = {k: v for k, v in MULTIHOST_V6E_ENV.items() if env.get(k) != v}
            if wrong:
                self.problems.append(
                    f"{self.source}: {what}: a multi-host v6e slice needs "
                    + ", ".join(f"{k}={v}" for k, v in wrong.items())
                    + " in the container's env; add them"
                )


def _container(group: Mapping[str, Any]) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """The Ray container of a head or worker group (the first one) and its pod spec."""
    pod = (group.get("template") or {}).get("spec") or {}
    containers = pod.get("containers") or [{}]
    return containers[0], pod


def _env(container: Mapping[str, Any]) -> dict[str, str]:
    return {
        str(e["name"]): str(e["value"])
        for e in container.get("env") or []
        if isinstance(e, Mapping) and "value" in e
    }


def _env_in(command: str, name: str) -> str | None:
    match = re.search(rf"\b{name}=(\S+)", command)
    return match.group(1) if match else None


def _quantity(value: Any) -> float | None:
    """A Kubernetes quantity ("14", "500m", "100Gi", "40G") as a number."""
    if value is None:
        return None
    text = str(value).strip()
    if text.endswith("m") and text[:-1].isdigit():
        return int(text[:-1]) / 1000
    match = _QUANTITY.match(text)
    if not match or match.group(2) not in _UNITS:
        return None
    return float(match.group(1)) * _UNITS[match.group(2)]


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


def _machine_memory(machine: Any) -> int | None:
    """Memory of a GCE machine type such as n2-highmem-16 (None when unknown)."""
    parts = str(machine or "").split("-")
    if len(parts) != 3 or parts[1] not in _GIB_PER_VCPU or not parts[2].isdigit():
        return None
    return _GIB_PER_VCPU[parts[1]] * int(parts[2]) * 2**30
