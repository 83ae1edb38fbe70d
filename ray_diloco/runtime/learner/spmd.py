"""Layer: runtime (Ray shell). One learner over several hosts.

Every host of the learner runs the same `LearnerCore` as one `jax.distributed` job (CPU: gloo
collectives) over one mesh of every device of every host (algorithm/sharding.py): parameters
and optimizer state laid out by the task's sharding (FSDP by default), each batch split over
the mesh, and the collectives inside the jitted step. Only host 0 (the leader) talks to the
synchronizer: a fragment it offers is gathered to every host at its due step (a collective
over the slice's fast links, one DCN upload per learner). At every step boundary it
broadcasts what the other hosts must do (`HostLink.share_step`: the fragments it received,
whether to stop, the data leases it was given: every host reads the same global batch and
gives the mesh its rows, and the fragments the synchronizer pulled: every host joins their
gather at the next step) with `multihost_utils.broadcast_one_to_all`, and at start the
snapshot and data it registered with, so all hosts apply the same fragments at the same step.
A learner with one host uses `LocalLink`, which passes everything through.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ray_diloco.config import LearnerGroupConfig

logger = logging.getLogger(__name__)

Received = tuple[int, int, Any]  # fragment, version, values (leaf path -> array)
Leases = list[tuple[int, int, int]]  # (part, start, end) of the data pool's leases


@dataclass(frozen=True)
class Boundary:
    """What every host of a learner does at a step boundary, as host 0 decided it."""

    received: list[Received]  # publications to apply
    stop: bool
    leases: Leases = field(default_factory=list)  # data added to the pool
    pulled: list[int] = field(default_factory=list)  # fragments to offer next (`schedule: pull`)
    # With `stop`: the learner leaves the run or the budget is spent, so every host takes
    # part in offering all its unsent work first (a sharded leaf's copy is a collective).
    farewell: bool = False


def free_address() -> str:
    """host:port for the jax.distributed coordinator on this (leader) host."""
    import ray

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port = int(s.getsockname()[1])
    return f"{ray.util.get_node_ip_address()}:{port}"


def initialize(coordinator: str, num_processes: int, process_id: int) -> None:
    """Join the learner's jax.distributed job; before anything else touches JAX here."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # only used on CPU
    logger.info("host %d/%d joins jax.distributed at %s", process_id, num_processes, coordinator)
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)


def shutdown() -> None:
    import jax

    jax.distributed.shutdown()


def emulation_env(lg: LearnerGroupConfig, has_tpu: bool | None = None) -> dict[str, str]:
    """What this host's environment needs before JAX starts for the learner's mesh to have
    `lg.host_devices` devices here: a CPU learner, or a TPU learner on a host without the TPU
    runtime (an emulated slice: tests, laptops), runs JAX on the CPU with one device per chip.
    A real TPU or GPU host needs nothing. `has_tpu` None: whether libtpu is installed."""
    if lg.accelerator.startswith("tpu"):
        if has_tpu is None:
            has_tpu = importlib.util.find_spec("libtpu") is not None
        if has_tpu:
            return {}
    elif lg.accelerator != "cpu":
        return {}
    flags = [
        flag
        for flag in os.environ.get("XLA_FLAGS", "").split()
        if not flag.startswith("--xla_force_host_platform_device_count")
    ]
    flags.append(f"--xla_force_host_platform_device_count={lg.host_devices}")
    return {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags)}


def learner_devices(lg: LearnerGroupConfig) -> list[Any]:
    """Every device of the learner (all its hosts' once `initialize` ran), checked against
    its config: a host that sees another count was started without its devices."""
    import jax

    devices = jax.devices()
    if len(devices) != lg.num_devices:
        raise RuntimeError(
            f"learner {lg.name}: JAX sees {len(devices)} devices over {jax.process_count()} "
            f"process(es), its config {lg.num_hosts} host(s) x {lg.host_devices} (the host's "
            "XLA_FLAGS or TPU runtime do not match devices_per_host / the slice shape)"
        )
    return devices


