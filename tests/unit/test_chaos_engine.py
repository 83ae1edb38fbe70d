"""The chaos engine's order of injection (no Ray: its calls into Ray are replaced)."""

from __future__ import annotations

import threading
import time

from ray_diloco.config import build_config
from ray_diloco.control.chaos import FaultAction
from ray_diloco.control.events import Event, FaultInjected
from ray_diloco.runtime.supervisor import faults
from ray_diloco.runtime.supervisor.faults import ChaosEngine, HostRef


class _Host:
    """A learner host whose corruption hook takes a while to answer, as a remote call does."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls
        self.inject_fault = self

    def remote(self, kind: str) -> str:
        time.sleep(0.3)
        self.calls.append(kind)
        return kind


class _Targets:
    def __init__(self, host: _Host) -> None:
        self.host = host

    def hosts(self, learner: str) -> list[HostRef]:
        return [HostRef(self.host, 0, 1, "node-1")]


def test_faults_on_one_learner_are_injected_one_at_a_time_in_schedule_order(monkeypatch):
    # A corruption and a kill due together on one learner (as when both waited for its
    # restart): the kill must not land while the corruption is still being armed, or the
    # corruption sits in the process the kill took and is neither seen nor superseded.
    calls: list[str] = []
    monkeypatch.setattr(faults, "_head_node_id", lambda: None)
    monkeypatch.setattr(faults.ray, "get", lambda ref, timeout=None: ref)
    monkeypatch.setattr(faults.ray, "kill", lambda handle, no_restart: calls.append("kill"))
    recorded: list[Event] = []
    done = threading.Event()

    def record(e: Event) -> None:
        recorded.append(e)
        if len(recorded) == 2:
            done.set()

    actions = [FaultAction(1.0, "corrupt_norm", "eu"), FaultAction(1.5, "kill_group", "eu")]
    cfg = build_config({"chaos": {"enabled": True, "seed": 0}})
    engine = ChaosEngine(actions, _Targets(_Host(calls)), record, time.monotonic, cfg)  # type: ignore[arg-type]
    try:
        engine.tick(0.0, started=True)
        engine.tick(2.0, started=True)  # both due at once
        assert done.wait(timeout=10.0), recorded
    finally:
        engine.close()
    assert calls == ["corrupt_norm", "kill"]
    kinds = [(e.fault, e.t) for e in recorded if isinstance(e, FaultInjected)]
    assert [k for k, _ in kinds] == ["corrupt_norm", "kill_group"]
    assert kinds[0][1] < kinds[1][1]  # on the tape too: the kill comes after
    assert (engine.injected, engine.skipped) == (2, 0)
