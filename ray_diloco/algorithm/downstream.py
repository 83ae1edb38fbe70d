"""Layer: algorithm (pure, no Ray). Publications on their way down (synchronizer to learner), and
the synchronizer's record of what each learner holds.

With a float publication dtype (bfloat16, or float32 when the wire is float32) a
learner gets the new global value of a fragment outright. With a quantized one (int8, int4,
int2) it gets the *difference* between the new global value and the value it holds, quantized.
The record keeps exactly the values each learner was sent (decoded, as the learner decodes
them), so the part of a difference lost to quantization is still in the next one (error
feedback: no error accumulates; the learner's copy stays within half a quantization step of the
global value). A learner with no record (it just registered, or the synchronizer restarted) gets
the full value in the float dtype.

The record is also what contributions are reconstructed from: a learner sends its parameters
minus the value of its base version, as it holds it (`base`). It keeps, per learner, the
versions from the base of its last accepted contribution on (a learner's base never goes back)
and none older than `max_staleness_versions` (`prune`): typically the version it trains on and
the one just sent to it. Learners sent the same values share one object (with float
publications every copy of a version is one object), so the memory is one float32 copy of a
fragment per distinct value held.
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


@dataclass(frozen=True)
class Published:
    """One version of a fragment: the global value (`values`, float32), its full encoding as
    sent down (`encoded`) and the values a learner decodes from that (`decoded`)."""

    version: int
    values: Values
    encoded: dict[str, wire.Encoded]
    decoded: Values


def full_dtype(d: DilocoConfig) -> WireDtype:
    """The dtype of full values sent down: `publish_dtype` if it is a float, else (and by
    default) float32 when the upstream wire is float32 and bfloat16 otherwise."""
    if d.publish_dtype is not None and d.publish_dtype not in QUANTIZED:
        return d.publish_dtype
    return wire.publish_dtype(d.wire_dtype)


class Downstream:
    def __init__(self, d: DilocoConfig, num_fragments: int) -> None:
        self.full_dtype = full_dtype(d)
        self.delta = d.publish_dtype if d.publish_dtype in QUANTIZED else None
        self.block_size = d.int4_block_size
        # fragment -> learner -> version -> the values it was sent of that version
        self.held: list[dict[str, dict[int, Values]]] = [{} for _ in range(num_fragments)]

    def publish(self, version: int, values: Values) -> Published:
        encoded = wire.encode_tree(values, self.full_dtype)
        return Published(version, values, encoded, wire.decode_tree(encoded))

    def adopted(self, learner: str, snapshot: Mapping[int, tuple[int, Values]]) -> None:
        """`learner` holds `snapshot` now (what it adopts when it registers), nothing else."""
        for p, (version, values) in snapshot.items():
            self.held[p][learner] = {version: values}

    def base(self, learner: str, fragment: int, version: int) -> Values | None:
        """The value of `version` as `learner` holds it, if recorded."""
        return self.held[fragment].get(learner, {}).get(version)

    def offered(self, learner: str, fragment: int, base: int) -> None:
        """`learner` contributed on `base`: it no longer holds anything older."""
        copies = self.held[fragment].get(learner, {})
        for v in [v for v in copies if v < base]:
            del copies[v]

    def prune(self, fragment: int, oldest: int) -> None:
        """Forget versions older than `oldest` (contributions based on them are refused as
        stale), keeping every learner's newest copy (what a difference is taken against)."""
        for copies in self.held[fragment].values():
            newest = max(copies, default=None)
            for v in [v for v in copies if v < oldest and v != newest]:
                del copies[v]

    def messages(
        self, fragment: int, pub: Published, learners: Iterable[str]
    ) -> dict[str, Message]:
        """Version `pub` of `fragment` for each of `learners`; records what each then holds."""
        out: dict[str, Message] = {}
        full_msg = Message(fragment, pub.version, None, pub.encoded)
        # one message per distinct copy held (the learners holding the same object share it)
        by_copy: dict[int, tuple[Message, Values]] = {}
        held = self.held[fragment]
        for n in learners:
            copies = held.setdefault(n, {})
            if self.delta is None or not copies:
                out[n], copies[pub.version] = full_msg, pub.decoded
                continue
            newest = max(copies)
            copy = copies[newest]
            if id(copy) not in by_copy:
                by_copy[id(copy)] = self._difference(fragment, pub, newest, copy)
            out[n], copies[pub.version] = by_copy[id(copy)]
        return out

    def _difference(
        self, fragment: int, pub: Published, base: int, copy: Values
    ) -> tuple[Message, Values]:
        assert self.delta is not None
        diff = {k: np.asarray(v, np.float32) - copy[k] for k, v in pub.values.items()}
        encoded = wire.encode_tree(diff, self.delta, self.block_size)
        decoded = wire.decode_tree(encoded)
        # The learner adds exactly `decoded`, in float32, to its copy: so does this record.
        new_copy = {k: (copy[k] + decoded[k]).astype(np.float32) for k in copy}
        return Message(fragment, pub.version, base, encoded), new_copy
