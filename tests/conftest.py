"""Options and hooks shared by every test directory (pytest reads `pytest_addoption` only here).

The suite runs on two pytest-xdist workers (`-n 2` in pyproject.toml), split as
tests/xdist_scopes.py says: the chaos modules are two units (one emulated cluster each,
started once), the Ray tests that share one Ray are another, and the short modules fill the
gaps. One after the other the suite took 19 min on 2 cores, mostly waiting on paced steps and
boots; side by side the chaos tests also run on a busy machine every time, as they must.
Three workers (load 13 on 2 cores, measured) were too many: a restarted learner's boot
outlasted a chaos run's budget and an embedded Ray's raylet missed Ray's 30 s registration
wait.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import pytest

from tests.cpu_load import CpuLoad
from tests.xdist_scopes import SuiteScheduling, longest_first

_LOAD = pytest.StashKey[CpuLoad]()
TEST_DEVICES = 8
_CACHE = pytest.StashKey[str]()


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
    # xdist workers would each start N of their own. So does the compilation cache, which the
    # workers (started after this hook) inherit through the environment.
    if not hasattr(config, "workerinput"):
        # Every test process (the xdist workers inherit it) has 8 CPU devices, so the sharded
        # learner is tested over a real mesh in-process; a learner whose config has one
        # device still takes one (setup.learner_layout), and Ray hosts get their own count.
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            count = f"--xla_force_host_platform_device_count={TEST_DEVICES}"
            os.environ["XLA_FLAGS"] = f"{flags} {count}".strip()
        config.stash[_LOAD] = CpuLoad(int(config.getoption("--cpu-load"))).__enter__()
        if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
            config.stash[_CACHE] = _share_compilation_cache()


def _share_compilation_cache() -> str:
    """One JAX compilation cache for every run of the session: `JAX_COMPILATION_CACHE_DIR`,
    which Ray's workers inherit and `use_compilation_cache` prefers to the run's own. The Ray
    and chaos runs compile the same few programs; a tiny reference run took 12.5 s cold and
    3.7 s warm beside the suite on 2 cores, and each learner boot pays the cold compile."""
    directory = tempfile.mkdtemp(prefix="ray_diloco-test-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = directory
    # Every program, however small or quick to compile, as `use_compilation_cache` keeps them:
    # JAX's defaults (1 s, any size) skip the tiny programs that the test processes compile
    # again for every run (in-process reference runs, the driver's `check_task`): a run builds
    # fresh closures, so JAX's in-memory cache misses where this one hits. Unit tests that ran
    # 73 s one after the other took 33 s on a warm cache.
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    return directory


def pytest_unconfigure(config: pytest.Config) -> None:
    load = config.stash.get(_LOAD, None)
    if load is not None:
        load.__exit__(None, None, None)
    cache = config.stash.get(_CACHE, None)
    if cache is not None:
        shutil.rmtree(cache, ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    longest_first(items)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, unknown to a run without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> SuiteScheduling:
    return SuiteScheduling(config, log)
