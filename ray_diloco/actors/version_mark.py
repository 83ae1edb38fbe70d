"""Layer: actors (Ray shell; this module itself is plain Python). The synchronizer's
high-water marks, on disk: the highest version of each fragment it ever published, and how far
into each part of the data it ever leased (algorithm/leases.py).

Checkpoints are taken every `checkpoint_every_rounds` rounds, so a synchronizer that dies
publishes versions its checkpoint does not hold. Rewriting this small JSON file at every commit
(write to a temporary file, then an atomic rename) lets the reconstructed synchronizer number
its restored fragments above everything learners may have seen
(`SynchronizerCore.resume_versions`): versions never go backwards and the lost rounds are
counted; restoring the data pool's frontiers to the mark means no range handed out after the
checkpoint is ever handed out again. It lives inside the checkpoint directory (Orbax ignores
files that are not step directories), so it disappears with the checkpoints of a finished run.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path

logger = logging.getLogger(__name__)

FILE_NAME = "versions.json"


class VersionMark:
    def __init__(self, directory: str | Path) -> None:
        self.path = Path(directory) / FILE_NAME
        self._tmp = self.path.with_suffix(".tmp")
        self._versions, self._frontier = self.load()

    def update(
        self, versions: Mapping[int, int] | None = None, frontier: list[int] | None = None
    ) -> None:
        """Record the versions just published (call before the publication leaves) and/or
        the data pool's frontiers (call before the leases leave)."""
        if versions is not None:
            self._versions = {int(p): int(v) for p, v in versions.items()}
        if frontier is not None:
            self._frontier = [int(f) for f in frontier]
        mark = {"versions": {str(p): v for p, v in self._versions.items()}}
        self._tmp.write_text(json.dumps(mark | {"frontier": self._frontier}))
        os.replace(self._tmp, self.path)

    def load(self) -> tuple[dict[int, int], list[int]]:
        """The recorded versions and frontiers; empty when there is no (readable) mark."""
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}, []
        except (OSError, ValueError) as err:
            logger.warning("ignoring unreadable version mark %s: %s", self.path, err)
            return {}, []
        return {int(p): int(v) for p, v in raw["versions"].items()}, raw.get("frontier", [])
