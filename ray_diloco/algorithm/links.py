"""Layer: algorithm (pure, no Ray). Emulated WAN links between regions and the synchronizer.

Each region may declare a link (bandwidth, latency) to the synchronizer's region. A link is a
pair of serial pipes (up: learner to synchronizer, down: synchronizer to learner): a transfer
starts when the pipe is free, occupies it for `bytes / bandwidth`, and arrives `latency` later.
Queueing is what makes a slow link hurt: transfers back up, contributions arrive stale and
barriers wait. Regions without a link are local: transfers are instantaneous. The reference
run uses it on its virtual clock, the Ray actors on the wall clock, so both see the same WAN.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from ray_diloco.config import LinkConfig

Direction = Literal["up", "down"]


def link_seconds(link: LinkConfig | None, nbytes: int) -> float:
    """Time one transfer takes on an idle link (0 when there is no link)."""
    if link is None:
        return 0.0
    return nbytes * 8 / (link.bandwidth_gbps * 1e9) + link.latency_ms / 1e3


class LinkEmulator:
    def __init__(self, links: Mapping[str, LinkConfig]) -> None:
        self.links = dict(links)
        self._free_at: dict[tuple[str, Direction], float] = {}

    def arrival(self, region: str, direction: Direction, nbytes: int, now: float) -> float:
        """Reserve the pipe for a transfer starting at `now`; returns when it arrives."""
        link = self.links.get(region)
        if link is None:
            return now
        key = (region, direction)
        start = max(now, self._free_at.get(key, now))
        self._free_at[key] = start + nbytes * 8 / (link.bandwidth_gbps * 1e9)
        return self._free_at[key] + link.latency_ms / 1e3
