"""How the suite is split over its pytest-xdist workers (tests/conftest.py hooks this in).

A work unit goes to one worker and runs there in one piece: each chaos module is a unit (one
emulated cluster, started once), all of tests/ray is one (one embedded Ray at a time), and each
unit-test module is one. Units are handed out heaviest first, so the two long ones start at once
on the two workers and the small ones fill the gaps at the end.

This replaces `--dist loadgroup` with markers added at collection: xdist 3.8 groups by renaming
`item._nodeid`, which pytest 9.2 no longer reads (it reads `item._id`), so every test became a
unit of its own. The chaos modules' clusters were then started on both workers, side by side
and more than once (measured in a clean-clone run: two setups each of the test_faults and
test_tpu_placement clusters, 18-43 s apiece).
"""

from __future__ import annotations

import pytest
from xdist.scheduler import LoadScopeScheduling

RAY_DIR = "tests/ray/"
# Units that run longest, in the order they are handed out (clean-clone suite, 2 cores: about
# 740 s and 900 s of the suite's 2165 worker-seconds); every other unit follows in collection
# order.
HEAVIEST_FIRST = ("tests/chaos/test_faults.py", RAY_DIR)


class SuiteScheduling(LoadScopeScheduling):
    """`--dist loadscope` with tests/ray as one unit."""

    def _split_scope(self, nodeid: str) -> str:
        return RAY_DIR if nodeid.startswith(RAY_DIR) else super()._split_scope(nodeid)


def heaviest_first(items: list[pytest.Item]) -> None:
    """Reorder `items` in place (stably, so modules stay whole) so the `HEAVIEST_FIRST` units
    are collected, hence scheduled (`--no-loadscope-reorder`), first."""

    def rank(item: pytest.Item) -> int:
        for i, prefix in enumerate(HEAVIEST_FIRST):
            if item.nodeid.startswith(prefix):
                return i
        return len(HEAVIEST_FIRST)

    items.sort(key=rank)
