"""Layer: algorithm (pure, no Ray). How a learner reads its training data: batches from the
queue of leases the synchronizer's pool gave it (algorithm/leases.py), in order, each lease one
continuous stream of its part, so a learner reads exactly what a fixed shard would give.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np

from ray_diloco.algorithm.leases import Lease
from ray_diloco.task import Batch


class DataStarved(Exception):
    """The learner consumed every lease it holds (the synchronizer has not topped them up)."""


class LeaseReader:
    """Batches of `batch_size` examples read from a queue of leases in order. Inside a lease a
    learner reads one continuous stream (exactly the batches a fixed shard would give); a
    batch that a lease cannot fill takes its remaining examples from the next lease (the task
    contract's example addressing makes that the same data, read in two pieces)."""

    def __init__(
        self, data: Any, num_parts: int, batch_size: int, leases: Sequence[Lease], offset: int
    ) -> None:
        self.data, self.num_parts, self.batch_size = data, num_parts, batch_size
        self.unit = data.tokens_per_example
        self.queue: deque[Lease] = deque()
        self.offset = offset  # tokens of queue[0] already read
        self._stream: Iterator[tuple[Batch, int]] | None = None
        self.add(leases)

    def add(self, leases: Sequence[Lease]) -> None:
        for lease in leases:
            last = self.queue[-1] if self.queue else None
            if last is not None and last.part == lease.part and last.end == lease.start:
                self.queue[-1] = Lease(last.part, last.start, lease.end)  # one stream
            else:
                self.queue.append(lease)

    def ahead(self) -> int:
        """Tokens leased and not read yet."""
        return sum(lease.size for lease in self.queue) - self.offset

    def next(self) -> tuple[Batch, int]:
        pieces: list[tuple[Batch, int]] = []
        need = self.batch_size
        while need:
            if not self.queue:
                raise DataStarved(f"no lease left ({self.batch_size - need} examples read)")
            lease = self.queue[0]
            available = (lease.size - self.offset) // self.unit
            if available == 0:
                self.queue.popleft()
                self.offset, self._stream = 0, None
                continue
            if need == self.batch_size and available >= need:
                if self._stream is None:
                    self._stream = self.data.batches(
                        lease.part, self.num_parts, lease.start + self.offset, self.batch_size
                    )
                batch, tokens = next(self._stream)
            else:  # part of a batch, from a lease's end or a new lease's start
                take = min(need, available)
                start = lease.start + self.offset
                batch, tokens = next(self.data.batches(lease.part, self.num_parts, start, take))
                self._stream = None
            pieces.append((batch, tokens))
            self.offset += tokens
            need -= jax.tree.leaves(batch)[0].shape[0]
        if len(pieces) == 1:
            return pieces[0]
        joined = jax.tree.map(lambda *xs: np.concatenate(xs), *[b for b, _ in pieces])
        return joined, sum(t for _, t in pieces)
