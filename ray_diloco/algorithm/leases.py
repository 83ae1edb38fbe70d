"""Layer: algorithm (pure, no Ray, no arrays). Training data handed out in leases from one pool,
so learners can join and leave a running job and every token is still read exactly once.

The task's data (ray_diloco/task.py) is cut into `num_parts` disjoint, identically distributed,
endless parts. A *lease* is a range of token offsets of one part. The pool (owned by the
synchronizer's token ledger, so it is checkpointed and restored with it) keeps, per part, the
frontier (the first token nobody leased yet) and the ranges given back by learners that left;
per learner, the leases it holds in reading order and its cursor (tokens it consumed, across
incarnations, the number its progress reports carry).

Rules, in this order, when a learner needs more data:
  1. ranges given back (a departed learner's unread rest) go first;
  2. a learner with a home part (the starting learners: learner i reads part i) continues it,
     so a run whose learners never change reads exactly the fixed shards of a static run;
  3. a learner without one (it joined later) takes the least advanced part.
A restarted learner keeps its leases (it resumes at its cursor); a learner that leaves gives
back what it has not consumed. `check()` proves the books: per part, consumed, held, returned
and doubtful ranges are disjoint and cover everything below the frontier.

A synchronizer that restarts from a checkpoint knows the pool as it was then, and a small mark
(`restore_mark`: the frontiers and holders persisted whenever leases leave the process) of what
happened since. Ranges leased after the checkpoint are *in doubt*: a learner that survived holds
them and states so when it registers again (`reclaim`), one that died with the run never reads
them. They are handed out again (as returned ranges) only once every learner of the mark has
registered or left, so no token is read twice and none is lost.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

ENDLESS = 1 << 62  # the end of a lease that never ends (data-parallel reads one part whole)


@dataclass(frozen=True)
class Lease:
    """Tokens [start, end) of part `part` of the task's data."""

    part: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.part, self.start, self.end)


@dataclass
class _Holder:
    leases: deque[Lease] = field(default_factory=deque)
    cursor: int = 0  # tokens consumed by this learner, ever
    base: int = 0  # the cursor value at the start of leases[0]
    home: int | None = None


