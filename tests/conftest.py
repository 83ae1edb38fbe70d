"""Options shared by every test directory (pytest reads `pytest_addoption` only here)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.cpu_load import CpuLoad


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


@pytest.fixture(scope="session", autouse=True)
def cpu_load(request: pytest.FixtureRequest) -> Iterator[CpuLoad]:
    """The `--cpu-load N` busy processes, for the whole session (none by default)."""
    with CpuLoad(int(request.config.getoption("--cpu-load"))) as load:
        yield load
