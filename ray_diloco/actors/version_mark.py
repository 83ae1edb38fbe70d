"""Layer: actors (Ray shell; this module itself is plain Python). The synchronizer's version
high-water mark: the highest version of each fragment it ever published, on disk.

Checkpoints are taken every `checkpoint_every_rounds` rounds, so a synchronizer that dies
publishes versions its checkpoint does not hold. Rewriting this small JSON file at every commit
(write to a temporary file, then an atomic rename) lets the reconstructed synchronizer number
its restored fragments above everything learners may have seen
(`SynchronizerCore.resume_versions`): versions never go backwards and the lost rounds are
counted. It lives inside the checkpoint directory (Orbax ignores files that are not step
directories), so it disappears with the checkpoints of a finished run.
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

    def update(self, versions: Mapping[int, int]) -> None:
        """Record the versions just published (call before the publication leaves)."""
        self._tmp.write_text(json.dumps({str(p): int(v) for p, v in versions.items()}))
        os.replace(self._tmp, self.path)

    def load(self) -> dict[int, int]:
        """The recorded versions; {} when there is no (readable) mark."""
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as err:
            logger.warning("ignoring unreadable version mark %s: %s", self.path, err)
            return {}
        return {int(p): int(v) for p, v in raw.items()}
