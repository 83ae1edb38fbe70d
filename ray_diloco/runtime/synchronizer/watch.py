"""Layer: runtime (Ray shell). The supervisor's view of the synchronizer: one `SyncWatch` per
shard, combined by `ShardWatch` (one shard down stalls only its fragments, and is lost and
restored on its own).

Every poll sends one `status(since_event)` call unless one is in flight and reads it when it is
ready, never blocking the control loop. From the answers it produces tape events: the
synchronizer's own journal (rounds closed, contributions rejected), rebased onto the run clock;
`SynchronizerLost` when no answer came for the shard's timeout (the synchronizer is being
reconstructed or hangs: its methods retry transparently across a restart, so a call simply
takes long), which adapts to how its answers arrive as a learner's does (`control/detector.py`:
on a busy machine an answer seconds late is no loss); and
`SynchronizerRestored` once a new process (its `started_at` changed) has ended its recovery, at
the time it did, with the rounds the restart lost: those the old process had closed (read right
before a chaos kill, else the last answer seen) minus those it came back with.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import ray

from ray_diloco.control.detector import Cadence
from ray_diloco.control.events import (
    Event,
    SynchronizerLost,
    SynchronizerRestored,
    event_from_dict,
)
from ray_diloco.control.protocol import SynchronizerStatus
from ray_diloco.runtime.errors import classify_ray_error
from ray_diloco.runtime.synchronizer.shards import combine_status

logger = logging.getLogger(__name__)


def uptime_window_s(sync_every: int, sync_status: SynchronizerStatus | None) -> float:
    """Two sync periods of a fragment (`sync_every` steps) at the learners' mean step time
    from the synchronizer's status (at least 1 s): the window uptime is measured in."""
    learners = sync_status.learners if sync_status is not None else {}
    times = [ls.step_time_s for ls in learners.values() if ls.step_time_s]
    step = sum(times) / len(times) if times else 1.0
    return max(1.0, 2 * sync_every * step)


