"""Elastic membership on the emulated multi-node cluster: a node added mid-run gets
a scavenged learner that contributes merged rounds; drained (a preemption notice), the node
loses that learner gracefully: no restart, no fault, nothing lost, the others go on. One run
for both: two runs of this length cost CI 220 s."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ray_diloco.config import build_config
from ray_diloco.control.events import FailureDetected, LearnerJoined, LearnerLeft, RoundClosed
from ray_diloco.control.protocol import SupervisorStatus
from ray_diloco.control.tape import read_tape
from tests.chaos.chaos_helpers import chaos_tree, training_uptime
from tests.cluster_helpers import add_cpu_host

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]

SPARE_REGION = "asia-east1"
FINISHED = "the test's steps done and the budget spent"
CEILING_TOKENS = 1_600_000


class Background:
    """`run_training` on a thread: the test's main thread changes the cluster meanwhile
    (`Cluster.add_node` must run on the main thread). The run's `token_budget` is a ceiling:
    it stops once the test called `finish()` and its planned budget (`inner.decay_tokens`) is
    spent, however long the test's steps took (a new node's boot and compile take a minute at
    load). Use as a context manager: a test that fails ends the run before the module's cluster
    is torn down."""

    def __init__(self, cfg: Any) -> None:
        from ray_diloco.runtime.driver import run_training

        self.cfg, self.summary, self.error = cfg, None, None
        self._abort, self._finish = threading.Event(), threading.Event()

        def stop(sup: SupervisorStatus) -> str | None:
            if self._abort.is_set():
                return "test ended"
            spent = sup.synchronizer.tokens >= cfg.inner.decay_tokens
            return FINISHED if self._finish.is_set() and spent else None

        def run() -> None:
            try:
                self.summary = run_training(cfg, progress=lambda line: None, stop_when=stop)
            except BaseException as err:
                self.error = err

        self.thread = threading.Thread(target=run, name="training", daemon=True)
        self.thread.start()

    def __enter__(self) -> Background:
        return self

    def __exit__(self, *exc: object) -> None:
        self._abort.set()
        self.thread.join(timeout=300)

    def events(self) -> list[Any]:
        path = Path(self.cfg.run_dir) / "events.jsonl"
        return read_tape(path) if path.exists() else []

    def wait_for(self, what: str, condition: Any, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition(self.events()):
            assert self.thread.is_alive(), f"the run ended before {what}: {self.error}"
            assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
            time.sleep(0.5)

    def finish(self) -> dict[str, Any]:
        """End the run once its planned budget is spent; its summary."""
        self._finish.set()
        self.thread.join(timeout=240)
        assert self.error is None, self.error
        assert self.summary is not None
        return self.summary


def _rounds(events: list[Any]) -> int:
    return sum(isinstance(e, RoundClosed) for e in events)


def _config(tmp_path: Path, name: str, budget: int, **elastic: Any) -> Any:
    tree = chaos_tree(budget, [])
    # The ceiling: about 3 minutes of paced training with 3 learners (3.2k tokens/s each).
    tree.update(run_dir=str(tmp_path / name), token_budget=CEILING_TOKENS)
    tree["synchronizer"]["name"] = f"sync-{name}"
    tree["elastic"] = {"lease_tokens": 2048, **elastic}
    return build_config(tree, f"elastic test {name}")


def _check_exact(summary: dict[str, Any], budget: int) -> None:
    assert summary["tokens"] >= budget and summary["stop_reason"] == FINISHED
    assert summary["ledger_violations"] == []  # no token read twice, none lost or double-merged
    assert summary["tokens"] == sum(a["tokens"] for a in summary["learners"].values())


def test_spare_capacity_is_scavenged_then_drained_gracefully(
    tpu_cluster: Any, tmp_path: Path
) -> None:
    # The life of scavenged capacity, in one run: a node appears mid-run and gets a learner,
    # whose rounds are merged; a preemption notice drains the node and its learner leaves
    # gracefully while the others go on.
    import ray
    from ray.core.generated import autoscaler_pb2

    template = {"name": "spare", "region": SPARE_REGION, "batch_size": 8, "speed": 1.0}
    # The planned budget is the least the run trains (8 s idle); the test's steps set how long
    # it runs: a new node's boot and its learner's compile take a minute at load. (It was 400k
    # tokens, over a minute of paced training whatever the steps took.)
    cfg = _config(
        tmp_path, "scavenge", 48_000, scavenge=True, templates=[template], scavenge_interval_s=1
    )
    with Background(cfg) as run:
        run.wait_for("rounds", lambda ev: _rounds(ev) >= 10)
        node = add_cpu_host(tpu_cluster.cluster, SPARE_REGION)  # spare capacity appears
        with _removed_at_exit(tpu_cluster, node):
            run.wait_for(
                "a scavenged learner", lambda ev: any(isinstance(e, LearnerJoined) for e in ev)
            )
            run.wait_for("its merged rounds", lambda ev: _merged(run, "spare-0") >= 2)
            # A preemption notice with a minute to go: the learner has time to leave.
            gcs = ray._raylet.GcsClient(address=tpu_cluster.cluster.address)  # type: ignore[attr-defined]
            reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")  # type: ignore[attr-defined]
            accepted, why = gcs.drain_node(
                node.node_id, reason, "emulated preemption notice", int((time.time() + 60) * 1000)
            )
            assert accepted, why
            drained_t = max(e.t for e in run.events())
            run.wait_for("the leave", lambda ev: any(isinstance(e, LearnerLeft) for e in ev))
            summary = run.finish()
    events = run.events()
    joined = [e for e in events if isinstance(e, LearnerJoined)]
    assert [(e.learner, e.reason) for e in joined] == [("spare-0", "scavenged")]
    (left,) = [e for e in events if isinstance(e, LearnerLeft)]
    assert left.learner == "spare-0" and "drained" in left.reason
    assert not [e for e in events if isinstance(e, FailureDetected)]  # a leave is no failure
    spare = summary["learners"]["spare-0"]
    assert spare["restarts"] == 0 and spare["state"] == "left"
    assert spare["contributions_merged"] > 0
    # the others kept closing rounds: the global model never stalled
    assert [e for e in events if isinstance(e, RoundClosed) and e.t > drained_t]
    assert training_uptime(events, summary) == pytest.approx(1.0)
    _check_exact(summary, cfg.inner.decay_tokens)


def _merged(run: Background, learner: str) -> int:
    """Contributions of `learner` merged so far, from the synchronizer's status."""
    import ray

    sync = ray.get_actor(run.cfg.synchronizer.name, namespace=run.cfg.synchronizer.namespace)
    status = ray.get(sync.status.remote(2**62), timeout=60)
    return int(status.contributions_merged.get(learner, 0))


@contextlib.contextmanager
def _removed_at_exit(tpu_cluster: Any, node: Any) -> Iterator[None]:
    try:
        yield
    finally:
        tpu_cluster.cluster.remove_node(node, allow_graceful=False)
