"""Options shared by every test directory (pytest reads `pytest_addoption` only here)."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--regenerate-golden",
        action="store_true",
        default=False,
        help="recompute golden numbers in tests/fixtures (e.g. the chaos tests' fault-free "
        "reference losses, chaos_reference.json) instead of reading them",
    )
