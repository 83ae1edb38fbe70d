"""Emulated WAN links: serial pipes with bandwidth and latency."""

from __future__ import annotations

import pytest

from ray_diloco.algorithm.links import LinkEmulator, link_seconds
from ray_diloco.config import LinkConfig


def test_transfers_on_one_pipe_queue_and_directions_are_independent():
    # 1 Gbps, 10 ms: 1.25 MB takes 10 ms on the wire + 10 ms latency
    em = LinkEmulator({"eu": LinkConfig(bandwidth_gbps=1.0, latency_ms=10)})
    assert em.arrival("eu", "up", 1_250_000, now=0.0) == pytest.approx(0.020)
    assert em.arrival("eu", "up", 1_250_000, now=0.0) == pytest.approx(0.030)  # queued
    assert em.arrival("eu", "down", 1_250_000, now=0.0) == pytest.approx(0.020)
    assert em.arrival("eu", "up", 1_250_000, now=1.0) == pytest.approx(1.020)  # idle again
    assert em.arrival("us", "up", 10**9, now=2.0) == 2.0  # no link: local
    assert link_seconds(None, 10) == 0.0
    assert link_seconds(LinkConfig(bandwidth_gbps=8e-9), 1) == pytest.approx(1.0)
