"""Layer: algorithm (pure, no Ray). The published versions a contribution can still be based on.

A learner's offer is a delta relative to the version of the fragment it last adopted (its
base), so the synchronizer keeps, per fragment, every published value some learner may still
be based on: version 0 (the shared initialisation every learner starts from, exactly) and the
versions since. Per learner it tracks the oldest version its offers can still be based on: the
one it adopted on registering, then that of its newest accepted offer (a learner's base only
moves forward). A version older than every learner's possible base is dropped; so is one past
`max_staleness_versions`, whose offers would be refused anyway. The newest always stays.

A restore that fell back to an older value publishes it again under a fresh number, the same
object under both (`sync_recovery.py`): `base` answers for the old number with the newest one
naming that value.
"""

from __future__ import annotations

from collections.abc import Mapping

from ray_diloco.algorithm.sync_recovery import Values


class VersionHistory:
    def __init__(self, initial: Mapping[int, Values]) -> None:
        """`initial`: version 0 of every fragment this history keeps."""
        self.published: dict[int, dict[int, Values]] = {p: {0: v} for p, v in initial.items()}
        self.bases: dict[int, dict[str, int]] = {p: {} for p in initial}

    def newest(self, fragment: int) -> tuple[int, Values]:
        hist = self.published[fragment]
        v = max(hist)
        return v, hist[v]

    def snapshot(self) -> dict[int, tuple[int, Values]]:
        """The newest version of every fragment: what a (re)joining learner adopts."""
        return {p: self.newest(p) for p in self.published}

    def adopt(self, learner: str, versions: Mapping[int, int]) -> None:
        """`learner` (re)registered holding `versions`: its offers are based on them on."""
        for p, v in versions.items():
            self.bases[p][learner] = v

    def leave(self, learner: str) -> None:
        for bases in self.bases.values():
            bases.pop(learner, None)

    def base(self, fragment: int, version: int) -> tuple[int, Values] | None:
        """The value of `version` and the newest number naming it, or None when it is not kept
        (older than the history, or never published)."""
        hist = self.published[fragment]
        value = hist.get(version)
        if value is None:
            return None
        return max(v for v, values in hist.items() if values is value), value

    def holds(self, fragment: int, version: int) -> bool:
        return version in self.published[fragment]

    def accepted(self, fragment: int, learner: str, version: int) -> None:
        """An offer of `learner` on `version` was accepted: its base moves up to it."""
        bases = self.bases[fragment]
        bases[learner] = max(bases.get(learner, 0), version)

    def add(self, fragment: int, version: int, value: Values, max_staleness: int) -> None:
        """Keep `value` as `version`, dropping the versions more than `max_staleness` behind.
        Swaps the fragment's whole dict, so a concurrent reader sees the old or the new one."""
        hist = dict(self.published[fragment])
        hist[version] = value
        for v in [v for v in hist if v < version - max_staleness]:
            del hist[v]
        self.published[fragment] = hist

    def drop_unreachable(self, fragment: int) -> None:
        """Drop the versions older than every learner's possible base (the newest stays)."""
        hist = self.published[fragment]
        floor = min(min(self.bases[fragment].values(), default=max(hist)), max(hist))
        if any(v < floor for v in hist):
            self.published[fragment] = {v: q for v, q in hist.items() if v >= floor}
