"""Layer: runtime (Ray shell). The chaos engine: carries out `control.chaos` fault actions.

The supervisor's control loop calls `ChaosEngine.tick(now, started)` with its run clock. The
schedule's times count from the first tick at which every learner's first start is over (it
trains, or it failed and was restarted): faults are meant for a running system, however long
its boot took. (The clock used to start at the startup timeout too: at load 26 on 2 cores the
learners' boot and compile took 69 s, and a 4 s link cut injected at 62 s, while they still
compiled, was never noticed.) Due actions
(`control.chaos.due`) are executed on a worker thread so an injection that needs a task on a
remote node never delays heartbeats, and each one is recorded as `FaultInjected` (run-clock
time) once it took effect. How each fault is made real:

- kill_host / kill_group: `ray.kill` of one (seeded pick) or every host actor of the learner;
- remove_node: a zero-CPU task pinned (NodeAffinitySchedulingStrategy) to the node of one of
  the learner's hosts SIGKILLs that node's raylet, so the node dies as a whole (never the head);
- hang_host: a pinned task SIGSTOPs the host's process for `duration_s`, then SIGCONTs it;
- straggler / corrupt_nan / corrupt_norm: hooks on `LearnerHost` (algorithm/host_faults.py);
- cut_link / slow_link: the region's emulated WAN link, impaired for `duration_s` both in the
  synchronizer (downstream) and in every learner of the region (upstream);
- kill_synchronizer: `ray.kill(..., no_restart=False)` of the target shard (default 0): Ray
  reconstructs it, and it recovers from its checkpoint, its round log and the learners
  (`during_checkpoint`: right after it began writing a checkpoint).
A fault whose target learner is down (being restarted) when it is due waits until it is back
(checked every `WAIT_S`) and is injected then: on a loaded machine a restart takes a minute, and
a storm used to skip half its faults. Faults on one target are injected one at a time, in
schedule order, each recorded before the next starts: a corruption and a kill that waited for
the same restart used to go at once, and the kill could come first on the tape while the
corruption was armed in the process it killed (then never detected, nor superseded).
One that cannot be injected at all (a host on the head node, never removed) is skipped, not
recorded.
`FaultInjected` carries the time the fault took effect (the signal's own clock for hang_host;
for the others, the moment the engine issued it), not the time the engine heard back: on a busy
machine that reply can come after the supervisor already saw the failure (a node kill's task
fails only once Ray declared the node dead), and a detection must never precede its fault.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import signal
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_diloco.config import RunConfig
from ray_diloco.control.chaos import FaultAction, due
from ray_diloco.control.delay import DelayedCalls
from ray_diloco.control.events import Event

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 20.0
WAIT_S = 0.5  # how often a fault whose target is down looks again
Injected = tuple[str, float]  # what was done, and when it took effect (run clock)


@dataclass(frozen=True)
class HostRef:
    """A live host actor of a learner's current incarnation and where its process runs."""

    handle: Any
    index: int
    pid: int | None
    node_id: str | None


class Targets(Protocol):
    """What the engine needs from the supervisor."""

    def hosts(self, learner: str) -> list[HostRef] | None:
        """The learner's hosts, or None while it is down or starting."""

    def learners_in(self, region: str) -> list[str]: ...

    def synchronizer(self, shard: int = 0) -> Any: ...

    def synchronizer_shards(self) -> list[Any]: ...

    def synchronizer_killed(self, shard: int, rounds: int | None) -> None:
        """Called right before shard `shard` is killed, with its closed rounds."""


@ray.remote(num_cpus=0, max_retries=0)
def _signal_process(pid: int, signum: int) -> float:
    """Signal `pid`; returns when (wall clock) the signal was sent."""
    os.kill(pid, signum)
    return time.time()


@ray.remote(num_cpus=0, max_retries=0)
def _kill_own_raylet() -> int:
    """SIGKILL the raylet of the node this task runs on (its worker's parent process)."""
    import psutil

    for parent in psutil.Process().parents():
        if parent.name() == "raylet":
            os.kill(parent.pid, signal.SIGKILL)
            return int(parent.pid)
    raise RuntimeError("no raylet among this worker's parent processes")


