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
        time.sleep(1.0)
        busy = proc.cpu_times().user
        assert busy > 0.05, busy  # spinning, even on a loaded machine
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_no_load_starts_nothing_and_a_negative_count_is_refused() -> None:
    with CpuLoad(0) as load:
        assert load.pids == []
    with pytest.raises(ValueError, match="--cpu-load -1"):
        CpuLoad(-1)
