"""Layer: config (pure Python). The one table of TPU slice shapes this project runs on.

A shape is an (accelerator, topology, hosts) triple with its chips per host: what a learner's
`accelerator`, `topology` and `num_hosts` ask for, what `runtime/resources.py` reserves (one
bundle of `chips_per_host` TPU chips per host) and what the cluster files provide (a GKE node
pool's machine type, a TPU VM's accelerator type). `tests/unit/test_slices.py` checks every row
against Ray's own TPU helpers (`ray.util.tpu.get_tpu_worker_resources`, the pod type and
chips-per-host rules of `ray._private.accelerators.tpu`), so the table cannot drift from what
Ray reserves.

Only v6e/v5e topologies up to 8 chips can be one host. v6e 2x4 is the one topology with two
shapes: one 8-chip VM (what a TPU VM `v6e-8` is, and GKE `ct6e-standard-8t`; Ray's default)
or two 4-chip VMs (GKE `ct6e-standard-4t`), so a learner must say which with `num_hosts`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# GKE node label values (`cloud.google.com/gke-tpu-accelerator`) per accelerator.
GKE_ACCELERATORS = {"tpu-v5p": "tpu-v5p-slice", "tpu-v6e": "tpu-v6e-slice"}
# TensorCores per chip: the "pod type" v5p-16 counts cores (8 chips), v6e-8 counts chips.
_CORES_PER_CHIP = {"tpu-v5p": 2, "tpu-v6e": 1}
# HBM per chip, bytes, as Google's TPU docs give it (cloud.google.com/tpu/docs/v5p: 95 GB,
# /v6e: 32 GB): what `ray-diloco plan` checks a learner's per-chip memory against.
_HBM_BYTES_PER_CHIP = {"tpu-v5p": 95 * 10**9, "tpu-v6e": 32 * 10**9}


@dataclass(frozen=True)
class SliceShape:
    accelerator: str  # the learner's accelerator: "tpu-v5p", "tpu-v6e"
    topology: str  # chips per dimension: "2x2x2", "2x4"
    num_hosts: int  # VMs (Ray nodes, Kubernetes pods) in one slice
    chips_per_host: int
    gke_machine_type: str  # the GKE node pool's machine type for this shape
    tpu_vm: bool  # the shape `gcloud compute tpus tpu-vm create` / `ray up` gives the pod type

    @property
    def version(self) -> str:
        """Ray's accelerator version: "v5p", "v6e"."""
        return self.accelerator.removeprefix("tpu-")

    @property
    def hbm_bytes(self) -> int:
        """HBM of one chip of the slice."""
        return _HBM_BYTES_PER_CHIP[self.accelerator]

    @property
    def chips(self) -> int:
        return self.num_hosts * self.chips_per_host

    @property
    def pod_type(self) -> str:
        """GCP accelerator type, e.g. v5p-16 (TensorCores) or v6e-8 (chips)."""
        return f"{self.version}-{self.chips * _CORES_PER_CHIP[self.accelerator]}"

    def describe(self) -> str:
        return f"{self.num_hosts} host(s) x {self.chips_per_host} chips"


def _row(
    accel: str, topology: str, hosts: int, per_host: int, machine: str, vm: bool = True
) -> SliceShape:
    return SliceShape(accel, topology, hosts, per_host, machine, vm)


_V5P = "ct5p-hightpu-4t"
SHAPES: tuple[SliceShape, ...] = (
    _row("tpu-v5p", "2x2x1", 1, 4, _V5P),
    _row("tpu-v5p", "2x2x2", 2, 4, _V5P),
    _row("tpu-v5p", "2x2x4", 4, 4, _V5P),
    _row("tpu-v5p", "2x4x4", 8, 4, _V5P),
    _row("tpu-v5p", "4x4x4", 16, 4, _V5P),
    _row("tpu-v6e", "1x1", 1, 1, "ct6e-standard-1t"),
    _row("tpu-v6e", "2x2", 1, 4, "ct6e-standard-4t"),
    _row("tpu-v6e", "2x4", 1, 8, "ct6e-standard-8t"),
    _row("tpu-v6e", "2x4", 2, 4, "ct6e-standard-4t", vm=False),  # GKE only
    _row("tpu-v6e", "4x4", 4, 4, "ct6e-standard-4t"),
    _row("tpu-v6e", "4x8", 8, 4, "ct6e-standard-4t"),
    _row("tpu-v6e", "8x8", 16, 4, "ct6e-standard-4t"),
    _row("tpu-v6e", "8x16", 32, 4, "ct6e-standard-4t"),
    _row("tpu-v6e", "16x16", 64, 4, "ct6e-standard-4t"),
)


class UnknownShape(ValueError):
    """No row of the table fits; the message names the known ones."""


def normalize_topology(topology: str) -> str:
    return topology.strip().lower()


def topology_chips(topology: str) -> int:
    return math.prod(int(d) for d in normalize_topology(topology).split("x"))


def shapes(accelerator: str, topology: str) -> tuple[SliceShape, ...]:
    """Every shape of `accelerator` with `topology` (two for v6e 2x4, else at most one)."""
    topo = normalize_topology(topology)
    return tuple(s for s in SHAPES if s.accelerator == accelerator and s.topology == topo)


def known_topologies(accelerator: str) -> list[str]:
    return sorted({s.topology for s in SHAPES if s.accelerator == accelerator}, key=topology_chips)


def resolve(accelerator: str, topology: str, num_hosts: int | None = None) -> SliceShape:
    """The shape a learner asks for; `num_hosts` None picks the only shape of the topology."""
    found = shapes(accelerator, topology)
    if not found:
        raise UnknownShape(
            f"{accelerator} topology {topology!r} is not a known slice shape; known: "
            f"{', '.join(known_topologies(accelerator)) or 'none'} (ray_diloco/config/slices.py)"
        )
    if num_hosts is None:
        if len(found) > 1:
            raise UnknownShape(
                f"{accelerator} topology {topology} comes as "
                + " or as ".join(f"{s.describe()} ({_where(s)})" for s in found)
                + f"; say which with num_hosts: {' or '.join(str(s.num_hosts) for s in found)}"
            )
        return found[0]
    for shape in found:
        if shape.num_hosts == num_hosts:
            return shape
    raise UnknownShape(
        f"{accelerator} topology {topology} has no {num_hosts}-host shape; set num_hosts: "
        + " or ".join(f"{s.num_hosts} ({s.describe()})" for s in found)
    )


def tpu_vm_shape(pod_type: str) -> SliceShape:
    """The shape of a TPU VM of GCP accelerator type `pod_type` (e.g. v6e-8: one 8-chip VM)."""
    for shape in SHAPES:
        if shape.tpu_vm and shape.pod_type == pod_type.strip().lower():
            return shape
    known = ", ".join(s.pod_type for s in SHAPES if s.tpu_vm)
    raise UnknownShape(f"TPU accelerator type {pod_type!r} is not a known slice; known: {known}")


def _where(shape: SliceShape) -> str:
    vm = f"TPU VM {shape.pod_type}, " if shape.tpu_vm else ""
    return f"{vm}GKE {shape.gke_machine_type}"
