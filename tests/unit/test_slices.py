"""The slice-shape table (ray_diloco/config/slices.py) against Ray's own TPU helpers: every row
is what `ray.util.tpu` reserves for it, and the TPU VM rows are Ray's defaults."""

from __future__ import annotations

import pytest
from ray._private.accelerators import tpu as ray_tpu
from ray._private.accelerators.tpu import TPUAcceleratorManager
from ray.util.tpu import get_tpu_worker_resources

from ray_diloco.config import slices
from ray_diloco.config.slices import SHAPES, SliceShape, UnknownShape


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s.pod_type}-{s.num_hosts}h")
def test_every_shape_is_what_ray_reserves(shape: SliceShape) -> None:
    assert TPUAcceleratorManager.is_valid_tpu_accelerator_topology(shape.version, shape.topology)
    assert ray_tpu.infer_tpu_pod_type_from_topology(shape.topology, shape.version) == (
        shape.pod_type
    )
    hosts, bundle = get_tpu_worker_resources(
        shape.topology, shape.version, {"CPU": 2}, chips_per_vm=shape.chips_per_host
    )
    assert (hosts, bundle) == (shape.num_hosts, {"CPU": 2, "TPU": shape.chips_per_host})
    assert shape.chips == ray_tpu.get_num_chips_from_topology(shape.topology)
    assert shape.gke_machine_type.endswith(f"-{shape.chips_per_host}t")


@pytest.mark.parametrize("shape", [s for s in SHAPES if s.tpu_vm], ids=lambda s: s.pod_type)
def test_tpu_vm_shapes_are_rays_defaults(shape: SliceShape) -> None:
    # What a TPU VM of this accelerator type has (the GCE path of Ray's TPU detection) and
    # what Ray reserves when no chips_per_vm is given.
    assert ray_tpu.get_num_tpu_visible_chips_per_host(shape.pod_type) == shape.chips_per_host
    assert ray_tpu.get_chips_per_host(shape.topology, shape.version) == shape.chips_per_host
    assert slices.tpu_vm_shape(shape.pod_type) == shape


def test_each_topology_has_exactly_one_tpu_vm_shape() -> None:
    for accel, topo in {(s.accelerator, s.topology) for s in SHAPES}:
        assert sum(s.tpu_vm for s in slices.shapes(accel, topo)) == 1, (accel, topo)


def test_v6e_2x4_needs_num_hosts_and_has_both_shapes() -> None:
    with pytest.raises(UnknownShape, match="num_hosts: 1 or 2"):
        slices.resolve("tpu-v6e", "2x4")
    one, two = slices.resolve("tpu-v6e", "2x4", 1), slices.resolve("tpu-v6e", "2x4", 2)
    assert (one.chips_per_host, one.gke_machine_type, one.tpu_vm) == (8, "ct6e-standard-8t", True)
    assert (two.chips_per_host, two.gke_machine_type, two.tpu_vm) == (4, "ct6e-standard-4t", False)
    assert slices.tpu_vm_shape("v6e-8") == one


def test_unknown_topology_and_host_count_name_the_fix() -> None:
    with pytest.raises(UnknownShape, match="known: 2x2x1, 2x2x2"):
        slices.resolve("tpu-v5p", "3x3x3")
    with pytest.raises(UnknownShape, match="set num_hosts: 2"):
        slices.resolve("tpu-v5p", "2x2x2", 1)
    assert slices.resolve("tpu-v5p", " 2X2X2 ").num_hosts == 2
    with pytest.raises(UnknownShape, match="v5p-24"):
        slices.tpu_vm_shape("v5p-24")
