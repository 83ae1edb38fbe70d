"""How the suite is split over its pytest-xdist workers (tests/conftest.py hooks this in).

A work unit goes to one worker and runs there in one piece: test_faults is a unit (its own
emulated cluster, started once), the other chaos modules, which share one emulated cluster
(tests/chaos/conftest.py's `tpu_cluster`), are one, the tests/ray modules that share one
embedded Ray (tests/ray/conftest.py's `ray_local`) are one, and every other module is one.
Units are handed out longest first, so the two long ones start at once on the two workers and
the short ones fill the gaps at the end (list scheduling, longest first).

The order matters at the end too: xdist gives a worker its next unit as soon as its current one
has two tests left (it needs the next test to tear the last one down), so a long unit handed out
late waits behind the worker's last two tests while the other worker runs dry.

This replaces `--dist loadgroup` with markers added at collection: xdist 3.8 groups by renaming
`item._nodeid`, which pytest 9.2 no longer reads (it reads `item._id`), so every test became a
unit of its own. The chaos modules' clusters were then started on both workers, side by side
and more than once (measured in a clean-clone run: two setups each of the test_faults and
test_tpu_placement clusters, 18-43 s apiece).
"""

from __future__ import annotations

import pytest
from xdist.scheduler import LoadScopeScheduling

SHARED_RAY = "tests/ray/ (shared Ray)"
# tests/chaos modules that share one emulated cluster (tests/chaos/conftest.py's `tpu_cluster`):
# short runs that leave the cluster as they found it. test_faults keeps a cluster of its own:
# its kills and node removals would leave these a cluster of replaced hosts, and it is long
# enough on its own.
SHARED_CLUSTER = "tests/chaos/ (shared cluster)"
SHARED_CLUSTER_MODULES = ("test_scavenging.py", "test_tpu_placement.py")
# tests/ray modules that start a Ray of their own (a job server, a dashboard, a cluster from
# the job files, an embedded Ray whose first node fails): nothing to share, so each is a unit
# that can run beside the shared one.
OWN_RAY = (
    "test_embedded_start.py",
    "test_job_server.py",
    "test_monitoring.py",
    "test_plan_emulated.py",
)
# The longest units, longest first (a clean-clone suite run, 2 cores, seconds of one worker from
# per-test start and end times): the shared-Ray modules 542 and test_faults 388 (one to each
# worker), the quick benchmarks 86, test_scavenging with test_tpu_placement 83 (the cluster start
# they share included), monitoring 57, the embedded start 53, the emulated plans 36, the job
# server 35. Every other unit follows in collection order.
LONGEST_FIRST = (
    SHARED_RAY,
    "tests/chaos/test_faults.py",
    "tests/unit/test_benchmarks.py",
    SHARED_CLUSTER,
    "tests/ray/test_monitoring.py",
    "tests/ray/test_embedded_start.py",
    "tests/ray/test_plan_emulated.py",
    "tests/ray/test_job_server.py",
)


def unit_of(nodeid: str) -> str:
    """The work unit of the test `nodeid`: its module, `SHARED_RAY` or `SHARED_CLUSTER`."""
    module = nodeid.split("::", 1)[0]
    name = module.rsplit("/", 1)[-1]
    if module.startswith("tests/ray/") and name not in OWN_RAY:
        return SHARED_RAY
    if module.startswith("tests/chaos/") and name in SHARED_CLUSTER_MODULES:
        return SHARED_CLUSTER
    return module


class SuiteScheduling(LoadScopeScheduling):
    """`--dist loadscope` with the units of `unit_of`."""

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)


def longest_first(items: list[pytest.Item]) -> None:
    """Reorder `items` in place (stably, so units stay whole) so the `LONGEST_FIRST` units are
    collected, hence scheduled (`--no-loadscope-reorder`), first and in that order."""

    def rank(item: pytest.Item) -> int:
        unit = unit_of(item.nodeid)
        return LONGEST_FIRST.index(unit) if unit in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)
