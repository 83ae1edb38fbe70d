"""Layer: tasks (pure, no Ray). Batches of a language model from one long token stream: the
deterministic, resumable data both built-in tasks read (`batch = next(data)` in docs/algorithm.md
section 4; the cursor a restarted learner resumes from the token ledger, section 7).

The train stream (bytes or tokenizer ids, a NumPy array or a memory map) is cut into windows of
T tokens, visited in a fixed pseudo-random order (a multiplicative permutation, one full epoch
before any window repeats); part i of n takes every n-th window of that order, so parts are
disjoint and identically distributed. A batch is a pure function of (part, cursor), so
replaying from a saved cursor reproduces exactly the batches an uninterrupted run would have
seen, on any machine, with O(1) seek.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator

import numpy as np

Stream = np.ndarray  # 1-D integer array (uint8 bytes, uint16/uint32 token ids), maybe a memmap
Batch = tuple[np.ndarray, np.ndarray]  # inputs x and next-token targets y, int32 [B, T]


@functools.lru_cache(maxsize=64)
def _stride(num_windows: int) -> int:
    """A multiplier coprime with `num_windows` near its golden-ratio point: k -> k * stride mod
    num_windows is then a bijection that scatters neighbouring k far apart."""
    stride = max(1, int(num_windows * 0.6180339887)) | 1
    while math.gcd(stride, num_windows) != 1:
        stride += 2
    return stride


def window_starts(
    num_train_tokens: int, shard: tuple[int, int], first: int, count: int, seq_len: int
) -> np.ndarray:
    """Start offsets of windows `first .. first+count-1` of shard (index, num_shards).

    The train stream is cut into windows of T tokens, visited in a fixed pseudo-random order
    (a multiplicative permutation, one full epoch before any window repeats); learner i of M
    takes every M-th window of that order, so shards are disjoint and identically distributed.
    A pure function of its arguments: resuming from a cursor replays the same stream."""
    index, num_shards = shard
    if not 0 <= index < num_shards:
        raise ValueError(f"shard index {index} not in [0, {num_shards})")
    num_windows = (num_train_tokens - 1) // seq_len
    if num_windows < num_shards:
        raise ValueError(
            f"the train stream has {num_windows} windows of seq_len={seq_len} for "
            f"{num_shards} learners; use a bigger corpus (data.paths) or a shorter seq_len"
        )
    k = np.arange(first, first + count, dtype=np.int64) * num_shards + index
    return (k * _stride(num_windows) % num_windows) * seq_len


def _windows(stream: Stream, starts: np.ndarray, seq_len: int) -> Batch:
    # Windows of seq_len + 1 tokens (x and y overlap by T), wrapping only in a stream too short.
    idx = (starts[:, None] + np.arange(seq_len + 1)[None, :]) % stream.size
    window = stream[idx].astype(np.int32)
    return window[:, :-1], window[:, 1:]


def batch_at(
    train: Stream, shard: tuple[int, int], cursor: int, batch_size: int, seq_len: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """The batch at token offset `cursor` of a shard: x, y int32[B, T] and the next cursor
    (`cursor + B*T`). The cursor counts the shard's tokens consumed, across epochs."""
    starts = window_starts(len(train), shard, cursor // seq_len, batch_size, seq_len)
    x, y = _windows(train, starts, seq_len)
    return x, y, cursor + batch_size * seq_len


def heldout_batches(stream: Stream, num_batches: int, batch_size: int, seq_len: int) -> list[Batch]:
    """`num_batches` batches of `batch_size` windows at fixed, evenly spaced offsets of the
    held-out stream: the same evaluation set in every process and every run."""
    if stream.size < 2:
        raise ValueError("heldout_batches: the held-out stream has fewer than 2 tokens")
    count = num_batches * batch_size
    # Spread over the positions where a full window fits; wrap only if the stream is shorter.
    span = max(stream.size - seq_len, 1)
    starts = np.arange(count, dtype=np.int64) * span // count
    x, y = _windows(stream, starts, seq_len)
    b = batch_size
    return [(x[i : i + b], y[i : i + b]) for i in range(0, count, b)]


class TokenWindows:
    """A `DataSource` (ray_diloco/task.py) over a train and a held-out token stream, each
    built on first use (a learner that only needs shapes never reads the corpus)."""

    def __init__(
        self,
        streams: Callable[[], tuple[Stream, Stream]],
        seq_len: int,
        eval_batches: int,
        eval_batch_size: int,
    ) -> None:
        self._streams = streams
        self.tokens_per_example = seq_len
        self.eval_batches, self.eval_batch_size = eval_batches, eval_batch_size

    @functools.cached_property
    def train(self) -> Stream:
        return self._loaded[0]

    @functools.cached_property
    def _loaded(self) -> tuple[Stream, Stream]:
        return self._streams()

    def batches(
        self, part: int, num_parts: int, cursor: int, batch_size: int
    ) -> Iterator[tuple[Batch, int]]:
        seq_len = self.tokens_per_example
        while True:
            x, y, cursor = batch_at(self.train, (part, num_parts), cursor, batch_size, seq_len)
            yield (x, y), batch_size * seq_len

    def heldout(self) -> list[Batch]:
        return heldout_batches(
            self._loaded[1], self.eval_batches, self.eval_batch_size, self.tokens_per_example
        )
