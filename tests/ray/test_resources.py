"""Ray plumbing on a local Ray: learner-group placement, error classification, metrics export."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import pytest
import ray
from ray import exceptions as rex
from ray._raylet import ActorID
from ray.core.generated.common_pb2 import (  # type: ignore[attr-defined]
    ActorDiedErrorContext,
    NodeDeathInfo,
)
from ray.util.placement_group import placement_group_table

from ray_diloco.config import LearnerGroupConfig
from ray_diloco.runtime.errors import PlacementTimeoutError, classify_ray_error
from ray_diloco.runtime.metrics import Metrics
from ray_diloco.runtime.resources import (
    head_pin_options,
    host_options,
    placement_state,
    release,
    reserve_learner_group,
)
from tests.cluster_helpers import first_error, scrape_metrics

pytestmark = pytest.mark.ray


def _died(message: str, preempted: bool = False) -> rex.ActorDiedError:
    reason = NodeDeathInfo.AUTOSCALER_DRAIN_PREEMPTED if preempted else NodeDeathInfo.UNSPECIFIED
    ctx = ActorDiedErrorContext(
        error_message=message,
        actor_id=b"\x01" * ActorID.size(),
        node_death_info=NodeDeathInfo(reason=reason),
    )
    return rex.ActorDiedError(ctx)


NODE_DIED = "The actor died because its node has died. Node Id: 0a1b"
CONSTRUCTED = [
    (rex.ActorDiedError(), "crash"),
    (_died("The actor is dead because its worker process has died."), "crash"),
    (_died("The actor is dead because it was killed by `ray.kill`."), "crash"),
    (_died(NODE_DIED), "node_lost"),
    (_died(NODE_DIED, preempted=True), "preemption"),
    (
        _died("Worker exit detail: Destroying worker since its placement group was removed."),
        "placement",
    ),
    (rex.RayActorError(), "crash"),
    (rex.ActorUnavailableError("connection reset", None), "unavailable"),
    (rex.NodeDiedError("node 0a1b died"), "node_lost"),
    (rex.LocalRayletDiedError(), "node_lost"),
    (rex.GetTimeoutError("get timed out"), "hang"),
    (rex.ActorPlacementGroupRemoved(), "placement"),
    (rex.ActorUnschedulableError("node affinity to a dead node"), "placement"),
    (PlacementTimeoutError("learner 'a' not placed"), "placement"),
    (rex.ObjectLostError("ab" * 14, None, ""), "object_lost"),
    (rex.OwnerDiedError("ab" * 14, None, ""), "object_lost"),
    (rex.RayTaskError("step", "tb", ValueError("bad batch")), "crash"),
    (rex.RayTaskError("pull", f"ActorDiedError: {NODE_DIED}", _died(NODE_DIED)), "node_lost"),
    (rex.RayTaskError("pull", "tb", rex.GetTimeoutError("slow")), "hang"),
    (ValueError("anything else"), "crash"),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("exc", "kind"), CONSTRUCTED, ids=lambda v: type(v).__name__)
def test_classify_constructed_errors(exc: BaseException, kind: str) -> None:
    assert classify_ray_error(exc) == kind


@pytest.mark.timeout(30)
def test_metrics_module_never_imports_ray() -> None:
    code = (
        "import sys; from ray_diloco.runtime.metrics import Metrics; "
        "m = Metrics.create(True, 'r'); "
        "m.tokens('a', 5); m.heldout_loss(1.0); assert not m.enabled; "
        "assert 'ray' not in sys.modules, 'ray imported'"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, timeout=25)


# Decorated in place: the module then holds the ActorClass, not the class, so Ray pickles
# the class by value (workers cannot import pytest's test modules by name).
@ray.remote(num_cpus=0)
class _Probe:
    def where(self) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        return {
            "node_id": ctx.get_node_id(),
            "pg_id": ctx.get_placement_group_id(),
            "jax_platforms": os.environ.get("JAX_PLATFORMS"),
            "niceness": os.nice(0),
        }

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def crash(self) -> None:
        os._exit(1)  # a hard process death, as a segfault or the OOM killer would cause

    def count_tokens(self, learner: str, n: int) -> bool:
        self.metrics = Metrics.create(True, "probe")  # kept alive with the actor
        self.metrics.tokens(learner, n)
        self.metrics.step_time(learner, 0.05)
        return self.metrics.enabled


Probe: Any = _Probe  # Any: Ray's actor typing needs @ray.method on each method


@pytest.mark.timeout(60)
def test_cpu_group_places_hosts_on_bundles(ray_local: Any) -> None:
    lg = LearnerGroupConfig(name="cpu-a", num_hosts=2, batch_size=8)
    placement = reserve_learner_group(lg, name_prefix="t", detached=True, timeout_s=30)
    assert placement_state(placement) == "CREATED"
    # named, so a restarted supervisor can find (and release) a detached group
    assert ray.util.get_placement_group("t-cpu-a") == placement.placement_group
    assert placement.num_hosts == 2 and placement.bundle_resources == {"CPU": 1.0}
    actors = [Probe.options(**host_options(placement, i)).remote() for i in range(2)]
    infos = ray.get([a.where.remote() for a in actors], timeout=30)
    table = placement_group_table(placement.placement_group)
    assert table["strategy"] == "SPREAD"
    for i, info in enumerate(infos):
        assert info["pg_id"] == placement.placement_group.id.hex()
        assert info["node_id"] == table["bundles_to_node_id"][i]
        assert info["jax_platforms"] == "cpu"
        # not Ray's default 15: a host must get its share of a busy machine's CPU
        assert info["niceness"] == 0
    release(placement)
    release(placement)  # idempotent
    assert placement_state(placement) == "REMOVED"
    # Ray kills the actors of a removed group
    evicted = first_error(lambda: ray.get(actors[0].where.remote(), timeout=30), timeout_s=30)
    assert classify_ray_error(evicted) == "placement", str(evicted)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [({"cpus_per_host": 16.0}, "'CPU': 16.0"), ({"region": "mars-north1"}, "mars-north1")],
)
def test_unplaceable_group_times_out_clearly(
    ray_local: Any, kwargs: dict[str, Any], needle: str
) -> None:
    lg = LearnerGroupConfig(name="too-big", **kwargs)
    start = time.monotonic()
    with pytest.raises(PlacementTimeoutError) as info:
        reserve_learner_group(lg, name_prefix="t", detached=False, timeout_s=1.0)
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert "'too-big'" in message and needle in message and "not ready after 1.0 s" in message
    assert classify_ray_error(info.value) == "placement"
    states = [pg["state"] for pg in placement_group_table().values() if pg["name"] == "t-too-big"]
    assert set(states) <= {"REMOVED"}  # the pending group was cleaned up


@pytest.mark.timeout(60)
def test_classify_real_dead_and_slow_actors(ray_local: Any) -> None:
    actor = Probe.options(**head_pin_options()).remote()
    ray.get(actor.where.remote(), timeout=30)
    with pytest.raises(rex.GetTimeoutError) as slow:
        ray.get(actor.sleep.remote(5), timeout=0.2)
    assert classify_ray_error(slow.value) == "hang"
    ray.kill(actor)
    with pytest.raises(rex.RayActorError) as dead:
        ray.get(actor.where.remote(), timeout=30)
    assert isinstance(dead.value, rex.ActorDiedError)
    assert "ray.kill" in dead.value.error_msg
    assert classify_ray_error(dead.value) == "crash"
    crashing = Probe.remote()
    ray.get(crashing.where.remote(), timeout=30)
    with pytest.raises(rex.RayActorError) as crashed:
        ray.get(crashing.crash.remote(), timeout=30)
    assert "worker process has died" in crashed.value.error_msg
    assert classify_ray_error(crashed.value) == "crash"


@pytest.mark.timeout(120)
def test_counter_reaches_prometheus_endpoint(ray_local: Any) -> None:
    assert not Metrics.create(False, "probe").enabled
    actor = Probe.remote()
    assert ray.get(actor.count_tokens.remote("L0", 128), timeout=30)
    port = ray_local.metrics_export_port
    text = scrape_metrics(port, lambda text: 'run="probe"' in text)
    lines = [
        ln
        for ln in text.splitlines()
        if ln.startswith("ray_diloco_tokens_total{") and 'run="probe"' in ln
    ]
    assert lines, f"ray_diloco_tokens_total not exported on port {port}"
    assert 'learner="L0"' in lines[0]
    assert float(lines[0].rsplit(" ", 1)[1]) == 128.0
    assert "ray_diloco_inner_step_seconds_bucket" in text
    ray.kill(actor)
