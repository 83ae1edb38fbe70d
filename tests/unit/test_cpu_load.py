"""The load generator behind `pytest --cpu-load N` keeps cores busy and leaves nothing behind."""

from __future__ import annotations

import time

import psutil
import pytest

from tests.cpu_load import CpuLoad


def test_spinners_burn_cpu_and_stop_with_the_block() -> None:
    with CpuLoad(1) as load:
        (pid,) = load.pids
        proc = psutil.Process(pid)
        # Spinning, even on a loaded machine: it may wait its turn for a core (a run with
        # three busy processes beside it under `nice` got under 0.05 s of CPU in its first 1 s).
        deadline = time.monotonic() + 20.0
        while (busy := proc.cpu_times().user) <= 0.05 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert busy > 0.05, busy
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_no_load_starts_nothing_and_a_negative_count_is_refused() -> None:
    with CpuLoad(0) as load:
        assert load.pids == []
    with pytest.raises(ValueError, match="--cpu-load -1"):
        CpuLoad(-1)