class LocalLink:
    """One host: it is the leader and has nobody to tell."""

    leader = True

    def share_start(self, snapshot: Any, data: tuple[int, int, Leases]) -> tuple[Any, Any]:
        return snapshot, data

    def share_step(self, boundary: Boundary) -> Boundary:
        return boundary

    def close(self) -> None:
        pass


class HostLink:
    """Host 0's decisions, broadcast to every host of the learner."""

    def __init__(self, fragments: tuple[tuple[str, ...], ...], shapes: Mapping[str, Any]) -> None:
        import jax

        self.fragments = fragments
        self.shapes = {k: tuple(shapes[k]) for frag in fragments for k in frag}
        self.leader = jax.process_index() == 0

    def _broadcast(self, tree: Any) -> Any:
        from jax.experimental import multihost_utils

        return multihost_utils.broadcast_one_to_all(tree, is_source=self.leader)

    def _values(self, p: int, values: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        tree = {
            k: np.asarray(values[k], np.float32)
            if values is not None
            else np.zeros(self.shapes[k], np.float32)
            for k in self.fragments[p]
        }
        return {k: np.asarray(v) for k, v in self._broadcast(tree).items()}

    def _leases(self, leases: Leases) -> Leases:
        count = np.asarray(self._broadcast(np.array([len(leases)], np.int64)))[0]
        table = np.zeros((int(count), 3), np.int64)
        if self.leader and count:
            table[:] = leases
        return [tuple(int(x) for x in row) for row in np.asarray(self._broadcast(table))]  # type: ignore[misc]

    def share_start(
        self, snapshot: Any, data: tuple[int, int, Leases]
    ) -> tuple[Any, tuple[int, int, Leases]]:
        """Host 0's snapshot and data (cursor, offset into the first lease, leases)."""
        num = len(self.fragments)
        header = np.zeros(num + 2, np.int64)
        if self.leader:
            header[0], header[1] = data[0], data[1]
            header[2:] = [snapshot[p][0] for p in range(num)]
        header = np.asarray(self._broadcast(header))
        out = {
            p: (int(header[p + 2]), self._values(p, snapshot[p][1] if self.leader else None))
            for p in range(num)
        }
        return out, (int(header[0]), int(header[1]), self._leases(data[2]))

    def share_step(self, boundary: Boundary) -> Boundary:
        num = len(self.fragments)
        newest: dict[int, Received] = {}
        for item in boundary.received:  # the core keeps only the newest version of a fragment
            if item[0] not in newest or item[1] > newest[item[0]][1]:
                newest[item[0]] = item
        pulled = sorted(set(boundary.pulled))
        # stop, how many received and pulled; (fragment, version) per received; pulled ones
        header = np.full(3 + 3 * num, -1, np.int64)
        if self.leader:
            stop = 2 if boundary.stop and boundary.farewell else int(boundary.stop)
            header[0], header[1], header[2] = stop, len(newest), len(pulled)
            for i, (p, v, _) in enumerate(sorted(newest.values(), key=lambda e: e[0])):
                header[3 + 2 * i], header[4 + 2 * i] = p, v
            header[3 + 2 * num : 3 + 2 * num + len(pulled)] = pulled
        header = np.asarray(self._broadcast(header))
        shared = []
        for i in range(int(header[1])):
            p, v = int(header[3 + 2 * i]), int(header[4 + 2 * i])
            values = newest[p][2] if self.leader else None
            shared.append((p, v, self._values(p, values)))
        count = int(header[2])
        return Boundary(
            received=shared,
            stop=bool(header[0]),
            leases=self._leases(boundary.leases),
            pulled=[int(p) for p in header[3 + 2 * num : 3 + 2 * num + count]],
            farewell=int(header[0]) == 2,
        )

    def close(self) -> None:
        shutdown()
