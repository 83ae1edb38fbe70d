"""The emulated-link scheduler (control/delay.py): plain threads, no Ray."""

from __future__ import annotations

import threading
import time

import pytest

from ray_diloco.control.delay import DelayedCalls


@pytest.mark.timeout(10)
def test_calls_run_in_due_order_after_their_delay():
    calls = DelayedCalls("test-link")
    done: list[tuple[str, float]] = []
    finished = threading.Event()
    t0 = time.monotonic()

    def record(tag: str) -> None:
        done.append((tag, time.monotonic() - t0))
        if len(done) == 3:
            finished.set()

    calls.call_later(0.2, lambda: record("slow"))
    calls.call_later(0.0, lambda: record("now"))
    calls.call_later(0.1, lambda: record("mid"))
    assert finished.wait(5)
    assert [tag for tag, _ in done] == ["now", "mid", "slow"]
    assert done[1][1] >= 0.1 and done[2][1] >= 0.2
    calls.close()


@pytest.mark.timeout(10)
def test_a_failing_call_does_not_stop_the_thread_and_close_drops_late_calls():
    calls = DelayedCalls("test-link")
    ran = threading.Event()

    def boom() -> None:
        raise RuntimeError("transfer failed")

    calls.call_later(0.0, boom)
    calls.call_later(0.0, ran.set)
    assert ran.wait(5)
    late = threading.Event()
    calls.call_later(30.0, late.set)
    start = time.monotonic()
    calls.close(drain_s=0.1)
    assert time.monotonic() - start < 2 and not late.is_set()
    calls.call_later(0.0, late.set)  # closed: dropped
    assert calls.pending() == 0
