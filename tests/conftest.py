"""Shared pytest setup: make the repository importable without installing it.

`pytest` run from the repository root puts only the test directories on sys.path (rootdir
conftest handling), so `import ray_diloco` would fail unless the package is installed; the
repository root is prepended here so a fresh checkout tests with a bare `pytest`.
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
