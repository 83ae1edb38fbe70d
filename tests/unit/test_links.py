"""Emulated WAN links: serial pipes with bandwidth and latency."""

from __future__ import annotations

import pytest

from ray_diloco.algorithm.links import LinkEmulator, link_seconds, ring_allreduce_bytes
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


def test_a_cut_link_holds_transfers_until_it_is_back_and_a_slow_one_takes_longer():
    em = LinkEmulator({"eu": LinkConfig(bandwidth_gbps=1.0, latency_ms=10)})
    em.impair("eu", start=1.0, end=3.0)  # cut
    em.impair("eu", start=5.0, end=6.0, factor=4.0)  # slow
    assert em.arrival("eu", "up", 1_250_000, now=0.5) == pytest.approx(0.520)  # before
    assert em.arrival("eu", "up", 1_250_000, now=1.5) == pytest.approx(3.020)  # held
    assert em.arrival("eu", "down", 1_250_000, now=2.0) == pytest.approx(3.020)
    # queued behind the held one: starts at 3.010 (after the cut), as usual
    assert em.arrival("eu", "up", 1_250_000, now=2.5) == pytest.approx(3.030)
    assert em.arrival("eu", "up", 1_250_000, now=5.5) == pytest.approx(5.5 + 4 * 0.020)
    assert em.arrival("eu", "up", 1_250_000, now=7.0) == pytest.approx(7.020)  # healthy again
    # a region without a link: only a cut shows
    em.impair("us", start=0.0, end=2.0)
    em.impair("us", start=3.0, end=4.0, factor=10.0)
    assert em.arrival("us", "up", 10**9, now=1.0) == 2.0
    assert em.arrival("us", "up", 10**9, now=3.5) == 3.5
    with pytest.raises(ValueError):
        em.impair("eu", 0.0, 1.0, factor=0.0)


def test_a_ring_all_reduce_moves_two_m_minus_one_over_m_of_the_bytes_per_host():
    assert ring_allreduce_bytes(1000, 4) == 1500
    assert ring_allreduce_bytes(1000, 2) == 1000
    assert ring_allreduce_bytes(1000, 1) == 0  # one host has nothing to exchange
