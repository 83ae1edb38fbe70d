"""The progress line shows what the driver measured, goodput and recovery included."""

from __future__ import annotations

from ray_diloco.report import progress_line


def test_progress_line_shows_goodput_uptime_restarts_and_recovery():
    point = {
        "tokens": 120_000,
        "t": 42.0,
        "rounds": 17,
        "goodput": 0.8123,
        "uptime": 1.0,
        "restarts": {"a": 0, "b": 2},
        "recovery": {"kill_host": 6.25, "straggler": None},
    }
    line = progress_line(point, 1_000_000)
    assert "tokens 120k/1M" in line and "goodput 0.812" in line and "uptime 1.000" in line
    assert "restarts b:2" in line and "a:0" not in line
    assert "recovered in [kill_host:6.2s]" in line and "straggler" not in line
