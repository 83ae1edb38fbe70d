"""Layer: control (pure Python threading; no Ray, no JAX). Emulated link delays.

A WAN link between a region and the synchronizer's region is emulated by holding each transfer
for the time that link would take (`simulate.link_seconds`) before the Ray call that carries it
is made. Actor methods must never sleep, so the synchronizer (downstream publications) and each
learner (upstream contributions) hand their calls to a `DelayedCalls`: one daemon thread and a
heap of (due time, call). Calls with zero delay run on that thread at once, in order.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class DelayedCalls:
    """Run callables at monotonic due times on one background thread."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> None:
        """Run `fn()` after `delay_s` seconds (0: as soon as the thread gets to it)."""
        with self._cond:
            if self._closed:
                logger.debug("%s: closed, dropping a call", self.name)
                return
            heapq.heappush(self._heap, (time.monotonic() + max(0.0, delay_s), next(self._seq), fn))
            self._cond.notify()

    def pending(self) -> int:
        with self._cond:
            return len(self._heap)

    def close(self, drain_s: float = 0.0) -> None:
        """Stop the thread. Calls due within `drain_s` seconds still run; later ones are
        dropped (a link that is torn down delivers nothing more)."""
        deadline = time.monotonic() + drain_s
        with self._cond:
            self._heap = [e for e in self._heap if e[0] <= deadline]
            heapq.heapify(self._heap)
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=drain_s + 5.0)

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if not self._heap:
                        if self._closed:
                            return
                        self._cond.wait()
                        continue
                    due = self._heap[0][0]
                    wait = due - time.monotonic()
                    if wait <= 0:
                        _, _, fn = heapq.heappop(self._heap)
                        break
                    self._cond.wait(timeout=wait)
            try:
                fn()
            except Exception:  # one failed transfer must not stop the link
                logger.exception("%s: delayed call failed", self.name)
