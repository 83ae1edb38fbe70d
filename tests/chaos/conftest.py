"""Fixtures for tests/chaos: a local multi-node Ray cluster with emulated TPU slices.

One cluster per test module (ray-notes §1.5, §4): a CPU-only head (1 CPU, no TPU: a TPU
resource there would trigger GCE metadata lookups) with health checks tuned so a killed host
is declared dead in about 1.5 s (ray-notes §3.3), two hosts of v5p slice "slice-v5p" (v5p-16,
topology 2x2x2) in us-east5 and two 4-chip hosts of v6e slice "slice-v6e" (v6e-8, topology
2x4) in europe-west4. Tests that remove a host put one back before they end.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest

from tests.cluster_helpers import add_tpu_host, prepare_ray_env

NAMESPACE = "diloco-chaos"
# name -> (slice name, pod type, topology, region)
SLICES = {
    "v5p": ("slice-v5p", "v5p-16", "2x2x2", "us-east5"),
    "v6e": ("slice-v6e", "v6e-8", "2x4", "europe-west4"),
}
HEALTH_CHECK_CONFIG = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}


class TpuCluster(NamedTuple):
    cluster: Any  # ray.cluster_utils.Cluster
    hosts: dict[tuple[str, int], Any]  # ("v5p", worker_id) -> ray._private.node.Node

    def replace_host(self, kind: str, worker_id: int) -> Any:
        """Re-add host `worker_id` of slice `kind` with the same identity (a rejoin)."""
        slice_name, pod_type, topology, region = SLICES[kind]
        node = add_tpu_host(self.cluster, slice_name, pod_type, topology, worker_id, region)
        self.hosts[(kind, worker_id)] = node
        return node


@pytest.fixture(scope="module")
def tpu_cluster() -> Iterator[TpuCluster]:
    prepare_ray_env()
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "include_dashboard": False,
            "object_store_memory": 100 * 2**20,
            "_system_config": HEALTH_CHECK_CONFIG,
        },
    )
    try:
        hosts = {}
        for kind, (slice_name, pod_type, topology, region) in SLICES.items():
            for worker_id in range(2):
                hosts[(kind, worker_id)] = add_tpu_host(
                    cluster, slice_name, pod_type, topology, worker_id, region
                )
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace=NAMESPACE)
        yield TpuCluster(cluster, hosts)
    finally:
        ray.shutdown()
        cluster.shutdown()
