"""Fixtures for tests/chaos: a local multi-node Ray cluster with emulated TPU slices.

One cluster per test module (ray-notes §1.5, §4): a CPU-only head (1 CPU, no TPU: a TPU
resource there would trigger GCE metadata lookups) with health checks tuned so a killed host
is declared dead in about 1.5 s, two hosts of v5p slice "slice-v5p" (v5p-16, topology 2x2x2)
in us-east5 and two 4-chip hosts of v6e slice "slice-v6e" (v6e-8, topology 2x4) in
europe-west4 (`tests.cluster_helpers.SLICES`). A test that removes a host adds it back
(`tpu_cluster.add_slice_host`) before it ends.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.cluster_helpers import FAST_HEALTH_CHECKS, SLICES, TpuCluster, prepare_ray_env

NAMESPACE = "diloco-chaos"


@pytest.fixture(scope="module")
def tpu_cluster() -> Iterator[TpuCluster]:
    prepare_ray_env()
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():  # a previous module leaked its Ray; never reuse it
        ray.shutdown()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "include_dashboard": False,
            "object_store_memory": 100 * 2**20,
            "_system_config": FAST_HEALTH_CHECKS,
        },
    )
    try:
        tpu = TpuCluster(cluster, {})
        for kind in SLICES:
            for worker_id in range(2):
                tpu.add_slice_host(kind, worker_id)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace=NAMESPACE)
        yield tpu
    finally:
        ray.shutdown()
        cluster.shutdown()
