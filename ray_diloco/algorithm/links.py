"""Layer: algorithm (pure, no Ray). Emulated WAN links between regions and the synchronizer.

Each region may declare a link (bandwidth, latency) to the synchronizer's region. A link is a
pair of serial pipes (up: learner to synchronizer, down: synchronizer to learner): a transfer
starts when the pipe is free, occupies it for `bytes / bandwidth`, and arrives `latency` later.
Queueing is what makes a slow link hurt: transfers back up, contributions arrive stale and
barriers wait. Regions without a link are local: transfers are instantaneous. The reference
run uses it on its virtual clock, the Ray actors on the wall clock, so both see the same WAN.

Chaos can impair a region's link for a while (`impair`): cut (a transfer that would start
during the outage waits until it ends, as TCP would retransmit, so a cut link delivers late,
not never) or slow (a transfer starting in the window takes `factor` times longer, latency
included; on a region without a configured link only a cut has an effect).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from ray_diloco.config import LinkConfig

Direction = Literal["up", "down"]


def ring_allreduce_bytes(nbytes: float, hosts: int) -> float:
    """Bytes each host's link carries each way when `hosts` all-reduce `nbytes` over a ring:
    a reduce-scatter and an all-gather of (hosts - 1) / hosts of them each."""
    return 2 * (hosts - 1) / hosts * nbytes if hosts > 0 else 0.0


def link_seconds(link: LinkConfig | None, nbytes: int) -> float:
    """Time one transfer takes on an idle link (0 when there is no link)."""
    if link is None:
        return 0.0
    return nbytes * 8 / (link.bandwidth_gbps * 1e9) + link.latency_ms / 1e3


@dataclass(frozen=True)
class Impairment:
    """The region's link is cut (`factor` None) or `factor` times slower in [start, end)."""

    start: float
    end: float
    factor: float | None = None


class LinkEmulator:
    def __init__(self, links: Mapping[str, LinkConfig]) -> None:
        self.links = dict(links)
        self._free_at: dict[tuple[str, Direction], float] = {}
        # Replaced, never mutated: another thread may read it while a fault is injected.
        self._impairments: tuple[tuple[str, Impairment], ...] = ()

    def impair(self, region: str, start: float, end: float, factor: float | None = None) -> None:
        """Cut (factor None) or slow down `region`'s link, both directions, in [start, end)."""
        if factor is not None and factor <= 0:
            raise ValueError(f"link slowdown factor must be > 0, got {factor}")
        self._impairments = (*self._impairments, (region, Impairment(start, end, factor)))

    def _active(self, region: str, t: float) -> list[Impairment]:
        return [i for r, i in self._impairments if r == region and i.start <= t < i.end]

    def arrival(self, region: str, direction: Direction, nbytes: int, now: float) -> float:
        """Reserve the pipe for a transfer starting at `now`; returns when it arrives."""
        link = self.links.get(region)
        key = (region, direction)
        start = max(now, self._free_at.get(key, now)) if link is not None else now
        while cuts := [i for i in self._active(region, start) if i.factor is None]:
            start = max(i.end for i in cuts)  # held until the link is back
        if link is None:
            return start
        slow = max((i.factor or 1.0 for i in self._active(region, start)), default=1.0)
        self._free_at[key] = start + slow * nbytes * 8 / (link.bandwidth_gbps * 1e9)
        return self._free_at[key] + slow * link.latency_ms / 1e3
