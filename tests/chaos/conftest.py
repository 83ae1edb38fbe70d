"""Fixtures for tests/chaos: a local multi-node Ray cluster with emulated TPU slices.

One cluster per work unit (tests/xdist_scopes.py), `tests.cluster_helpers.start_tpu_cluster`:
a CPU-only head, two hosts of v5p slice "slice-v5p" (v5p-16, topology 2x2x2) in us-east5 and
two 4-chip hosts of v6e slice "slice-v6e" (v6e-8, topology 2x4) in europe-west4, a killed host
declared dead in about 1.5 s. test_faults has one of its own; the modules of
`SHARED_CLUSTER` run one after the other on one worker and the later ones reuse the cluster
the first started (a start took 20-32 s of the worker's time in suite runs). A test that
removes a host adds it back (`tpu_cluster.add_slice_host`) before it ends, so the next test,
in this module or the next, finds the cluster whole. The last test of a unit shuts it down.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.cluster_helpers import TpuCluster, start_tpu_cluster
from tests.xdist_scopes import unit_of

NAMESPACE = "diloco-chaos"

# This worker's cluster (xdist workers are processes of their own) and the unit it serves.
_shared: tuple[str, TpuCluster] | None = None


def _shutdown() -> None:
    global _shared
    if _shared is None:
        return
    import ray

    _, tpu = _shared
    _shared = None
    ray.shutdown()
    tpu.cluster.shutdown()


@pytest.hookimpl(trylast=True)  # after the test's own fixtures are torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Leaving a unit: its cluster goes down, so no Ray stays initialised in this process for
    the tests that follow on the worker."""
    if _shared is not None and (nextitem is None or unit_of(nextitem.nodeid) != _shared[0]):
        _shutdown()


def pytest_sessionfinish(session: pytest.Session) -> None:
    _shutdown()  # a session that stopped early (-x, an interrupt) leaves no cluster running


@pytest.fixture(scope="module")
def tpu_cluster(request: pytest.FixtureRequest) -> Iterator[TpuCluster]:
    global _shared
    unit = unit_of(request.node.nodeid)
    if _shared is not None and _shared[0] != unit:  # another unit's, never reused
        _shutdown()
    if _shared is None:
        _shared = (unit, start_tpu_cluster(NAMESPACE))
    yield _shared[1]
