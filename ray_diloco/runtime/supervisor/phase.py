"""Layer: runtime (Ray shell). Whether the run is ending, as the supervisor and its parts see it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RunPhase:
    """Shared by the supervisor, its health and its membership logic (one object, one truth)."""

    finish: str | None = None  # the driver asked the run to finish, for this reason
    over: bool = False  # the synchronizer reports the token budget spent

    @property
    def ending(self) -> bool:
        """Nobody joins, leaves or restarts any more."""
        return self.finish is not None or self.over
