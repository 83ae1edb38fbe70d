"""Layer: algorithm (pure, no Ray). Faults a learner host applies
to itself when the chaos engine (faults.py) asks: the hooks `LearnerHost` calls in its loop.

- straggler: every step takes `factor` times as long as it otherwise would (its emulated time,
  or its real one when that is longer) until the window ends;
- corrupt_nan: the next offered contribution carries NaN. `wire.encode` refuses non-finite
  input, so the `wire.Encoded` bytes are built here directly (NaN payload for float32/bfloat16,
  NaN scales for int8/int4), exactly what a bit flip or a diverged learner would send;
- corrupt_norm: the next offered contribution's delta is 1e4 times too large (finite, so only
  the synchronizer's norm guard can catch it).
The cut/slow link faults act on the learner's `LinkEmulator` (algorithm/links.py) instead.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

import numpy as np

from ray_diloco.algorithm import wire

logger = logging.getLogger(__name__)

NORM_BLOWUP = 1e4
_NAN_F32 = np.array(np.nan, dtype="<f4").tobytes()
_NAN_BF16 = (0x7FC0).to_bytes(2, "little")


def nan_encoded(enc: wire.Encoded) -> wire.Encoded:
    """The same leaf, every value NaN after decoding (same sizes, so `decode` accepts it)."""
    n = enc.num_elements
    if enc.dtype == "float32":
        return dataclasses.replace(enc, payload=_NAN_F32 * n)
    if enc.dtype == "bfloat16":
        return dataclasses.replace(enc, payload=_NAN_BF16 * n)
    # int8/int4: values are payload x scale; a NaN scale makes the whole block NaN.
    return dataclasses.replace(enc, scales=_NAN_F32 * (len(enc.scales) // 4))


def blown_up(enc: wire.Encoded) -> wire.Encoded:
    """The same leaf with its values multiplied by NORM_BLOWUP, re-encoded in its dtype."""
    return wire.encode(wire.decode(enc) * NORM_BLOWUP, enc.dtype, enc.block_size or 64)


class HostFaults:
    """Armed faults of one host; thread-safe (armed from actor calls, read by the loop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slow_until = 0.0
        self._slow_factor = 1.0
        self._corrupt: str | None = None
        self.injected: list[str] = []

    def arm(self, kind: str, duration_s: float = 0.0, factor: float = 1.0) -> str:
        with self._lock:
            if kind == "straggler":
                self._slow_until = time.monotonic() + duration_s
                self._slow_factor = factor
            elif kind in ("corrupt_nan", "corrupt_norm"):
                self._corrupt = kind
            else:
                raise ValueError(f"a learner host cannot inject {kind!r} itself")
        logger.warning("fault armed: %s (duration %.1fs, factor %.1f)", kind, duration_s, factor)
        return kind

    def slowdown(self) -> float:
        """The factor to stretch this step by (1.0 outside a straggler window)."""
        with self._lock:
            return self._slow_factor if time.monotonic() < self._slow_until else 1.0

    def corrupt(self, offers: list[tuple[Any, dict[str, wire.Encoded]]]) -> list[Any]:
        """Corrupt the first of this step's offers if a corruption is armed (it stays armed
        until a step offers something)."""
        if not offers:
            return offers
        with self._lock:
            kind, self._corrupt = self._corrupt, None
        if kind is None:
            return offers
        meta, delta = offers[0]
        bad = nan_encoded if kind == "corrupt_nan" else blown_up
        self.injected.append(f"{kind}: fragment {meta.fragment} at step {meta.step}")
        logger.warning(
            "offering a corrupted contribution (%s) for fragment %d", kind, meta.fragment
        )
        return [(meta, {k: bad(v) for k, v in delta.items()}), *offers[1:]]