class DataPool:
    def __init__(self, num_parts: int, lease_tokens: int, ahead_leases: int = 2) -> None:
        if num_parts < 1 or lease_tokens < 1:
            raise ValueError(f"DataPool: num_parts={num_parts}, lease_tokens={lease_tokens}")
        self.num_parts, self.lease_tokens, self.ahead = num_parts, lease_tokens, ahead_leases
        self.frontier = [0] * num_parts
        self.returned: list[Lease] = []
        self.holders: dict[str, _Holder] = {}
        self.consumed: list[Lease] = []  # fully read ranges (for `check`)
        self.doubtful: list[Lease] = []  # leased after the checkpoint restored (see module doc)
        self.pending: set[str] = set()  # learners of the mark not registered since the restore

    # -- learners -------------------------------------------------------------------------------

    def join(self, learner: str, home: int | None = None) -> tuple[list[Lease], int]:
        """Admit `learner` (or an incarnation of one it knows): its held leases, topped up, and
        how many tokens of the first one it already consumed."""
        holder = self.holders.get(learner)
        if holder is None:
            if home is not None and not 0 <= home < self.num_parts:
                raise ValueError(f"home part {home} not in [0, {self.num_parts})")
            holder = self.holders[learner] = _Holder(home=home)
        self._settle(learner)
        self._top_up(holder)
        return list(holder.leases), holder.cursor - holder.base

    def reclaim(self, learner: str, leases: list[Lease], offset: int, cursor: int) -> None:
        """After a synchronizer restore, a learner that kept training states what it holds:
        its leases (the first `offset` tokens read) and cursor, which the restored books may
        not know yet. Frontiers move past them, so they are never handed out again."""
        holder = self.holders.setdefault(learner, _Holder())
        for old in holder.leases:  # what it held at the checkpoint and has read since
            for piece in _minus(old, leases):
                self._consume(piece)
        self.returned = [p for r in self.returned for p in _minus(r, leases)]
        self.doubtful = [p for r in self.doubtful for p in _minus(r, leases)]
        holder.leases = deque(leases)
        holder.cursor, holder.base = cursor, cursor - offset
        for lease in leases:
            self.frontier[lease.part] = max(self.frontier[lease.part], lease.end)

    def restore_mark(self, frontier: list[int], holders: list[str]) -> None:
        """After `load_state_dict` from a checkpoint: the persisted mark of the pool as the
        previous synchronizer last handed data out. Learners it no longer counted left since
        the checkpoint; ranges between the checkpoint's frontiers and the mark's are in doubt
        until every learner of the mark registered again or left."""
        if not frontier:  # no mark: nothing was handed out after the checkpoint
            return
        for learner in [h for h in self.holders if h not in holders]:
            self.leave(learner)
        for part, edge in enumerate(frontier[: self.num_parts]):
            if edge > self.frontier[part]:
                self.doubtful.append(Lease(part, self.frontier[part], int(edge)))
                self.frontier[part] = int(edge)
        self.pending = set(holders)
        self._settle(None)  # with nobody holding data at the mark, nothing is in doubt

    def advance(self, learner: str, cursor: int) -> list[Lease]:
        """A progress report: `learner` consumed up to `cursor`. Returns the leases added to
        keep it `ahead_leases` ahead (it appends them to what it reads)."""
        holder = self.holders[learner]
        if cursor > holder.cursor:
            holder.cursor = cursor
        while holder.leases and holder.cursor - holder.base >= holder.leases[0].size:
            done = holder.leases.popleft()
            holder.base += done.size
            self._consume(done)
        if holder.cursor > holder.base + sum(lease.size for lease in holder.leases):
            raise ValueError(
                f"learner {learner!r} reports cursor {cursor}, past the end of its leases"
            )
        return self._top_up(holder)

    def leave(self, learner: str) -> list[Lease]:
        """`learner` leaves for good: what it has not consumed goes back to the pool."""
        holder = self.holders.pop(learner, None)
        self._settle(learner)
        if holder is None:  # it never registered with this synchronizer
            return []
        back: list[Lease] = []
        offset = holder.cursor - holder.base
        for lease in holder.leases:
            if offset > 0:
                self._consume(Lease(lease.part, lease.start, lease.start + offset))
                lease = Lease(lease.part, lease.start + offset, lease.end)
                offset = 0
            if lease.size > 0:
                back.append(lease)
        self.returned.extend(back)
        self.returned.sort(key=lambda r: (r.part, r.start))
        return back

    def _consume(self, lease: Lease) -> None:
        last = self.consumed[-1] if self.consumed else None
        if last is not None and last.part == lease.part and last.end == lease.start:
            self.consumed[-1] = Lease(last.part, last.start, lease.end)  # keep the books short
        else:
            self.consumed.append(lease)

    def _settle(self, learner: str | None) -> None:
        """`learner` registered or left since a restore: once all of the mark did, nobody
        can still hold a doubtful range, and they are handed out again."""
        if learner is not None:
            self.pending.discard(learner)
        if not self.pending and self.doubtful:
            self.returned = sorted([*self.returned, *self.doubtful], key=Lease.as_tuple)
            self.doubtful = []

    def cursor(self, learner: str) -> int:
        holder = self.holders.get(learner)
        return holder.cursor if holder is not None else 0

    # -- handing out ----------------------------------------------------------------------------

    def _held_ahead(self, holder: _Holder) -> int:
        return holder.base + sum(lease.size for lease in holder.leases) - holder.cursor

    def _top_up(self, holder: _Holder) -> list[Lease]:
        added: list[Lease] = []
        while self._held_ahead(holder) < self.ahead * self.lease_tokens:
            lease = self._next(holder)
            last = holder.leases[-1] if holder.leases else None
            if last is not None and last.part == lease.part and last.end == lease.start:
                holder.leases[-1] = Lease(last.part, last.start, lease.end)  # contiguous
            else:
                holder.leases.append(lease)
            added.append(lease)
        return added

    def _next(self, holder: _Holder) -> Lease:
        if self.returned:
            first = self.returned[0]
            if first.size <= self.lease_tokens:
                return self.returned.pop(0)
            self.returned[0] = Lease(first.part, first.start + self.lease_tokens, first.end)
            return Lease(first.part, first.start, first.start + self.lease_tokens)
        part = holder.home
        if part is None:
            part = min(range(self.num_parts), key=lambda p: (self.frontier[p], p))
        start = self.frontier[part]
        self.frontier[part] = start + self.lease_tokens
        return Lease(part, start, start + self.lease_tokens)

    # -- books ----------------------------------------------------------------------------------

    def check(self) -> list[str]:
        """Per part, consumed + held + returned + doubtful ranges must be disjoint and cover
        [0, frontier): no token read twice, none lost. Returns what is wrong (empty when the
        books balance)."""
        ranges: dict[int, list[tuple[int, int]]] = {p: [] for p in range(self.num_parts)}
        for lease in [*self.consumed, *self.returned, *self.doubtful]:
            ranges[lease.part].append((lease.start, lease.end))
        for holder in self.holders.values():
            for lease in holder.leases:
                ranges[lease.part].append((lease.start, lease.end))
        problems = []
        for part, spans in ranges.items():
            edge = 0
            for start, end in sorted(spans):
                if start < edge:
                    problems.append(f"part {part}: tokens {start}..{edge} handed out twice")
                elif start > edge:
                    problems.append(f"part {part}: tokens {edge}..{start} lost")
                edge = max(edge, end)
            if edge != self.frontier[part]:
                problems.append(f"part {part}: ranges end at {edge}, not at {self.frontier[part]}")
        return problems

    def state_dict(self) -> dict[str, Any]:
        return {
            "frontier": list(self.frontier),
            "returned": [r.as_tuple() for r in self.returned],
            "consumed": [r.as_tuple() for r in self.consumed],
            "doubtful": [r.as_tuple() for r in self.doubtful],
            "pending": sorted(self.pending),
            "holders": {
                name: {
                    "leases": [r.as_tuple() for r in h.leases],
                    "cursor": h.cursor,
                    "base": h.base,
                    "home": h.home,
                }
                for name, h in self.holders.items()
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.frontier = [int(f) for f in state["frontier"]]
        self.returned = [Lease(*map(int, r)) for r in state["returned"]]
        self.consumed = [Lease(*map(int, r)) for r in state["consumed"]]
        self.doubtful = [Lease(*map(int, r)) for r in state.get("doubtful", [])]
        self.pending = set(state.get("pending", []))
        self.holders = {
            name: _Holder(
                leases=deque(Lease(*map(int, r)) for r in h["leases"]),
                cursor=int(h["cursor"]),
                base=int(h["base"]),
                home=None if h["home"] is None else int(h["home"]),
            )
            for name, h in state["holders"].items()
        }


def _minus(lease: Lease, others: list[Lease]) -> list[Lease]:
    """The parts of `lease` no lease of `others` covers."""
    pieces = [lease]
    for o in others:
        pieces = [
            piece
            for p in pieces
            for piece in (
                [p]
                if o.part != p.part or o.end <= p.start or o.start >= p.end
                else [Lease(p.part, p.start, o.start), Lease(p.part, o.end, p.end)]
            )
            if piece.size > 0
        ]
    return pieces
