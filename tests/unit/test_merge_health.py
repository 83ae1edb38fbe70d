"""control/merge_health.py: a merge that keeps failing ends the run; one that fails now and
then does not."""

from __future__ import annotations

from ray_diloco.control.merge_health import MergeHealth

BUG = AttributeError("'OuterOptimizerConfig' object has no attribute 'warmup_rounds'")


def test_failures_in_a_row_over_a_while_report_the_error() -> None:
    health = MergeHealth(limit=3, for_s=30.0)
    for t in (0.0, 0.1, 0.2, 10.0):  # many failures, but not for long yet
        health.failed(1, BUG, now=t)
    assert health.error is None
    health.failed(0, BUG, now=31.0)
    assert health.error == (
        "the merge of fragment 0 failed 5 times in a row over 31 s: AttributeError: "
        "'OuterOptimizerConfig' object has no attribute 'warmup_rounds'"
    )
    # The first error stays, whatever happens next: the driver ends the run on it.
    health.succeeded()
    health.failed(2, ValueError("later"), now=99.0)
    assert health.error is not None and "fragment 0" in health.error


def test_a_success_starts_the_count_and_the_clock_over() -> None:
    health = MergeHealth(limit=3, for_s=30.0)
    health.failed(0, MemoryError(), now=0.0)
    health.failed(0, MemoryError(), now=1.0)
    health.succeeded()  # a passing fault
    for t in (35.0, 40.0, 60.0):  # three in a row, but only 25 s since the first of them
        health.failed(1, MemoryError(), now=t)
    assert health.error is None
    health.failed(1, MemoryError(), now=65.0)
    assert health.error is not None and "4 times in a row over 30 s" in health.error


def test_a_failing_merge_is_retried_at_the_retry_pace_not_at_every_wake() -> None:
    health = MergeHealth(retry_s=0.1)
    assert health.retry_due(now=0.0)  # no failure yet: merge whenever woken
    health.failed(0, MemoryError(), now=5.0)
    assert not health.retry_due(now=5.05)  # an offer woke the round thread: not yet
    assert health.retry_due(now=5.2)
    health.failed(0, MemoryError(), now=5.2)
    health.succeeded()
    assert health.retry_due(now=5.2)
