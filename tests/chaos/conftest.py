"""Fixtures for tests/chaos: a local multi-node Ray cluster with emulated TPU slices.

One cluster per test module (`tests.cluster_helpers.start_tpu_cluster`): a CPU-only head, two
hosts of v5p slice "slice-v5p" (v5p-16, topology 2x2x2) in us-east5 and two 4-chip hosts of v6e
slice "slice-v6e" (v6e-8, topology 2x4) in europe-west4, a killed host declared dead in about
1.5 s. A test that removes a host adds it back (`tpu_cluster.add_slice_host`) before it ends.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.cluster_helpers import TpuCluster, start_tpu_cluster

NAMESPACE = "diloco-chaos"


@pytest.fixture(scope="module")
def tpu_cluster() -> Iterator[TpuCluster]:
    tpu = start_tpu_cluster(NAMESPACE)
    try:
        yield tpu
    finally:
        import ray

        ray.shutdown()
        tpu.cluster.shutdown()
