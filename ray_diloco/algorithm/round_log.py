"""Layer: algorithm (pure, no Ray, no arrays). The synchronizer's append-only round log.

A checkpoint holds a shard's whole state (values, outer momentum, books) but is written only
every `checkpoint_every_rounds` rounds. Between two checkpoints every committed round appends
one small line here, before its publication leaves the process: the fragment, the version it
produced, each contribution's learner, incarnation, base version, steps, tokens and step, and
the contributors' cursors. A restored shard replays the lines past its checkpoint up to the
version it adopts (the newest one a live learner holds: the values themselves are never in the
log), which makes the token ledger and each fragment's merge bookkeeping what they were, without
a checkpoint per round. A line is a few hundred bytes; `compact` drops the lines a checkpoint
covers. Lines are flushed to the operating system, so they survive the process (not its node).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from ray_diloco.algorithm.round_types import RoundClose

logger = logging.getLogger(__name__)

FILE_NAME = "rounds.jsonl"


@dataclass(frozen=True)
class Merged:
    """One contribution a round merged (the counters the ledger and the round book need)."""

    learner: str
    incarnation: int
    base_version: int
    num_steps: int
    num_tokens: int
    step: int


@dataclass(frozen=True)
class LoggedRound:
    fragment: int
    version: int
    contributions: tuple[Merged, ...]
    cursors: dict[str, int]  # the contributors' cursors in the ledger at the commit

    @property
    def tokens(self) -> int:
        return sum(c.num_tokens for c in self.contributions)

    @classmethod
    def of(cls, close: RoundClose, cursors: Mapping[str, int]) -> LoggedRound:
        merged = tuple(
            Merged(
                c.meta.learner,
                c.meta.incarnation,
                c.meta.base_version,
                c.num_steps,
                c.num_tokens,
                c.meta.step,
            )
            for c in close.contributions
        )
        return cls(close.fragment, close.version, merged, dict(cursors))

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> LoggedRound:
        raw = json.loads(line)
        merged = tuple(Merged(**c) for c in raw["contributions"])
        cursors = {str(k): int(v) for k, v in raw["cursors"].items()}
        return cls(int(raw["fragment"]), int(raw["version"]), merged, cursors)


class RoundLog:
    def __init__(self, directory: str | Path) -> None:
        self.path = Path(directory) / FILE_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # appends (round thread) and compaction (checkpoints)
        self._fh = open(self.path, "a")  # noqa: SIM115 (held open: one line per round)

    def append(self, entry: LoggedRound) -> None:
        """Record a committed round; call before its publication leaves the process."""
        with self._lock:
            self._fh.write(entry.to_json() + "\n")
            self._fh.flush()

    def entries(self) -> list[LoggedRound]:
        """Every readable line, in order (a line cut short by a crash is skipped)."""
        out = []
        with open(self.path) as fh:
            for n, line in enumerate(fh, 1):
                try:
                    out.append(LoggedRound.from_json(line))
                except (ValueError, KeyError, TypeError) as err:
                    logger.warning(
                        "round log %s line %d unreadable, skipped: %s", self.path, n, err
                    )
        return out

    def compact(self, versions: Mapping[int, int]) -> None:
        """Drop the rounds a checkpoint holds (fragment -> its version there)."""
        self._rewrite(lambda e: e.version > versions.get(e.fragment, -1))

    def discard(self, fragment: int, above: int) -> None:
        """Drop the rounds of `fragment` past version `above`: a restore could not recover
        them (their values are gone), so no later restore may replay them."""
        self._rewrite(lambda e: e.fragment != fragment or e.version <= above)

    def _rewrite(self, keep_if: Callable[[LoggedRound], bool]) -> None:
        """Keep the lines `keep_if` accepts; atomic, so a crash leaves the old or the new log."""
        with self._lock:
            keep = [e for e in self.entries() if keep_if(e)]
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(e.to_json() + "\n" for e in keep))
            self._fh.close()
            os.replace(tmp, self.path)
            self._fh = open(self.path, "a")  # noqa: SIM115

    def close(self) -> None:
        self._fh.close()
