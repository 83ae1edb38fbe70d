"""Broken contributions sent to a real Synchronizer actor (issue 15): each is refused with its
reason on the event tape, in the status counters and in the exported metrics, and neither the
global model nor the ledger moves."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ray_diloco.config import load_config
from tests.cluster_helpers import scrape_metrics

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "fixtures" / "tiny_train.yaml"


@pytest.mark.timeout(900)  # a busy machine: Ray's start and the actor's boot (as the driver)
def test_broken_contributions_are_refused_on_the_tape_and_in_the_metrics(
    ray_local: Any, tmp_path: Path
) -> None:
    import ray

    from ray_diloco.actors.synchronizer import get_or_create_synchronizer
    from ray_diloco.algorithm import wire
    from ray_diloco.algorithm.rounds import ContributionMeta
    from ray_diloco.driver import SYNC_START_TIMEOUT_S

    overrides = [
        f"run_dir={tmp_path}",
        "synchronizer.name=sync-guards",
        "diloco.mode=decoupled",
        "metrics.export_ray_metrics=true",
        "checkpoint.enabled=false",
    ]
    cfg = load_config(str(TINY), overrides)
    sync = get_or_create_synchronizer(cfg)
    try:
        register = sync.register.remote("a", 0, [], "local", None, 8 * 16)  # tokens per step
        reply = ray.get(register, timeout=SYNC_START_TIMEOUT_S)  # the actor builds its setup
        _, values = reply["snapshot"][0]
        dtype, block = cfg.diloco.wire_dtype, cfg.diloco.int4_block_size
        good = wire.encode_tree({k: np.full_like(v, 0.01) for k, v in values.items()}, dtype, block)
        name = next(iter(values))
        wrong_shape = dict(good)
        wrong_shape[name] = wire.encode(
            np.zeros((*values[name].shape, 2), np.float32), dtype, block
        )
        meta = ContributionMeta("a", 0, 0, 0, 6, 6, 6 * 8 * 16)  # 8 examples of 16 tokens
        cases = [
            (meta, wrong_shape, "wrong_shape"),
            (dataclasses.replace(meta, fragment=5), good, "unknown_fragment"),
            (dataclasses.replace(meta, num_tokens=10**12), good, "absurd_counters"),
        ]
        for m, d, reason in cases:
            assert ray.get(sync.offer.remote(m, d), timeout=60) == reason
        status = ray.get(sync.status.remote(), timeout=60)
        assert status["rejected"] == {"wrong_shape": 1, "unknown_fragment": 1, "absurd_counters": 1}
        taped = [e["reason"] for e in status["events"] if e.get("kind") == "contribution_rejected"]
        assert sorted(taped) == ["absurd_counters", "unknown_fragment", "wrong_shape"]
        # nothing moved: no version, no merged contribution, no round pending
        assert status["versions"] == {0: 0, 1: 0}
        assert set(status["contributions_merged"].values()) <= {0}
        assert status["rounds"] == 0
        # and the synchronizer still takes the honest contribution
        assert ray.get(sync.offer.remote(meta, good), timeout=60) == "accepted"
        text = scrape_metrics(
            ray_local.metrics_export_port, lambda text: 'reason="absurd_counters"' in text, 60.0
        )
        lines = [ln for ln in text.splitlines() if ln.startswith("ray_diloco_contributions_rej")]
        by_reason = {
            r: sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if f'reason="{r}"' in ln)
            for r in ("wrong_shape", "unknown_fragment", "absurd_counters")
        }
        assert by_reason == {"wrong_shape": 1.0, "unknown_fragment": 1.0, "absurd_counters": 1.0}
    finally:
        ray.kill(sync)
