"""Layer: algorithm (pure, no Ray). Publications on their way down (synchronizer to learner).

With a float publication dtype (the default: bfloat16, or float32 when the wire is float32) a
learner gets the new global value of a fragment outright. With a quantized one (int8, int4,
int2) it gets the *difference* between the new global value and the value it holds, quantized:
the synchronizer keeps, per learner and fragment, exactly the value that learner holds (what it
was sent, decoded), so the part of a difference lost to quantization is still in the next one
(error feedback: no error accumulates, the learner's copy stays within one quantization step
of the global value). A learner that holds nothing known (it just registered or re-registered,
or the synchronizer restarted) gets the full value in the float dtype instead.

Learners whose copies are the same object (every one that received the same publications, the
common case with `publish_to: all`) share one encoding. The memory this costs is one float32
copy of a fragment per distinct holder (at most one per learner), and none with a float dtype.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from ray_diloco.algorithm import wire
from ray_diloco.config import DilocoConfig, WireDtype

Values = Mapping[str, np.ndarray]
QUANTIZED: frozenset[WireDtype] = frozenset({"int8", "int4", "int2"})


@dataclass(frozen=True)
class Message:
    """Version `version` of `fragment` for one learner: full values (`base` None) or the
    difference to add to the value of version `base`, which the learner holds."""

    fragment: int
    version: int
    base: int | None
    encoded: dict[str, wire.Encoded]

    @property
    def nbytes(self) -> int:
        return wire.tree_bytes(self.encoded)


def full_dtype(d: DilocoConfig) -> WireDtype:
    """The dtype of full values sent down: `publish_dtype` if it is a float, else (and by
    default) float32 when the upstream wire is float32 and bfloat16 otherwise."""
    if d.publish_dtype is not None and d.publish_dtype not in QUANTIZED:
        return d.publish_dtype
    return wire.publish_dtype(d.wire_dtype)


class Downstream:
    def __init__(self, d: DilocoConfig, num_fragments: int) -> None:
        self.full = full_dtype(d)
        self.delta = d.publish_dtype if d.publish_dtype in QUANTIZED else None
        self.block_size = d.int4_block_size
        # fragment -> learner -> (version, values it holds); only with a quantized dtype
        self.held: list[dict[str, tuple[int, Values]]] = [{} for _ in range(num_fragments)]

    def adopted(self, learner: str, snapshot: Mapping[int, tuple[int, Values]]) -> None:
        """`learner` now holds `snapshot` (what it adopts when it registers)."""
        if self.delta is None:
            return
        for p, (version, values) in snapshot.items():
            self.held[p][learner] = (version, values)

    def encode_full(self, values: Values) -> dict[str, wire.Encoded]:
        return wire.encode_tree(values, self.full)

    def messages(
        self,
        fragment: int,
        version: int,
        values: Values,
        learners: Iterable[str],
        full: dict[str, wire.Encoded] | None = None,
    ) -> dict[str, Message]:
        """Version `version` of `fragment`, whose global value is `values`, for each of
        `learners`; `full` is its full-value encoding when the caller has it already."""
        learners = list(learners)
        if full is None and (self.delta is None or self._unknown(fragment, learners)):
            full = self.encode_full(values)
        if self.delta is None:
            assert full is not None
            msg = Message(fragment, version, None, full)
            return dict.fromkeys(learners, msg)
        out: dict[str, Message] = {}
        # one message per distinct copy held (the learners that hold the same object share it)
        by_copy: dict[int, tuple[Message, tuple[int, Values]]] = {}
        fresh: tuple[Message, tuple[int, Values]] | None = None
        held = self.held[fragment]
        for n in learners:
            have = held.get(n)
            if have is None:  # full values, decoded once, as the learner will decode them
                assert full is not None
                if fresh is None:
                    decoded = wire.decode_tree(full)
                    fresh = (Message(fragment, version, None, full), (version, decoded))
                shared = fresh
            else:
                if id(have[1]) not in by_copy:
                    by_copy[id(have[1])] = self._delta_message(fragment, version, values, have)
                shared = by_copy[id(have[1])]
            out[n], held[n] = shared
        return out

    def _unknown(self, fragment: int, learners: list[str]) -> bool:
        return any(n not in self.held[fragment] for n in learners)

    def _delta_message(
        self, fragment: int, version: int, values: Values, have: tuple[int, Values]
    ) -> tuple[Message, tuple[int, Values]]:
        base, copy = have
        assert self.delta is not None
        diff = {k: np.asarray(values[k], np.float32) - copy[k] for k in values}
        encoded = wire.encode_tree(diff, self.delta, self.block_size)
        decoded = wire.decode_tree(encoded)
        # The learner adds exactly `decoded`, in float32, to its copy: so does this record.
        new_copy = {k: (copy[k] + decoded[k]).astype(np.float32) for k in values}
        return Message(fragment, version, base, encoded), (version, new_copy)
