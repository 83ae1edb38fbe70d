"""Broken contributions sent to a real synchronizer actor: each is refused with its
reason on the event tape, in the status counters and in the exported metrics, and neither the
global model nor the ledger moves."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from ray_diloco.config import load_config
from tests.cluster_helpers import scrape_metrics
from tests.ray.conftest import LocalRay

pytestmark = pytest.mark.ray

TINY = Path(__file__).resolve().parents[1] / "fixtures" / "tiny_train.yaml"
TOKENS_PER_STEP = 8 * 16  # 8 examples of 16 tokens (tiny_train.yaml)


@pytest.mark.timeout(240)
def test_broken_contributions_are_refused_on_the_tape_and_in_the_metrics(
    ray_local: LocalRay, tmp_path: Path
) -> None:
    import ray

    from ray_diloco.algorithm import wire
    from ray_diloco.algorithm.round_types import ContributionMeta
    from ray_diloco.runtime.synchronizer.launch import create_synchronizer

    overrides = [
        f"run_dir={tmp_path}",
        "name=guards",  # its own series: the module's Ray may have run others (conftest.py)
        "synchronizer.name=sync-guards",
        "diloco.mode=decoupled",
        "metrics.export_ray_metrics=true",
        "checkpoint.enabled=false",
    ]
    cfg = load_config(str(TINY), overrides)
    (sync,) = create_synchronizer(cfg)
    try:
        reply = ray.get(sync.register.remote("a", 0, [], "local", None, 8), timeout=180)
        _, values = reply.snapshot[0]
        good = wire.encode_tree({k: np.full_like(v, 0.01) for k, v in values.items()}, "bfloat16")
        name = next(iter(values))
        wrong_shape = dict(good)
        wrong_shape[name] = wire.encode(np.zeros((*values[name].shape, 2), np.float32), "bfloat16")
        meta = ContributionMeta("a", 0, 0, 0, 6, 6, 6 * TOKENS_PER_STEP)
        cases = [
            (meta, wrong_shape, "malformed"),
            (dataclasses.replace(meta, fragment=5), good, "malformed"),
            (dataclasses.replace(meta, num_tokens=10**12), good, "implausible"),
        ]
        for m, d, reason in cases:
            assert ray.get(sync.offer.remote(m, d), timeout=60) == reason
        status = ray.get(sync.status.remote(), timeout=60)
        assert status.rejected == {"malformed": 2, "implausible": 1}
        taped = [e["reason"] for e in status.events if e["kind"] == "contribution_rejected"]
        assert sorted(taped) == ["implausible", "malformed", "malformed"]
        # nothing moved: no version, no merged contribution, no round
        assert status.versions == {0: 0, 1: 0} and status.contributions_merged == {"a": 0}
        assert status.rounds == 0
        # the synchronizer still takes the honest contribution, once
        assert ray.get(sync.offer.remote(meta, good), timeout=60) == "accepted"
        assert ray.get(sync.offer.remote(meta, good), timeout=60) == "replayed"
        text = scrape_metrics(
            ray_local.metrics_export_port,
            lambda text: any(
                'reason="replayed"' in ln and 'run="guards"' in ln for ln in text.splitlines()
            ),
            60.0,
        )
        lines = [
            ln
            for ln in text.splitlines()
            if ln.startswith("ray_diloco_contributions_rej") and 'run="guards"' in ln
        ]
        by_reason = {
            r: sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if f'reason="{r}"' in ln)
            for r in ("malformed", "implausible", "replayed")
        }
        assert by_reason == {"malformed": 2.0, "implausible": 1.0, "replayed": 1.0}, lines
    finally:
        ray.kill(sync)
