"""Layer: algorithm (pure, no Ray). How a restarted synchronizer core loses no merged round
(docs/algorithm.md section 7; docs/contracts.md): a fragment with rounds past its
checkpoint is held while the learners hand back the newest value they hold, and the round log
replays the ledger and the round book up to it. `SynchronizerCore` (sync_core.py) owns one
`Recoveries`, given the plan, round book, ledger and downstream it acts on; the global values
and publications, which a checkpoint load replaces, are passed to `finish`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ray_diloco.algorithm.downstream import Downstream, kept
from ray_diloco.algorithm.fragments import FragmentPlan
from ray_diloco.algorithm.ledger import TokenLedger
from ray_diloco.algorithm.round_log import LoggedRound
from ray_diloco.algorithm.rounds import RoundBook

Values = dict[str, np.ndarray]


@dataclass
class Recovery:
    """A fragment whose newest value is being recovered after a restart: the version the
    checkpoint holds, the newest one delivered to a learner before the restart, the logged
    rounds past the checkpoint, and the newest value a learner handed over so far."""

    restored: int
    delivered: int
    logged: list[LoggedRound]
    found: tuple[int, Values] | None = None

    @property
    def best(self) -> int:
        return self.found[0] if self.found is not None else self.restored

    @property
    def newest(self) -> int:
        return max((e.version for e in self.logged), default=self.restored)


class Recoveries:
    """The fragments of a restarted synchronizer core being recovered."""

    def __init__(
        self, plan: FragmentPlan, book: RoundBook, ledger: TokenLedger, down: Downstream
    ) -> None:
        self.plan, self.book, self.ledger, self.down = plan, book, ledger, down
        self.recovering: dict[int, Recovery] = {}

    def start(self, logged: Iterable[LoggedRound], delivered: Mapping[int, int]) -> None:
        """After a restore: `logged` are the round log's entries, `delivered` the newest
        version of each fragment a learner received before the restart. A fragment with
        rounds past its restored version is held (no round closes, offers are refused as
        recovering) until `finish` adopts the newest value a learner hands over
        (`provide`), or the restored one."""
        entries = sorted(logged, key=lambda e: e.version)
        for p, frag in self.book.fragments.items():
            mine = [e for e in entries if e.fragment == p and e.version > frag.version]
            high = delivered.get(p, 0)
            if mine or high > frag.version:
                self.recovering[p] = Recovery(frag.version, high, mine)
                self.book.held.add(p)

    def wanted(self) -> dict[int, int]:
        """Per fragment being recovered: the newest version found so far (a learner holding
        a newer one is asked for its value)."""
        return {p: r.best for p, r in self.recovering.items()}

    def provide(self, fragment: int, version: int, values: Mapping[str, Any]) -> bool:
        """A learner's value of `fragment` at `version` (the publication it holds). Taken when
        it is the newest so far and the round log has that round (its ledger entries are
        then exact). Returns True when nothing newer can exist: finish now."""
        r = self.recovering.get(fragment)
        if r is None or version <= r.best or version not in {e.version for e in r.logged}:
            return False
        paths = self.plan.fragments[fragment]
        r.found = (version, {k: np.asarray(values[k], np.float32) for k in paths})
        return version == r.newest

    def finish(
        self,
        fragment: int,
        values: dict[int, Values],
        published: dict[int, dict[int, Values]],
    ) -> tuple[int, int]:
        """Adopt the newest value found (else the restored one), replay the logged rounds up
        to it into the ledger and the round book, and release the fragment. Version numbers
        past it that may exist (delivered, or logged and perhaps delivered) are never reused:
        the value then also gets a fresh number above them. Returns (adopted version, rounds
        lost: delivered versions no learner could hand back)."""
        r = self.recovering.pop(fragment)
        self.book.held.discard(fragment)
        if r.found is not None:  # the learners' copy becomes the global value too
            adopted, value = r.found
            copy = value
        else:  # the checkpoint's global value, and the copy the learners were sent of it
            adopted, value = r.restored, values[fragment]
            copy = published[fragment].get(adopted, value)
        for e in r.logged:
            if e.version > adopted:
                break
            self.ledger.record_merged(
                fragment, [(c.learner, c.num_tokens) for c in e.contributions]
            )
            for learner, cursor in e.cursors.items():
                self.ledger.record_cursor(learner, cursor)
            merged = {
                c.learner: (c.base_version, c.num_steps, c.num_tokens) for c in e.contributions
            }
            self.book.replay(fragment, e.version, merged)
        values[fragment] = value
        # Version 0, the shared initialisation, is float32 as every learner started from it.
        hist = {adopted: kept(copy, self.down.full) if adopted else copy}
        top = max(r.delivered, r.newest)
        if top > adopted:
            # The same value under a fresh number: learners that hold `adopted` rename it.
            hist[top + 1] = hist[adopted]
            self.book.replay(fragment, top + 1, {})
        published[fragment] = hist
        self.down.forget(fragment)  # learners hold values from before: each gets it in full
        return adopted, max(0, r.delivered - adopted)
