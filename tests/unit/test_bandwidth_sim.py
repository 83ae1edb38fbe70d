"""Cross-datacenter bandwidth (docs/algorithm.md section 9): the published pair under its stated
assumptions, the byte counts against the wire format, and goodput on a given link."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ray_diloco.algorithm.wire import wire_bytes
from ray_diloco.cli.bandwidth import simulate_bandwidth_main
from ray_diloco.config import BandwidthSimConfig
from ray_diloco.sim.bandwidth_sim import (
    PRESETS,
    PUBLISHED_GBPS,
    dp_bytes_per_step,
    fragment_bytes,
    goodput_on,
    needed_gbps,
    rows,
)

pytestmark = pytest.mark.timeout(60)


def published_pair() -> BandwidthSimConfig:
    return BandwidthSimConfig().model_copy(update=PRESETS["published-pair"])


def test_published_pair_is_reproduced_under_its_stated_assumptions():
    need = needed_gbps(published_pair())
    assert need["data_parallel"] == pytest.approx(PUBLISHED_GBPS["data_parallel"], rel=0.01)
    assert need["decoupled"] == pytest.approx(PUBLISHED_GBPS["decoupled"], rel=0.01)


def test_byte_counts_follow_the_ring_and_the_wire_format():
    cfg = BandwidthSimConfig(model_params=1e9, datacenters=4)
    # Ring all-reduce over 4 sites: 2 * 3/4 of the bfloat16 gradients, each way.
    assert dp_bytes_per_step(cfg) == pytest.approx(1.5 * 2e9)
    # Default wires: int4 both ways, as the run config's defaults.
    n = -(-int(1e9) // 24)
    assert fragment_bytes(cfg) == wire_bytes(n, "int4")
    three = cfg.model_copy(update={"learners_per_datacenter": 3})
    assert fragment_bytes(three) == 3 * wire_bytes(n, "int4")
    # Full values down (publish_delta: none) go in bfloat16, the busier direction.
    full = cfg.model_copy(update={"wire_down": None})
    assert fragment_bytes(full) == wire_bytes(n, "bfloat16")
    # P = H: one fragment a step, so the window is a step whatever tau (>= 1) is.
    assert needed_gbps(cfg)["decoupled"] == pytest.approx(fragment_bytes(cfg) * 8 / 1.7 / 1e9)
    # Fewer fragments than H / tau: each must cross within its tau-step overlap.
    few = cfg.model_copy(update={"num_fragments": 4, "overlap_steps": 2})
    assert needed_gbps(few)["decoupled"] == pytest.approx(fragment_bytes(few) * 8 / (2 * 1.7) / 1e9)


def test_goodput_on_a_link():
    cfg = BandwidthSimConfig(datacenters=4, latency_ms=0.0)
    need = needed_gbps(cfg)
    # Exactly the bandwidth needed keeps full goodput; half of it halves it.
    for system in ("data_parallel", "decoupled"):
        assert goodput_on(cfg, need[system])[system] == pytest.approx(1.0)
        assert goodput_on(cfg, need[system] / 2)[system] == pytest.approx(0.5)
    # The four-region setting: data-parallel is starved on 2-5 Gbps links, decoupled is not
    # (with int4 publications) and is 20x faster or more, as published.
    pair = published_pair().model_copy(update={"datacenters": 4})
    for gbps in (2.0, 5.0):
        on = goodput_on(pair, gbps)
        assert on["data_parallel"] < 0.05 and on["decoupled"] == 1.0
        assert on["decoupled"] / on["data_parallel"] > 20


def test_rows_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    table = rows(BandwidthSimConfig(), list(PRESETS), [8, 4], [2.0, 5.0])
    assert len(table) == 2 * 2 * 2
    marked = [r for r in table if r["published_gbps"] is not None]
    assert {(r["preset"], r["datacenters"]) for r in marked} == {("published-pair", 8)}
    assert simulate_bandwidth_main(["--out", str(tmp_path)]) == 0
    assert "published-pair" in capsys.readouterr().out
    data = json.loads((tmp_path / "bandwidth_sim.json").read_text())
    assert data["rows"] == json.loads(json.dumps(table)) and "command" in data["meta"]
    assert (tmp_path / "bandwidth_sim.png").read_bytes()[:4] == b"\x89PNG"
    assert simulate_bandwidth_main(["--datacenters", "1"]) == 2
    assert simulate_bandwidth_main(["--set", "bandwidth_sim.num_fragments=99"]) == 2
