"""Fixtures for tests/ray: a local single-node Ray shared by the modules that use `ray_local`
(ray-notes §4, §5).

Ray starts before any test initialises JAX (fork safety), with explicit CPUs and object store,
no dashboard, token auth off, and a known metrics export port with a 1 s report interval so a
test can read `ray_diloco_*` from the node's Prometheus endpoint.

The modules that use it run one after the other on one xdist worker (tests/xdist_scopes.py),
so a module reuses the Ray the previous one left running: starting one took 7-10 s of the
worker's time in a suite run, six times. A module that leaves an actor, a placement group or
a taken CPU behind shuts it down, so the next one starts clean. The last test of that unit
shuts it down; the modules that start a Ray of their own (a job server, a dashboard, a cluster
from files) are units of their own.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import NamedTuple

import pytest

from tests.cluster_helpers import free_port, patient_node_start, prepare_ray_env
from tests.xdist_scopes import SHARED_RAY, unit_of

NAMESPACE = "diloco-test-ray"


class LocalRay(NamedTuple):
    namespace: str
    metrics_export_port: int
    gcs_address: str


def _running(local: LocalRay | None) -> bool:
    import ray

    return (
        local is not None
        and ray.is_initialized()
        and ray.get_runtime_context().gcs_address == local.gcs_address
    )


def _left_behind(timeout_s: float = 3.0) -> list[str]:
    """What a module left behind: named actors still alive, placement groups not removed,
    CPUs still taken (by an unnamed actor). Waits up to `timeout_s` for it to clear: an actor
    killed by the module's last test gives its CPU back a moment later."""
    import ray
    from ray.util import placement_group_table

    deadline = time.monotonic() + timeout_s
    while True:
        named = ray.util.list_named_actors(all_namespaces=True)
        groups = [i for i, pg in placement_group_table().items() if pg["state"] != "REMOVED"]
        taken = ray.cluster_resources().get("CPU", 0) - ray.available_resources().get("CPU", 0)
        left = [f"actor {a['name']}" for a in named] + [f"placement group {i}" for i in groups]
        left += [f"{taken} CPUs"] if taken else []
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


# This worker's shared Ray (xdist workers are processes of their own).
_shared: LocalRay | None = None


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Leaving the shared-Ray unit: no Ray stays initialised in this process for the tests that
    follow on the worker (a unit test checks that metrics are no-ops without Ray)."""
    leaving = nextitem is None or unit_of(nextitem.nodeid) != SHARED_RAY
    if unit_of(item.nodeid) == SHARED_RAY and leaving:
        import ray

        ray.shutdown()


@pytest.fixture(scope="module")
def ray_local() -> Iterator[LocalRay]:
    global _shared
    prepare_ray_env()
    import ray

    from ray_diloco.runtime.driver import ONE_NODE_HEALTH_CHECKS

    if not _running(_shared):
        if ray.is_initialized():  # someone else's Ray; never connect to it
            ray.shutdown()
        port = free_port()
        with patient_node_start(minimal_agent=False):  # a busy machine registers nodes slowly
            context = ray.init(
                address="local",  # a fresh instance, whatever /tmp/ray/ray_current_cluster says
                num_cpus=4,
                object_store_memory=200 * 10**6,
                include_dashboard=False,
                namespace=NAMESPACE,
                _metrics_export_port=port,
                _system_config={"metrics_report_interval_ms": 1000, **ONE_NODE_HEALTH_CHECKS},
            )
        _shared = LocalRay(NAMESPACE, port, context.address_info["gcs_address"])
    yield _shared
    if _running(_shared) and _left_behind():
        ray.shutdown()