class ChaosEngine:
    def __init__(
        self,
        actions: list[FaultAction],
        targets: Targets,
        record: Callable[[Event], None],
        clock: Callable[[], float],
        cfg: RunConfig,
    ) -> None:
        self.actions = actions
        self.targets, self.record, self.clock = targets, record, clock
        self.seed = cfg.chaos.seed
        self.t0: float | None = None  # run-clock time the schedule's clock starts
        self._last = float("-inf")
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="chaos")
        self._later = DelayedCalls("chaos-undo")
        self._head = _head_node_id()
        self._lock = threading.Lock()
        # Submitted and not yet injected or skipped, in schedule order: faults on one target go
        # one at a time in that order (see the module's docstring).
        self._pending: list[FaultAction] = []
        self.injected = 0
        self.skipped = 0

    def tick(self, now: float, started: bool) -> None:
        """Start every action due since the last tick (each exactly once); `started`: every
        learner's first start is over."""
        if self.t0 is None:
            if not started:
                return
            self.t0 = now
            logger.info("chaos clock starts at t=%.1fs", now)
        for action in due(self.actions, self._last, now - self.t0):
            self._submit(action)
        self._last = now - self.t0

    def close(self) -> None:
        self._last = float("inf")  # nothing more becomes due
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._later.close(drain_s=0.0)

    # -- injections (worker threads) ----------------------------------------------------------

    def _inject(self, a: FaultAction) -> None:
        with self._lock:  # (by identity: two equal actions of a schedule are two faults)
            earlier = itertools.takewhile(lambda p: p is not a, self._pending)
            if any(p.target == a.target for p in earlier):
                self._later.call_later(WAIT_S, lambda: self._submit(a))
                return
        detail: str | None = None
        try:
            detail, at = getattr(self, f"_{a.kind}")(a)
        except _Down as err:
            logger.info("chaos: %s on %s waits: %s", a.kind, a.target, err)
            self._later.call_later(WAIT_S, lambda: self._submit(a))
            return
        except _Skip as err:
            logger.warning("chaos: %s on %s skipped: %s", a.kind, a.target, err)
        except Exception:
            logger.exception("chaos: %s on %s failed", a.kind, a.target)
        if detail is not None:
            logger.warning("chaos: injected %s on %s (%s)", a.kind, a.target, detail)
            self.record(a.to_event(at, detail))
        with self._lock:  # recorded first: the next fault on this target comes after it
            self._pending = [p for p in self._pending if p is not a]
            if detail is None:
                self.skipped += 1
            else:
                self.injected += 1

    def _submit(self, a: FaultAction) -> None:
        with self._lock:
            if not any(p is a for p in self._pending):  # (a retry is in the list already)
                self._pending.append(a)
        try:
            self._pool.submit(self._inject, a)
        except RuntimeError:  # closed: the run is over
            logger.info("chaos: %s on %s not injected: the run ended", a.kind, a.target)

    def _hosts(self, a: FaultAction) -> list[HostRef]:
        hosts = self.targets.hosts(str(a.target))
        if not hosts:
            raise _Down(f"learner {a.target} is down")
        return hosts

    def _pick(self, a: FaultAction, hosts: list[HostRef]) -> HostRef:
        # Seeded per action: the same schedule picks the same host in every run.
        label = f"{self.seed}/{a.at_s}/{a.kind}/{a.target}".encode()
        return random.Random(zlib.crc32(label)).choice(hosts)

    def _kill_host(self, a: FaultAction) -> Injected:
        h = self._pick(a, self._hosts(a))
        at = self.clock()
        ray.kill(h.handle, no_restart=True)
        return f"host {h.index} (pid {h.pid})", at

    def _kill_group(self, a: FaultAction) -> Injected:
        hosts = self._hosts(a)
        at = self.clock()
        for h in hosts:
            ray.kill(h.handle, no_restart=True)
        return f"{len(hosts)} host(s)", at

    def _remove_node(self, a: FaultAction) -> Injected:
        h = self._pick(a, self._hosts(a))
        if h.node_id is None or h.node_id == self._head:
            raise _Skip(f"host {h.index} runs on the head node; the head is never removed")
        at = self.clock()  # the task kills its own raylet: nothing comes back to time it by
        ref = _kill_own_raylet.options(scheduling_strategy=_on(h.node_id)).remote()
        try:
            pid = ray.get(ref, timeout=CALL_TIMEOUT_S)
        except ray.exceptions.RayError:
            pid = None  # the task's own node died under it: the kill went through
        return f"node {h.node_id[:12]} of host {h.index} (raylet pid {pid})", at

    def _hang_host(self, a: FaultAction) -> Injected:
        h = self._pick(a, self._hosts(a))
        if h.pid is None or h.node_id is None:
            raise _Down(f"host {h.index} has not reported its process yet")
        sent = ray.get(
            _signal_process.options(scheduling_strategy=_on(h.node_id)).remote(
                h.pid, signal.SIGSTOP
            ),
            timeout=CALL_TIMEOUT_S,
        )
        self._later.call_later(a.duration_s, lambda: _resume(h))
        at = sent + self.clock() - time.time()  # the signal's wall-clock time on the run clock
        return f"host {h.index} (pid {h.pid}) stopped for {a.duration_s:.1f}s", at

    def _straggler(self, a: FaultAction) -> Injected:
        hosts = self._hosts(a)
        at = self.clock()
        refs = [h.handle.inject_fault.remote("straggler", a.duration_s, a.factor) for h in hosts]
        ray.get(refs, timeout=CALL_TIMEOUT_S)
        return f"{a.factor:g}x slower for {a.duration_s:.1f}s", at

    def _corrupt(self, a: FaultAction) -> Injected:
        h = self._hosts(a)[0]  # host 0 offers the learner's contributions
        at = self.clock()
        ray.get(h.handle.inject_fault.remote(a.kind), timeout=CALL_TIMEOUT_S)
        return "next contribution", at

    _corrupt_nan = _corrupt
    _corrupt_norm = _corrupt

    def _link(self, a: FaultAction, factor: float | None) -> Injected:
        region = str(a.target)
        at = self.clock()
        shards = self.targets.synchronizer_shards()
        refs = [h.impair_link.remote(region, a.duration_s, factor) for h in shards]
        for learner in self.targets.learners_in(region):
            hosts = self.targets.hosts(learner)
            if hosts:
                refs.append(hosts[0].handle.impair_link.remote(region, a.duration_s, factor))
        ray.get(refs, timeout=CALL_TIMEOUT_S)
        what = "cut" if factor is None else f"{factor:g}x slower"
        return f"{what} for {a.duration_s:.1f}s", at

    def _cut_link(self, a: FaultAction) -> Injected:
        return self._link(a, None)

    def _slow_link(self, a: FaultAction) -> Injected:
        return self._link(a, a.factor)

    def _kill_synchronizer(self, a: FaultAction) -> Injected:
        shard = int(a.target or 0)
        sync = self.targets.synchronizer(shard)
        try:
            rounds: int | None = ray.get(sync.status.remote(), timeout=CALL_TIMEOUT_S).rounds
        except ray.exceptions.RayError:
            rounds = None
        # A checkpoint write just begun is still being written when the kill lands.
        writing = a.during_checkpoint and bool(
            ray.get(sync.begin_checkpoint.remote(), timeout=CALL_TIMEOUT_S)
        )
        self.targets.synchronizer_killed(shard, rounds)
        at = self.clock()
        ray.kill(sync, no_restart=False)
        what = f"shard {shard} at {rounds} rounds" + (", writing a checkpoint" if writing else "")
        return what, at


class _Skip(Exception):
    """The fault cannot be injected on this target; not an error."""


class _Down(_Skip):
    """The fault's target is down or still starting: it waits."""


def _on(node_id: str) -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


def _resume(h: HostRef) -> None:
    assert h.pid is not None and h.node_id is not None
    try:
        ref = _signal_process.options(scheduling_strategy=_on(h.node_id)).remote(
            h.pid, signal.SIGCONT
        )
        ray.get(ref, timeout=CALL_TIMEOUT_S)
        logger.warning("chaos: host %d (pid %d) resumed", h.index, h.pid)
    except Exception as err:  # the supervisor may have killed the hung process already
        logger.info("chaos: resuming pid %s: %s", h.pid, err)


def _head_node_id() -> str | None:
    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in node.get("Resources", {}):
            return str(node["NodeID"])
    return None
