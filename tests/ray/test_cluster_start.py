"""The test clusters' own start-up (`tests.cluster_helpers.start_cluster`): a node that is
already up and dies while a later one starts makes the whole cluster start again (CI lost
every chaos test to that once, when only the node being started was retried)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.cluster_helpers import FAST_HEALTH_CHECKS, add_cpu_host, start_cluster

pytestmark = pytest.mark.ray


def _wait_dead(cluster: Any, node_id: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = [r for r in cluster.global_state.node_table() if r["NodeID"] == node_id]
        if rows and not rows[0]["Alive"]:
            return
        time.sleep(0.2)
    raise AssertionError(f"node {node_id} not declared dead in {timeout_s} s")


@pytest.mark.timeout(180)
def test_a_node_that_dies_while_a_later_one_starts_restarts_the_whole_cluster() -> None:
    import ray

    attempts = []

    def add_hosts(cluster: Any) -> None:
        attempts.append(len(attempts) + 1)
        first = add_cpu_host(cluster, "region-a")
        if len(attempts) == 1:  # the first attempt only: it dies once it is up
            first.kill_raylet()
            _wait_dead(cluster, first.node_id)
        add_cpu_host(cluster, "region-b")  # sees the dead node, not its own death

    cluster = start_cluster("diloco-start-test", add_hosts, _system_config=FAST_HEALTH_CHECKS)
    try:
        assert attempts == [1, 2]
        alive = [n for n in ray.nodes() if n["Alive"]]
        assert len(alive) == 3 and len(ray.nodes()) == 3  # the new cluster: head and two hosts
    finally:
        ray.shutdown()
        cluster.shutdown()