class SyncWatch:
    def __init__(
        self,
        handle: Any,
        t0: float,
        cadence: Cadence,
        clock: Callable[[], float],
        startup_timeout_s: float = 600.0,
        shard: int = 0,
    ) -> None:
        self.handle, self.t0, self.cadence, self.clock = handle, t0, cadence, clock
        self.shard = shard
        self.startup_timeout_s = startup_timeout_s
        self.status: SynchronizerStatus | None = None  # the latest answer
        self.last_ok: float = clock()
        self.lost = False
        self.restores = 0
        self.rounds_at_kill: int | None = None
        self._ref: Any = None
        self._seq = 0
        self._started_at: float | None = None
        self._last_rounds = 0
        self._restoring: int | None = None  # rounds before a restart, until its recovery ends

    @property
    def up(self) -> bool:
        return self.status is not None and not self.lost

    def killed(self, rounds: int | None) -> None:
        """The chaos engine is about to kill the synchronizer, which has closed `rounds`."""
        self.rounds_at_kill = rounds

    def poll(self) -> tuple[list[Event], SynchronizerStatus | None]:
        """(events for the tape, a new status answer or None)."""
        now = self.clock()
        if self._ref is None:
            self._ref = self.handle.status.remote(self._seq)
            return self._silence(now), None
        ready, _ = ray.wait([self._ref], timeout=0)
        if not ready:
            return self._silence(now), None
        ref, self._ref = self._ref, None
        try:
            st: SynchronizerStatus = ray.get(ref)
        except ray.exceptions.RayError as err:
            logger.warning("synchronizer status failed (%s): %s", classify_ray_error(err), err)
            return self._silence(now, force=True, detail=type(err).__name__), None
        return self._answer(st, now), st

    def drain(self, timeout_s: float) -> list[Event]:
        """Every event the shard journaled until now, waiting for it (once the supervisor's
        loop has stopped): the answer in flight, if any, then one asked for now."""
        events = self._wait_answer(timeout_s) if self._ref is not None else []
        self._ref = self.handle.status.remote(self._seq)
        return events + self._wait_answer(timeout_s)

    def _wait_answer(self, timeout_s: float) -> list[Event]:
        ref, self._ref = self._ref, None
        try:
            st: SynchronizerStatus = ray.get(ref, timeout=timeout_s)
        except ray.exceptions.RayError as err:
            logger.warning("synchronizer shard %d's last events: %s", self.shard, err)
            return []
        return self._answer(st, self.clock())

    def _silence(self, now: float, force: bool = False, detail: str = "") -> list[Event]:
        silent = now - self.last_ok
        # Before its first answer the synchronizer is still building (data, parameters).
        timeout = self.cadence.timeout_s() if self.status is not None else self.startup_timeout_s
        if self.lost or not (force or silent > timeout):
            return []
        self.lost = True
        logger.warning("synchronizer unanswered for %.1fs", silent)
        why = detail or f"no status answer for {silent:.1f}s"
        return [SynchronizerLost(now, silent, why, self.shard)]

    def _answer(self, st: SynchronizerStatus, now: float) -> list[Event]:
        events: list[Event] = []
        started = st.started_at
        restarted = self._started_at is not None and started != self._started_at
        if restarted or st.event_seq < self._seq:
            events += self._new_process(now)
            # This answer was asked with the old process's sequence number: drop its events
            # and read the new journal from its start with the next call.
            st = dataclasses.replace(st, events=[], event_seq=0)
        self._started_at = started
        for e in st.events:
            ev = event_from_dict(e)  # journal events carry wall-clock time
            events.append(dataclasses.replace(ev, t=ev.t - self.t0))
        restored = st.restored or {}
        if self._restoring is not None and not restored.get("recovering"):
            events.append(self._restored(restored, now))
        self._seq = st.event_seq
        self._last_rounds = st.rounds
        self.status, self.last_ok, self.lost = st, now, False
        self.cadence.arrived(now)
        return events

    def _new_process(self, now: float) -> list[Event]:
        """The answer comes from a new synchronizer process: its journal starts afresh, and
        it is restored once its recovery (values from the learners) is over."""
        events: list[Event] = []
        self.cadence.forget_last()  # no gap across the restart
        if not self.lost:  # reconstructed faster than the timeout: lost all the same
            why = "answered by a new process"
            events.append(SynchronizerLost(now, now - self.last_ok, why, self.shard))
        self._restoring = (
            self.rounds_at_kill if self.rounds_at_kill is not None else self._last_rounds
        )
        self.rounds_at_kill = None
        return events

    def _restored(self, restored: dict[str, Any], now: float) -> SynchronizerRestored:
        """The rounds lost: those closed before the kill that the restored state lacks (or
        the shard's own count of delivered rounds no learner could hand back, if higher)."""
        before, self._restoring = self._restoring or 0, None
        after = int(restored.get("rounds", 0))
        lost = max(0, before - after, int(restored.get("rounds_lost", 0)))
        versions = {int(p): int(v) for p, v in restored.get("versions", {}).items()}
        at = restored.get("recovered_at", restored.get("time"))
        t = now if at is None else min(now, float(at) - self.t0)
        logger.warning(
            "synchronizer shard %d restored at %d rounds; %d rounds lost", self.shard, after, lost
        )
        self.restores += 1
        return SynchronizerRestored(t, versions, lost, self.shard)


class ShardWatch:
    """Every shard's `SyncWatch`, seen as one synchronizer by the supervisor."""

    def __init__(
        self,
        handles: list[Any],
        t0: float,
        cadence: Callable[[], Cadence],
        clock: Callable[[], float],
        startup_timeout_s: float = 600.0,
    ) -> None:
        self.watches = [
            SyncWatch(h, t0, cadence(), clock, startup_timeout_s, shard)
            for shard, h in enumerate(handles)
        ]

    @property
    def up(self) -> bool:
        return all(w.up for w in self.watches)

    @property
    def restores(self) -> int:
        return sum(w.restores for w in self.watches)

    @property
    def status(self) -> SynchronizerStatus | None:
        """The shards' latest answers combined (None before shard 0's first)."""
        if self.watches[0].status is None:
            return None
        return combine_status([w.status for w in self.watches])

    def killed(self, shard: int, rounds: int | None) -> None:
        self.watches[shard].killed(rounds)

    def drain(self, timeout_s: float) -> list[Event]:
        """Every shard's events until now (`SyncWatch.drain`)."""
        return [e for w in self.watches for e in w.drain(timeout_s)]

    def poll(self) -> tuple[list[Event], SynchronizerStatus | None]:
        """(every shard's events for the tape, the combined status when a shard answered)."""
        events: list[Event] = []
        answered = False
        for w in self.watches:
            evs, st = w.poll()
            events += evs
            answered = answered or st is not None
        return events, self.status if answered else None
