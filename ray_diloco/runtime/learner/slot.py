"""Layer: runtime (Ray shell). One learner as the supervisor sees it: its current incarnation's
`LearnerGroup`, the heartbeats in flight to its hosts, and the thread that (re)starts it.

The supervisor's control loop never blocks on a learner: `launch` reserves the placement (or
reuses the previous one when the failure did not need a new one), creates the host actors and
starts them on a background thread; `poll` collects ping answers that are ready and sends a new
ping to every host that has none in flight, so a hung host accumulates no calls; `kill` fences
an incarnation by killing its host actors at once (and releases its placement group when the
group must be rebuilt). A launch that a newer incarnation superseded kills what it created.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

import ray

from ray_diloco.config import LearnerGroupConfig, RunConfig
from ray_diloco.control.events import FailureKind
from ray_diloco.control.protocol import HostPing, HostStatus
from ray_diloco.runtime.errors import PLACEMENT, TRANSIENT_KINDS, classify_ray_error
from ray_diloco.runtime.learner.group import LearnerGroup
from ray_diloco.runtime.resources import LearnerPlacement, release
from ray_diloco.runtime.supervisor.faults import HostRef

logger = logging.getLogger(__name__)

Answer = tuple[int, HostPing | None, FailureKind | None, str]  # host, reply, failure, why


def failure_kind(err: BaseException) -> FailureKind | None:
    """The failure a Ray error means for a learner; None for transient errors (the call may
    simply be retried: a silent host is caught by the heartbeat timeout instead)."""
    kind = classify_ray_error(err)
    if kind == PLACEMENT:
        return FailureKind.NODE_LOST  # its placement group is gone: rebuild the group
    if kind in TRANSIENT_KINDS:
        return None
    return FailureKind(kind)


class LearnerSlot:
    def __init__(
        self,
        cfg: RunConfig,
        lg: LearnerGroupConfig,
        index: int,
        *,
        log_level: str,
        pin_region: bool,
        placement_timeout_s: float,
    ) -> None:
        self.cfg, self.lg, self.index = cfg, lg, index
        self.name = lg.name
        self.log_level, self.pin_region = log_level, pin_region
        self.placement_timeout_s = placement_timeout_s
        self._lock = threading.Lock()
        self.incarnation = -1
        self.group: LearnerGroup | None = None
        self.started = False  # the current group's hosts acknowledged start()
        self._reuse: LearnerPlacement | None = None  # a placement kept for the next launch
        self._failure: tuple[int, FailureKind, str] | None = None
        self._pings: dict[int, Any] = {}
        self.info: dict[int, HostPing] = {}  # host -> its last answer

    # -- starting -----------------------------------------------------------------------------

    def launch(self, incarnation: int) -> None:
        """Start `incarnation` in the background (placement, host actors, their loops)."""
        with self._lock:
            self.incarnation, self.started = incarnation, False
            self.group, self._pings, self.info = None, {}, {}
            reuse, self._reuse = self._reuse, None
        threading.Thread(
            target=self._launch, args=(incarnation, reuse), name=f"launch-{self.name}", daemon=True
        ).start()

    def _launch(self, incarnation: int, reuse: LearnerPlacement | None) -> None:
        group = LearnerGroup(
            self.cfg,
            self.lg,
            self.index,
            incarnation=incarnation,
            log_level=self.log_level,
            pin_region=self.pin_region,
        )
        t0 = time.monotonic()
        try:
            group.create(self.placement_timeout_s, placement=reuse)
            with self._lock:
                current = incarnation == self.incarnation
                if current:
                    self.group = group
            if not current:
                raise _Superseded
            group.start()
        except _Superseded:
            logger.info(
                "learner %s incarnation %d superseded while starting", self.name, incarnation
            )
            group.kill()
            group.release()
            return
        except Exception as err:
            kind = failure_kind(err) or FailureKind.CRASH
            with self._lock:
                current = incarnation == self.incarnation
                if current:
                    self._failure = (incarnation, kind, f"start failed: {err}")
            if current:
                logger.warning("learner %s failed to start: %s", self.name, err)
                group.kill()
                group.release()
            # else: the supervisor fenced this incarnation meanwhile and decided about its
            # placement group (kept for the next incarnation or released)
            return
        with self._lock:
            if incarnation == self.incarnation:
                self.started = True
        logger.info(
            "learner %s incarnation %d started in %.1fs",
            self.name,
            incarnation,
            time.monotonic() - t0,
        )

    def take_failure(self) -> tuple[int, FailureKind, str] | None:
        """A failed launch of the current incarnation, once."""
        with self._lock:
            failure, self._failure = self._failure, None
        return failure

    # -- heartbeats ---------------------------------------------------------------------------

    def poll(self) -> list[Answer]:
        """Answers that arrived since the last poll; pings every host with none in flight."""
        with self._lock:
            group, incarnation = self.group, self.incarnation
        if group is None or not group.hosts:
            return []
        answers: list[Answer] = []
        refs = list(self._pings.values())
        done = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) if refs else set()
        for host, ref in list(self._pings.items()):
            if ref not in done:
                continue
            del self._pings[host]
            try:
                reply = ray.get(ref)
            except ray.exceptions.RayError as err:
                kind = failure_kind(err)
                if kind is not None:
                    answers.append((host, None, kind, f"host {host}: {type(err).__name__}"))
                continue
            if reply.incarnation == incarnation:
                self.info[host] = reply
                answers.append((host, reply, None, ""))
        for host, handle in enumerate(group.hosts):
            if host not in self._pings:
                self._pings[host] = handle.ping.remote()
        return answers

    def hosts(self) -> list[HostRef] | None:
        """The current incarnation's hosts once they all answered a ping (for the chaos engine)."""
        with self._lock:
            group = self.group
        if group is None or not self.started or len(self.info) < len(group.hosts):
            return None
        return [
            HostRef(h, i, self.info[i].pid, self.info[i].node_id)
            for i, h in enumerate(group.hosts)
        ]

    # -- fencing and the end ------------------------------------------------------------------

    def kill(self, rebuild: bool) -> None:
        """Fence the current incarnation: kill its host actors now. Without `rebuild` its
        placement group is kept for the next incarnation (same hosts, no new reservation)."""
        with self._lock:
            group, self.group, self.started = self.group, None, False
            self._pings, self.info = {}, {}
            self.incarnation = -1  # a launch still running for it sees it was superseded
        if group is None:
            return
        group.kill()
        if rebuild or group.placement is None:
            group.release()
        else:
            with self._lock:
                self._reuse = group.placement

    def give_placement(self, placement: LearnerPlacement) -> None:
        """Launch the next incarnation on `placement` (reserved by the scavenger)."""
        with self._lock:
            self._reuse = placement

    def leave(self, reason: str) -> bool:
        """Ask the learner to leave gracefully (host 0 sends its last report and unsent
        work first, then every host stops); False when no incarnation is running."""
        with self._lock:
            group = self.group
        if group is None or not group.hosts or not self.started:
            return False
        for host in group.hosts:
            host.leave.remote(reason)
        return True

    def stop(self, timeout_s: float, at_budget: bool = False) -> HostStatus | None:
        """Ask the hosts to finish their step and stop (`LearnerGroup.stop`); returns host 0's
        final status."""
        with self._lock:
            group = self.group
        if group is None or not group.hosts:
            return None
        group.stop(timeout_s, at_budget)
        return group.status()

    def release(self) -> None:
        """Kill the hosts and free every placement group this slot holds."""
        self.kill(rebuild=True)
        with self._lock:
            reuse, self._reuse = self._reuse, None
        if reuse is not None:
            release(reuse)


class _Superseded(Exception):
    pass


def make_slot(
    cfg: RunConfig, lg: LearnerGroupConfig, index: int, log_level: str, pin_region: bool
) -> LearnerSlot:
    """The slot of learner `lg` (the index seeds its emulated step-time jitter); a launch may
    wait for its placement group as long as a new incarnation may take to come up."""
    return LearnerSlot(
        cfg,
        lg,
        index,
        log_level=log_level,
        pin_region=pin_region,
        placement_timeout_s=cfg.supervisor.startup_timeout_s,
    )


def stop_all(
    slots: Iterable[LearnerSlot], timeout_s: float, at_budget: bool = False
) -> dict[str, HostStatus]:
    """Stop every learner at once (each waits for its hosts' loops); host 0's final status of
    each learner that was still alive."""
    finals: dict[str, HostStatus | None] = {}

    def stop(slot: LearnerSlot) -> None:
        finals[slot.name] = slot.stop(timeout_s, at_budget)

    threads = [threading.Thread(target=stop, args=(s,), name=f"stop-{s.name}") for s in slots]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return {name: st for name, st in finals.items() if st is not None}
