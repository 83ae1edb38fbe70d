"""Layer: runtime (Ray shell). When a round's publication reached a learner.

A round counts as closed (the version mark, the status's rounds, the `RoundClosed` event)
once one learner holds its publication: its `receive` call returned. Until then the merged
value exists only in the synchronizer's process; if that process dies first, no learner holds
the version, the contributors' counters still hold the work (they had not adopted the new
version), they offer it again and the restored synchronizer merges it once (the round log
keeps the ledger exact). So a round that never left the process is not a lost round, and one
that did is recovered from the learners that hold it (sync_core's recovery).

`Deliveries` watches the `receive` calls of each publication on its own thread and calls
`delivered(fragment, version)` once per publication, for the first call that succeeds (or at
once when the publication had nobody to go to), or `undelivered(fragment, version)` once
every call failed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import ray

logger = logging.getLogger(__name__)

POLL_S = 0.02  # how long the watcher waits for a call before it looks for new ones


class Deliveries:
    def __init__(
        self, delivered: Callable[[int, int], None], undelivered: Callable[[int, int], None]
    ) -> None:
        self._delivered, self._undelivered = delivered, undelivered
        self._cond = threading.Condition()
        self._calls: dict[Any, tuple[int, int]] = {}  # receive call -> (fragment, version)
        self._sends: dict[tuple[int, int], int] = {}  # sends not answered, per publication
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="deliveries", daemon=True)
        self._thread.start()

    def expect(self, fragment: int, version: int, sends: int) -> None:
        """A publication goes out to `sends` hosts (call before the first send)."""
        if sends == 0:
            self._delivered(fragment, version)
            return
        with self._cond:
            self._sends[(fragment, version)] = sends

    def sent(self, fragment: int, version: int, call: Any) -> None:
        """A `receive` call of that publication is on its way."""
        with self._cond:
            if (fragment, version) in self._sends:
                self._calls[call] = (fragment, version)
                self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._calls and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                calls = list(self._calls)
            done, _ = ray.wait(calls, num_returns=len(calls), timeout=POLL_S)
            for call in done:
                try:
                    self._answered(call)
                except Exception:  # rounds stop counting if this thread dies: never let it
                    logger.exception("watching a publication's delivery")

    def _answered(self, call: Any) -> None:
        try:
            ray.get(call)
            ok = True
        except ray.exceptions.RayError as err:  # that learner is gone: others may get it
            logger.debug("a publication did not reach a learner: %s", err)
            ok = False
        with self._cond:
            key = self._calls.pop(call, None)
            if key is None:  # dropped when another call of its publication succeeded
                return
            left = self._sends.get(key)
            if left is None:
                return  # already delivered through another call
            if ok:
                del self._sends[key]
                for other in [c for c, k in self._calls.items() if k == key]:
                    del self._calls[other]
            elif left > 1:
                self._sends[key] = left - 1
                return
            else:
                del self._sends[key]  # nobody got it: it never counts
        (self._delivered if ok else self._undelivered)(*key)
