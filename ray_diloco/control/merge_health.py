"""Layer: control (pure Python; no Ray, no JAX). Whether a synchronizer shard can still merge.

A merge that raises puts its round back (`runtime/synchronizer/rounds.py`), so a passing fault costs
a retry. A merge that fails every time is a bug (a config the shard cannot read, a task whose values
break the outer step): the learners would train on to the token budget with nothing merged, and the
run would end looking finished, at its initial loss. Once merges have failed `limit` times in a row,
of any fragment, for at least `for_s` seconds, the shard reports the error in its status and the
driver stops the run with it as the stop reason (the train command then exits 1: the budget was not
reached).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MergeHealth:
    """Failed merges in a row since `since` (a clock reading), the last at `last`; `error`
    once they count `limit` over `for_s` seconds. The error stays: the run ends on it."""

    limit: int = 5
    for_s: float = 30.0
    retry_s: float = 0.1
    in_a_row: int = 0
    since: float | None = None
    last: float | None = None
    error: str | None = None

    def retry_due(self, now: float) -> bool:
        """Whether rounds may be merged now: always outside a streak of failures, and
        `retry_s` after the last failure within one. Every offer wakes the round thread, so
        a merge that fails every time was retried at the rate offers came (about 30 a second
        with two learners)."""
        return self.last is None or now - self.last >= self.retry_s

    def failed(self, fragment: int, err: BaseException, now: float) -> None:
        self.in_a_row += 1
        self.since = now if self.since is None else self.since
        self.last = now
        lasting = now - self.since >= self.for_s
        if self.in_a_row >= self.limit and lasting and self.error is None:
            self.error = (
                f"the merge of fragment {fragment} failed {self.in_a_row} times in a row over "
                f"{now - self.since:.0f} s: {type(err).__name__}: {err}"
            )

    def succeeded(self) -> None:
        self.in_a_row, self.since, self.last = 0, None, None
