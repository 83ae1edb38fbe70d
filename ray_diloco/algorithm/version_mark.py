"""Layer: algorithm (pure Python, no Ray). A synchronizer shard's
high-water marks, on disk: the newest version of each fragment a learner received, how far
into each part of the data it ever leased and who held leases then (algorithm/leases.py).

Checkpoints lag the rounds, so a shard that dies has delivered versions its checkpoint does
not hold. Rewriting this small JSON file at every delivery and lease (write to a temporary
file, then an atomic rename) tells the reconstructed shard which fragments to recover from the
learners and which numbers are taken (`SynchronizerCore.start_recovery`: versions never go
backwards); restoring the data pool with the mark (`DataPool.restore_mark`) means a range handed
out after the checkpoint is handed out again only once nobody can hold it. It lives inside
the checkpoint directory (Orbax ignores files that are not step directories), so it disappears
with the checkpoints of a finished run.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

FILE_NAME = "versions.json"


@dataclass
class Mark:
    versions: dict[int, int] = field(default_factory=dict)  # fragment -> newest delivered
    frontier: list[int] = field(default_factory=list)  # per data part: first token never leased
    holders: list[str] = field(default_factory=list)  # learners holding leases


class VersionMark:
    def __init__(self, directory: str | Path) -> None:
        self.path = Path(directory) / FILE_NAME
        self._tmp = self.path.with_suffix(".tmp")
        self._mark = self.load()

    def update(
        self,
        versions: Mapping[int, int] | None = None,
        frontier: list[int] | None = None,
        holders: list[str] | None = None,
    ) -> None:
        """Record the newest versions of some fragments (the others keep theirs) and/or the
        data pool's frontiers and holders (call before leases leave, and at a leave)."""
        m = self._mark
        if versions is not None:
            m.versions |= {int(p): int(v) for p, v in versions.items()}
        if frontier is not None:
            m.frontier = [int(f) for f in frontier]
        if holders is not None:
            m.holders = sorted(holders)
        versions_out = {str(p): v for p, v in m.versions.items()}
        body = {"versions": versions_out, "frontier": m.frontier, "holders": m.holders}
        self._tmp.write_text(json.dumps(body))
        os.replace(self._tmp, self.path)

    def load(self) -> Mark:
        """The recorded mark; empty when there is no (readable) mark."""
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return Mark()
        except (OSError, ValueError) as err:
            logger.warning("ignoring unreadable version mark %s: %s", self.path, err)
            return Mark()
        versions = {int(p): int(v) for p, v in raw["versions"].items()}
        return Mark(versions, raw.get("frontier", []), raw.get("holders", []))
