"""The host-side fault hooks: corrupted wire bytes decode to NaN or a blown-up delta."""

from __future__ import annotations

import numpy as np
import pytest

from ray_diloco.algorithm import wire
from ray_diloco.algorithm.host_faults import NORM_BLOWUP, HostFaults, blown_up, nan_encoded


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "int4"])
def test_nan_and_blown_up_leaves_decode_as_intended(dtype):
    x = np.linspace(-0.01, 0.01, 70, dtype=np.float32).reshape(7, 10)
    enc = wire.encode(x, dtype, 16)
    assert np.isnan(wire.decode(nan_encoded(enc))).all()
    big = wire.decode(blown_up(enc))
    assert np.isfinite(big).all()
    np.testing.assert_allclose(big, wire.decode(enc) * NORM_BLOWUP, rtol=0.2, atol=20)


def test_armed_corruption_hits_the_next_offer_once_and_straggler_window_ends():
    faults = HostFaults()
    enc = {"w": wire.encode(np.ones(4, np.float32), "float32")}

    class Meta:
        fragment, step = 1, 9

    assert faults.corrupt([(Meta, enc)])[0][1] is enc  # nothing armed
    faults.arm("corrupt_nan")
    assert faults.corrupt([]) == []  # stays armed until something is offered
    (bad,) = faults.corrupt([(Meta, enc)])
    assert np.isnan(wire.decode(bad[1]["w"])).all()
    assert faults.corrupt([(Meta, enc)])[0][1] is enc and len(faults.injected) == 1
    faults.arm("straggler", duration_s=60.0, factor=3.0)
    assert faults.slowdown() == 3.0
    faults.arm("straggler", duration_s=0.0, factor=3.0)
    assert faults.slowdown() == 1.0
    with pytest.raises(ValueError):
        faults.arm("kill_host")


def test_version_mark_round_trips_and_tolerates_absence(tmp_path):
    from ray_diloco.algorithm.version_mark import Mark, VersionMark

    mark = VersionMark(tmp_path)
    assert mark.load() == Mark()
    mark.update({0: 3, 1: 5})
    mark.update({0: 4, 1: 5}, frontier=[64, 128], holders=["b", "a"])
    mark.update(frontier=[128, 128])  # the versions and holders stay as last recorded
    assert VersionMark(tmp_path).load() == Mark({0: 4, 1: 5}, [128, 128], ["a", "b"])
    mark.path.write_text("{not json")
    assert mark.load() == Mark()
