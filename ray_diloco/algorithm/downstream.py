"""Layer: algorithm (pure, no Ray). Publications on their way down, synchronizer to learner.

Every learner that holds version v of a fragment holds exactly the same values, Q_v: the
synchronizer keeps Q_v as the published value of v and rebuilds contributions based on v from
it, so a learner's delta means the same thing on both ends.

- `publish_delta: none` (the default): Q_v is the new global value G_v rounded to the full
  dtype (bfloat16; float32 when the upstream wire is float32) and goes down outright.
- `publish_delta: int8 | int4 | int2`: version v goes down as the quantized difference
  D_v = quant(G_v - Q_{v-1}), and Q_v = round(Q_{v-1} + decode(D_v)) (`resolve`, bit for bit
  the same on both ends). What one difference misses, G_v - Q_v, is part of the next one
  (error feedback kept on the synchronizer), so the error never accumulates: Q stays within
  half a quantization step (and half a bfloat16 spacing) of G.

A learner that holds an older version gets the chain of differences since, while that costs
fewer bytes than the full value (publications to contributors skip versions); one that holds
no version the synchronizer knows of (it just registered, the chain was pruned, or the
synchronizer restarted) gets the full value Q_v, which is exactly representable in the full
dtype. On the learner a difference waits until the version it is based on arrives, so
publications may arrive in any order (`LearnerCore.receive`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ray_diloco.algorithm import wire
from ray_diloco.algorithm.buffers import Buffers
from ray_diloco.config import DilocoConfig, WireDtype

Values = Mapping[str, np.ndarray]


@dataclass(frozen=True)
class Message:
    """Version `version` of `fragment` for a learner: the full value (`base` None) or the
    difference to add to version `base`, which the learner must hold."""

    fragment: int
    version: int
    base: int | None
    encoded: dict[str, wire.Encoded]

    @property
    def nbytes(self) -> int:
        return wire.tree_bytes(self.encoded)


def full_dtype(d: DilocoConfig) -> WireDtype:
    """The dtype of full values sent down (and of every Q_v)."""
    return wire.publish_dtype(d.wire_dtype)


def _round(x: np.ndarray, full: WireDtype) -> np.ndarray:
    """`x` (float32) rounded to what `full` carries, as float32."""
    if full == "float32":
        return x
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def kept(values: Values, full: WireDtype) -> dict[str, np.ndarray]:
    """Q_v as the synchronizer keeps it: in the full dtype, which holds it exactly (bfloat16:
    2 bytes a parameter, not float32's 4)."""
    if full == "float32":
        return dict(values)
    return {k: np.asarray(v).astype(ml_dtypes.bfloat16, copy=False) for k, v in values.items()}


def _view(encoded: Mapping[str, wire.Encoded]) -> dict[str, np.ndarray]:
    """Q_v read in place from its full bfloat16 message: the bytes that go down, kept once."""
    return {
        k: np.frombuffer(e.payload, ml_dtypes.bfloat16).reshape(e.shape) for k, e in encoded.items()
    }


def resolve(
    held: Values, diff: Mapping[str, wire.Encoded], full: WireDtype
) -> dict[str, np.ndarray]:
    """Q_v from Q_{v-1} (`held`) and the difference D_v: what the learner adopts and the
    synchronizer keeps, computed the same way on both ends."""
    return {k: _round(wire.decode_add(e, held[k])[0], full) for k, e in diff.items()}


def decode(msg: Message, held: Values | None, full: WireDtype) -> dict[str, np.ndarray] | None:
    """The values `msg` carries, given what the learner holds of version `msg.base` (None
    when it does not hold that version: the difference cannot be resolved yet)."""
    if msg.base is None:
        return wire.decode_tree(msg.encoded)
    return None if held is None else resolve(held, msg.encoded, full)


class Downstream:
    """The synchronizer's side: per fragment it owns, the recent differences (the chain) and
    the version each learner was last sent."""

    def __init__(
        self, d: DilocoConfig, fragments: Iterable[int], buffers: Buffers | None = None
    ) -> None:
        """`buffers`: where the kept values Q_v come from (`buffers.py`; fresh ones without)."""
        self.buffers = Buffers(0) if buffers is None else buffers
        self.full = full_dtype(d)
        self.delta: WireDtype | None = None if d.publish_delta == "none" else d.publish_delta
        self.block_size = d.int4_block_size
        # A chain longer than the versions a contribution may be based on is never worth
        # sending: a learner that far behind has its offers refused anyway.
        self.keep = max(1, d.max_staleness_versions)
        self.chain: dict[int, dict[int, dict[str, wire.Encoded]]] = {p: {} for p in fragments}
        self.holds: dict[int, dict[str, int]] = {p: {} for p in self.chain}
        # The newest full value of each fragment, kept where it costs nothing: without
        # differences its bytes are Q_v itself; with them it is encoded afresh when needed.
        self._full: dict[int, Message] = {}

    def publish(
        self, fragment: int, version: int, values: Values, prev: Values | None
    ) -> tuple[dict[str, np.ndarray], dict[str, wire.Encoded]]:
        """Version `version` of `fragment` from the new global `values` and Q of the version
        before (`prev`): returns (Q_v as kept, `kept`; what goes down to a learner holding
        `prev`)."""
        chain = self.chain[fragment]
        for v in [v for v in chain if v <= version - self.keep]:
            del chain[v]
        self._full.pop(fragment, None)
        if self.delta is None or prev is None:
            encoded = wire.encode_tree(values, self.full)
            if self.full == "float32":
                return dict(values), encoded
            if self.delta is None:
                self._full[fragment] = Message(fragment, version, None, encoded)
            return _view(encoded), encoded
        # Difference, encoding and Q_v in one pass a chunk at a time (`resolve`'s bits).
        dtype = np.dtype(np.float32) if self.full == "float32" else np.dtype(ml_dtypes.bfloat16)
        diff, q = {}, {}
        for k, value in values.items():
            q[k] = self.buffers.empty(np.shape(value), dtype)
            diff[k] = wire.encode_difference(value, prev[k], self.delta, self.block_size, q[k])
        chain[version] = diff
        return q, diff

    def messages(
        self, fragment: int, version: int, q: Values, learners: Iterable[str]
    ) -> list[tuple[list[str], list[Message]]]:
        """What each of `learners` is sent of version `version` (Q_v = `q`), grouped by the
        messages (learners holding the same version share them); records that they hold it."""
        groups: dict[int | None, list[str]] = {}
        held = self.holds[fragment]
        for n in learners:
            groups.setdefault(self._first(fragment, version, held.get(n), q), []).append(n)
            held[n] = max(version, held.get(n, version))
        out = []
        for first, names in groups.items():
            if first is None:
                out.append((names, [self._full_message(fragment, version, q)]))
            else:
                chain = self.chain[fragment]
                steps = range(first, version + 1)
                out.append((names, [Message(fragment, v, v - 1, chain[v]) for v in steps]))
        # A difference every learner has been sent is never needed again.
        chain = self.chain[fragment]
        for v in [v for v in chain if v <= min(held.values(), default=v)]:
            del chain[v]
        return out

    def _first(self, fragment: int, version: int, have: int | None, q: Values) -> int | None:
        """The first difference a learner holding `have` needs, or None: the full value."""
        if self.delta is None or have is None or have >= version:
            return None
        chain = self.chain[fragment]
        needed = range(have + 1, version + 1)
        if any(v not in chain for v in needed):
            return None
        cost = sum(wire.tree_bytes(chain[v]) for v in needed)
        full = wire.tree_wire_bytes({k: a.size for k, a in q.items()}, self.full)
        return have + 1 if cost < full else None

    def catch_up(self, fragment: int, version: int, q: Values, learner: str) -> Message:
        """The full value of `version` for `learner` (a catch-up), recorded as held."""
        self.holds[fragment][learner] = version
        return self._full_message(fragment, version, q)

    def _full_message(self, fragment: int, version: int, q: Values) -> Message:
        msg = self._full.get(fragment)
        if msg is None or msg.version != version:
            msg = Message(fragment, version, None, wire.encode_tree(q, self.full))
        return msg

    def adopted(self, learner: str, versions: Mapping[int, int]) -> None:
        """`learner` registered and adopts these versions (the snapshot)."""
        for p, v in versions.items():
            if p in self.holds:
                self.holds[p][learner] = v

    def left(self, learner: str) -> None:
        """`learner` left the run: no difference is kept for it any more."""
        for held in self.holds.values():
            held.pop(learner, None)

    def forget(self, fragment: int) -> None:
        """No learner's copy of `fragment` is known any more (a restore renamed versions):
        each gets the full value next."""
        self.chain[fragment].clear()
        self.holds[fragment].clear()
        self._full.pop(fragment, None)
