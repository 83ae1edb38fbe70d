"""One fault kind per test on the emulated two-region cluster, plus a mixed storm (issue 4).

Each test trains the tiny model to its token budget with K = 1 while the chaos engine injects
one fault, and checks (`chaos_helpers.check_run`): the budget is reached; the global model
advances throughout (uptime 1.0 from the first round on, one learner always lives); the fault,
its detection and the recovery appear on the event tape in that order; nothing non-finite or
fenced was merged; the ledger neither lost nor double-counted tokens; the held-out loss is
within `LOSS_TOLERANCE` of the fault-free reference run with the same seed.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from ray_diloco.config import build_config
from ray_diloco.control.events import (
    FailureDetected,
    FailureKind,
    LearnerRestarted,
    RoundClosed,
    SynchronizerRestored,
)
from tests.chaos.chaos_helpers import (
    REGIONS,
    ChaosRun,
    NodeReplacer,
    chaos_config,
    chaos_tree,
    check_run,
    run_chaos,
)
from tests.cluster_helpers import TpuCluster

pytestmark = pytest.mark.chaos

BUDGET = 60_000  # tokens: about 15 s of training at a fifth of the compute speed, 2 learners
EU = REGIONS["eu"]


@functools.lru_cache(maxsize=4)
def reference_loss(budget: int) -> float:
    """Held-out loss of the fault-free in-process reference run (same config and seed)."""
    from ray_diloco.algorithm.simulate import run_reference

    return float(run_reference(build_config(chaos_tree(budget, [])))["heldout_loss"])


def run_one(tmp_path: Path, name: str, fault: dict[str, Any], budget: int = BUDGET) -> ChaosRun:
    return run_chaos(chaos_config(tmp_path, name, budget, [{"at_s": 2.0, **fault}]))


def failures(run: ChaosRun, learner: str) -> list[FailureDetected]:
    return [e for e in run.events if isinstance(e, FailureDetected) and e.learner == learner]


@pytest.mark.timeout(240)
def test_kill_host_restarts_the_whole_multi_host_learner(
    tpu_cluster: TpuCluster, tmp_path: Path
) -> None:
    run = run_one(tmp_path, "kill-host", {"kind": "kill_host", "target": "v5p"})
    check_run(run, reference_loss(BUDGET))
    (failure,) = failures(run, "v5p")
    assert failure.failure is FailureKind.CRASH
    (restart,) = [e for e in run.events if isinstance(e, LearnerRestarted)]
    assert restart.learner == "v5p" and restart.incarnation == 1
    assert run.summary["learners"]["v5p"]["incarnation"] == 1


@pytest.mark.timeout(240)
def test_kill_group(tpu_cluster: TpuCluster, tmp_path: Path) -> None:
    run = run_one(tmp_path, "kill-group", {"kind": "kill_group", "target": "eu"})
    check_run(run, reference_loss(BUDGET))
    assert [f.failure for f in failures(run, "eu")] == [FailureKind.CRASH]


@pytest.mark.timeout(240)
def test_remove_node_rebuilds_the_group_on_the_replacement_host(
    tpu_cluster: TpuCluster, tmp_path: Path
) -> None:
    with NodeReplacer(tpu_cluster) as replacer:
        run = run_one(tmp_path, "remove-node", {"kind": "remove_node", "target": "v5p"})
    check_run(run, reference_loss(BUDGET))
    assert len(replacer.replaced) == 1 and replacer.replaced[0][0] == "v5p"
    (failure,) = failures(run, "v5p")
    assert failure.failure in (FailureKind.NODE_LOST, FailureKind.HANG)


@pytest.mark.timeout(240)
def test_hang_host_is_detected_by_heartbeat_timeout(tpu_cluster: TpuCluster, tmp_path: Path) -> None:
    run = run_one(tmp_path, "hang-host", {"kind": "hang_host", "target": "v5p", "duration_s": 6})
    check_run(run, reference_loss(BUDGET))
    (failure,) = failures(run, "v5p")
    assert failure.failure is FailureKind.HANG
    assert run.outcome("hang_host").detection_s <= 2.0 + 1.5  # timeout + poll + signal task


@pytest.mark.timeout(240)
def test_straggler(tpu_cluster: TpuCluster, tmp_path: Path) -> None:
    fault = {"kind": "straggler", "target": "eu", "duration_s": 6, "factor": 5}
    run = run_one(tmp_path, "straggler", fault)
    check_run(run, reference_loss(BUDGET))
    assert failures(run, "eu") == []  # slow is not dead: never restarted


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("kind", "factor"), [("cut_link", 1.0), ("slow_link", 100.0)], ids=["cut", "slow"]
)
def test_link_faults_starve_the_region_then_recover(
    tpu_cluster: TpuCluster, tmp_path: Path, kind: str, factor: float
) -> None:
    fault = {"kind": kind, "target": EU, "duration_s": 6, "factor": factor}
    run = run_one(tmp_path, kind, fault)
    check_run(run, reference_loss(BUDGET))
    assert run.outcome(kind).learner == "eu"
    assert failures(run, "eu") == []


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("kind", "target", "reason"),
    [("corrupt_nan", "eu", "non_finite"), ("corrupt_norm", "v5p", "norm_outlier")],
    ids=["nan", "norm"],
)
def test_corrupt_contribution_is_rejected_and_the_learner_restarted(
    tpu_cluster: TpuCluster, tmp_path: Path, kind: str, target: str, reason: str
) -> None:
    run = run_one(tmp_path, kind, {"kind": kind, "target": target})
    check_run(run, reference_loss(BUDGET), rejections={reason})
    assert run.summary["rejected"][reason] == 1
    assert [f.failure for f in failures(run, target)] == [FailureKind.NUMERICAL]


@pytest.mark.timeout(240)
def test_kill_synchronizer_restores_from_its_checkpoint(
    tpu_cluster: TpuCluster, tmp_path: Path
) -> None:
    run = run_one(tmp_path, "kill-sync", {"kind": "kill_synchronizer"})
    # Without its synchronizer the global model cannot advance: no full uptime here.
    check_run(run, reference_loss(BUDGET), full_uptime=False)
    (restored,) = [e for e in run.events if isinstance(e, SynchronizerRestored)]
    assert 0 <= restored.rounds_lost <= run.cfg.synchronizer.checkpoint_every_rounds
    _assert_versions_never_go_backwards(run)
    assert failures(run, "v5p") == [] and failures(run, "eu") == []  # learners kept training


def _assert_versions_never_go_backwards(run: ChaosRun) -> None:
    last: dict[int, int] = {}
    for e in run.events:
        if isinstance(e, RoundClosed):
            assert e.version > last.get(e.fragment, 0), (e, last)
            last[e.fragment] = e.version


STORM = [
    {"at_s": 2, "kind": "kill_host", "target": "v5p"},
    {"at_s": 4, "kind": "straggler", "target": "eu", "duration_s": 8, "factor": 4},
    {"at_s": 9, "kind": "corrupt_nan", "target": "eu"},
    {"at_s": 15, "kind": "cut_link", "target": EU, "duration_s": 5},
    {"at_s": 22, "kind": "hang_host", "target": "v5p", "duration_s": 5},
    {"at_s": 34, "kind": "corrupt_norm", "target": "v5p"},
    {"at_s": 40, "kind": "kill_synchronizer"},
    {"at_s": 50, "kind": "kill_group", "target": "eu"},
    {"at_s": 56, "kind": "remove_node", "target": "v5p"},
]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_storm_of_mixed_faults(tpu_cluster: TpuCluster, tmp_path: Path) -> None:
    budget = 5 * BUDGET
    with NodeReplacer(tpu_cluster):
        run = run_chaos(chaos_config(tmp_path, "storm", budget, STORM))
    check_run(
        run,
        reference_loss(budget),
        rejections={"non_finite", "norm_outlier"},
        full_uptime=False,
    )
    assert [o.fault for o in run.outcomes] == [f["kind"] for f in STORM]
    _assert_versions_never_go_backwards(run)
