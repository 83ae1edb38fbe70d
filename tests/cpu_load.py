"""A load generator for tests and benchmarks: N processes that keep a core busy
each, as other jobs on a shared machine or cluster node would.

Each spinner is a plain Python busy loop at normal priority that exits on its own when the
process that started it is gone (it checks its parent twice a second), so a killed test run
leaves no load behind. `pytest --cpu-load N` (tests/conftest.py) runs the tests beside N of
them; `benchmarks/recovery.py --cpu-load N` measures recovery that way.
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import TracebackType

_SPIN = """
import os, sys, time
parent = int(sys.argv[1])
while os.getppid() == parent:
    until = time.monotonic() + 0.5
    while time.monotonic() < until:
        pass
"""


class CpuLoad:
    """`with CpuLoad(n):` keeps n cores busy inside the block (n = 0: does nothing)."""

    def __init__(self, processes: int) -> None:
        if processes < 0:
            raise ValueError(f"--cpu-load {processes}: give a number of busy processes >= 0")
        self.processes = processes
        self._procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> CpuLoad:
        self._procs = [
            subprocess.Popen([sys.executable, "-c", _SPIN, str(os.getpid())])
            for _ in range(self.processes)
        ]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for p in self._procs:
            p.terminate()
        for p in self._procs:
            p.wait(timeout=10)
        self._procs = []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]
