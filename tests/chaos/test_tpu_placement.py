"""Emulated TPU slices in two regions: learner groups land on the right hosts, host loss shows."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest
import ray
import ray.util.tpu

from ray_diloco.config import LearnerGroupConfig
from ray_diloco.runtime.errors import PlacementTimeoutError, classify_ray_error
from ray_diloco.runtime.resources import (
    REGION_LABEL,
    SLICE_LABEL,
    WORKER_ID_LABEL,
    LearnerPlacement,
    head_pin_options,
    host_options,
    placement_state,
    region_options,
    release,
    reserve_learner_group,
)
from tests.cluster_helpers import SLICES, TpuCluster, first_error, node_labels, preempt_host

pytestmark = pytest.mark.chaos

GROUPS = {
    "v5p": LearnerGroupConfig(
        name="v5p-a", accelerator="tpu-v5p", topology="2x2x2", region="us-east5", batch_size=8
    ),
    "v6e": LearnerGroupConfig(
        name="v6e-a",
        accelerator="tpu-v6e",
        topology="2x4",
        num_hosts=2,  # the emulated v6e slice is two 4-chip hosts
        region="europe-west4",
        batch_size=8,
    ),
}


# Decorated in place: the module then holds the ActorClass, not the class, so Ray pickles
# the class by value (workers cannot import pytest's test modules by name).
@ray.remote(num_cpus=0, max_restarts=0)
class _HostProbe:
    def info(self) -> dict[str, Any]:
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "visible_chips": os.environ.get("TPU_VISIBLE_CHIPS"),
            "worker_id": os.environ.get("TPU_WORKER_ID"),
            "jax_platforms": os.environ.get("JAX_PLATFORMS"),
            "pod_name": ray.util.tpu.get_current_pod_name(),
        }


HostProbe: Any = _HostProbe  # Any: Ray's actor typing needs @ray.method on each method


def _start_hosts(placement: LearnerPlacement) -> list[Any]:
    return [
        HostProbe.options(**host_options(placement, i)).remote() for i in range(placement.num_hosts)
    ]


def _wait_until(predicate: Callable[[], bool], timeout_s: float) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, f"condition not met in {timeout_s} s"
        time.sleep(0.2)
    return time.monotonic() - start


@pytest.mark.timeout(180)
def test_region_and_head_options_place_actors(tpu_cluster: TpuCluster) -> None:
    probe = HostProbe.options(**region_options("europe-west4")).remote()
    info = ray.get(probe.info.remote(), timeout=30)
    assert node_labels(info["node_id"])[REGION_LABEL] == "europe-west4"
    pinned = HostProbe.options(**head_pin_options()).remote()
    assert ray.get(pinned.info.remote(), timeout=30)["node_id"] == (
        tpu_cluster.cluster.head_node.node_id
    )
    for actor in (probe, pinned):
        ray.kill(actor)


@pytest.mark.timeout(180)
def test_tpu_groups_land_on_their_slices(tpu_cluster: TpuCluster) -> None:
    placements = {
        kind: reserve_learner_group(lg, name_prefix="chaos", timeout_s=30, emulated=True)
        for kind, lg in GROUPS.items()
    }
    try:
        for kind, placement in placements.items():
            slice_name, _, _, region = SLICES[kind]
            assert placement.num_hosts == 2 and placement_state(placement) == "CREATED"
            assert placement.bundle_resources == {"CPU": 1.0, "TPU": 4}
            actors = _start_hosts(placement)
            infos = ray.get([a.info.remote() for a in actors], timeout=30)
            assert len({i["node_id"] for i in infos}) == 2, "hosts must be distinct nodes"
            for index, info in enumerate(infos):
                labels = node_labels(info["node_id"])
                assert labels[SLICE_LABEL] == slice_name and labels[REGION_LABEL] == region
                # bundle index == TPU worker id == JAX process id
                assert info["worker_id"] == labels[WORKER_ID_LABEL] == str(index)
                assert info["visible_chips"] == "0,1,2,3"
                assert info["jax_platforms"] == "cpu"
                assert info["pod_name"] == slice_name
            for a in actors:
                ray.kill(a)
    finally:
        for placement in placements.values():
            release(placement)
    assert {placement_state(p) for p in placements.values()} == {"REMOVED"}


@pytest.mark.timeout(180)
def test_tpu_group_in_a_region_without_that_slice_times_out(tpu_cluster: TpuCluster) -> None:
    lg = GROUPS["v5p"].model_copy(update={"region": "europe-west4"})
    with pytest.raises(PlacementTimeoutError) as info:
        reserve_learner_group(lg, name_prefix="chaos", timeout_s=1.5)
    message = str(info.value)
    assert "TPU-V5P 2x2x2" in message and "europe-west4" in message


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("kind", "preempt", "expected"), [("v5p", False, "node_lost"), ("v6e", True, "preemption")]
)
def test_losing_a_host_leaves_created_and_a_rejoin_restores_it(
    tpu_cluster: TpuCluster, kind: str, preempt: bool, expected: str
) -> None:
    placement = reserve_learner_group(GROUPS[kind], name_prefix="chaos", timeout_s=30)
    lost = False
    try:
        actors = _start_hosts(placement)
        ray.get([a.info.remote() for a in actors], timeout=30)
        victim = tpu_cluster.hosts[(kind, 1)]
        if preempt:
            preempt_host(tpu_cluster.cluster, victim)
        else:
            tpu_cluster.cluster.remove_node(victim, allow_graceful=False)
        lost = True
        _wait_until(lambda: placement_state(placement) != "CREATED", timeout_s=20)
        assert placement_state(placement) in {"RESCHEDULING", "PENDING"}
        error = first_error(lambda: ray.get(actors[1].info.remote(), timeout=20), timeout_s=20)
        assert classify_ray_error(error) == expected, str(error)
        ray.get(actors[0].info.remote(), timeout=10)  # the surviving host still answers
        tpu_cluster.add_slice_host(kind, 1)
        lost = False
        _wait_until(lambda: placement_state(placement) == "CREATED", timeout_s=30)
        for a in actors:
            ray.kill(a)
    finally:
        if lost:  # leave the module's cluster whole for the next test
            tpu_cluster.add_slice_host(kind, 1)
        release(placement)
