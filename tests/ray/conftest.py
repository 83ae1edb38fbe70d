"""Fixtures for tests/ray: one local single-node Ray per test module (ray-notes §4, §5).

Ray starts before any test initialises JAX (fork safety), with explicit CPUs and object store,
no dashboard, token auth off, and a known metrics export port with a 1 s report interval so a
test can read `ray_diloco_*` from the node's Prometheus endpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import pytest

from tests.cluster_helpers import free_port, patient_node_start, prepare_ray_env


class LocalRay(NamedTuple):
    namespace: str
    metrics_export_port: int


@pytest.fixture(scope="module")
def ray_local(request: pytest.FixtureRequest) -> Iterator[LocalRay]:
    prepare_ray_env()
    import ray

    if ray.is_initialized():  # a previous module leaked its Ray; never connect to it
        ray.shutdown()
    namespace = "diloco-test-" + request.module.__name__.rsplit(".", 1)[-1]
    port = free_port()
    with patient_node_start(minimal_agent=False):  # a busy machine registers nodes slowly
        ray.init(
            address="local",  # always a fresh instance, whatever /tmp/ray/ray_current_cluster says
            num_cpus=4,
            object_store_memory=200 * 10**6,
            include_dashboard=False,
            namespace=namespace,
            _metrics_export_port=port,
            _system_config={"metrics_report_interval_ms": 1000},
        )
    try:
        yield LocalRay(namespace, port)
    finally:
        ray.shutdown()
