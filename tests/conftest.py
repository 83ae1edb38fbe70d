"""Options and hooks shared by every test directory (pytest reads `pytest_addoption` only here).

The suite runs on two pytest-xdist workers (`-n 2 --dist loadgroup` in pyproject.toml). Each
chaos module is a group (one emulated cluster, started once) and the Ray tests are another;
unit tests fill the gaps. One after the other the suite took 19 min on 2 cores, mostly waiting
on paced steps and boots; side by side the chaos tests also run on a busy machine every time,
as they must (issue 15). Three workers (load 13 on 2 cores, measured) were too many: a
restarted learner's boot outlasted a chaos run's budget and an embedded Ray's raylet missed
Ray's 30 s registration wait.
"""

from __future__ import annotations

import pytest

from tests.cpu_load import CpuLoad

_LOAD = pytest.StashKey[CpuLoad]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--regenerate-golden",
        action="store_true",
        default=False,
        help="recompute golden numbers in tests/fixtures (e.g. the chaos tests' fault-free "
        "reference losses, chaos_reference.json) instead of reading them",
    )
    parser.addoption(
        "--cpu-load",
        type=int,
        default=0,
        metavar="N",
        help="run the tests beside N busy processes (one busy core each), as on a shared "
        "machine: e.g. pytest tests/chaos --cpu-load 2",
    )


def pytest_configure(config: pytest.Config) -> None:
    # The `--cpu-load N` busy processes live in the controlling process for the whole session:
    # xdist workers would each start N of their own.
    if not hasattr(config, "workerinput"):
        config.stash[_LOAD] = CpuLoad(int(config.getoption("--cpu-load"))).__enter__()


def pytest_unconfigure(config: pytest.Config) -> None:
    load = config.stash.get(_LOAD, None)
    if load is not None:
        load.__exit__(None, None, None)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("chaos"):
            item.add_marker(pytest.mark.xdist_group(f"chaos-{item.module.__name__}"))
        elif item.get_closest_marker("ray"):
            item.add_marker(pytest.mark.xdist_group("ray"))
