"""Every fault kind on the emulated two-region cluster, plus a mixed storm.

Each test trains the tiny model to its token budget with K = 1 while the chaos engine injects
its faults: several that need no restart (one per learner, or one after the other), or several
that take the same learner down one after the other, and on until each has recovered
(`chaos_helpers.run_chaos`), and checks (`chaos_helpers.check_run`): the budget is reached; the
global model advances throughout (uptime 1.0 from the first round on, one learner always
lives); each fault, its detection and its recovery appear on the event tape in that order;
nothing non-finite or fenced was merged; the ledger neither lost nor double-counted tokens; the
held-out loss is no worse than the fault-free reference run with the same seed plus
`LOSS_TOLERANCE`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ray_diloco.config import build_config
from ray_diloco.control.events import (
    ContributionRejected,
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

# Token budgets: about 11 s of training at a fifth of the compute speed with 2 learners; more
# for the storm's many faults (120k; it was 240k, 37 s of paced training, but its faults come
# over 24 s and the run goes on until they settle anyway). A run goes on past its budget until
# its faults recovered (the budget used to be raised instead for slow restarts, which a loaded
# CI machine still outran: 3 failures at 144k tokens).
BUDGET = 72_000
STORM_BUDGET = 120_000
# A test's whole time, the module's cluster start included for the first: a CI run at load
# 10 took 100 s to boot the two-host learner, 80 s to restart it, and 202 s of run in all.
RUN_TIMEOUT_S = 600
EU = REGIONS["eu"]
GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "chaos_reference.json"
Reference = Callable[..., float]


@pytest.fixture(scope="module")
def reference_loss(request: pytest.FixtureRequest) -> Callable[..., float]:
    """Held-out loss of the fault-free in-process reference run with the same config and seed,
    from tests/fixtures/chaos_reference.json (`pytest --regenerate-golden` recomputes it)."""
    regenerate = bool(request.config.getoption("--regenerate-golden"))
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}

    def loss(budget: int, multi_host: bool = False) -> float:
        key = f"{budget}/{'multi' if multi_host else 'single'}_host"
        if regenerate or key not in golden:
            from ray_diloco.sim.simulate import run_reference

            cfg = build_config(chaos_tree(budget, [], multi_host))
            golden[key] = float(run_reference(cfg)["heldout_loss"])
            if regenerate:
                GOLDEN.write_text(json.dumps(golden, indent=2, sort_keys=True) + "\n")
        return float(golden[key])

    return loss


def run_one(
    tmp_path: Path,
    name: str,
    fault: dict[str, Any],
    budget: int = BUDGET,
    multi_host: bool = False,
) -> ChaosRun:
    faults = [{"at_s": 2.0, **fault}]  # seconds after every learner trains (unless given)
    return run_chaos(chaos_config(tmp_path, name, budget, faults, multi_host))


def failures(run: ChaosRun, learner: str) -> list[FailureDetected]:
    return [e for e in run.events if isinstance(e, FailureDetected) and e.learner == learner]


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_kill_host_restarts_the_whole_multi_host_learner(
    tpu_cluster: TpuCluster, tmp_path: Path, reference_loss: Reference
) -> None:
    # The v5p learner spans both hosts of the slice (one jax.distributed job): killing one host
    # fences and restarts the whole group, which must rejoin while `eu` alone keeps training.
    fault = {"kind": "kill_host", "target": "v5p"}
    run = run_one(tmp_path, "kill-host", fault, multi_host=True)
    check_run(run, reference_loss(BUDGET, multi_host=True))
    (failure,) = failures(run, "v5p")
    assert failure.failure is FailureKind.CRASH
    (restart,) = [e for e in run.events if isinstance(e, LearnerRestarted)]
    assert restart.learner == "v5p" and restart.incarnation == 1
    assert run.summary["learners"]["v5p"]["incarnation"] == 1


# Faults that take a learner down may share a run when they hit the same learner, one after the
# other: the chaos engine holds a fault until its learner is back (`runtime/supervisor/faults.py`),
# so the other learner trains throughout, and the tape attributes every detection and recovery to
# the earliest fault it explains (`control/recovery.py`). Not a hang and then another fault: a hung
# learner counts as up until the hang is detected, so the next fault must wait out the timeout's
# ceiling (30 s). Merged so, hang_host and remove_node took 165 s in one suite run, against 70 s and
# 59 s apart in another; remove_node and then the hang 63 s, against 44 s and 73 s apart; kill_group
# and the corruptions 56 s, against 89 s and 59 s (clean clones, 2 cores).


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_a_removed_node_and_a_hung_host_are_detected_and_the_learner_rebuilt(
    tpu_cluster: TpuCluster, tmp_path: Path, reference_loss: Reference
) -> None:
    # The raylet of `us`'s node dies: the group is rebuilt on the other us-east5 host while
    # the node replacer brings a host with the same slice identity back for later tests. Once
    # `us` is back (the hang is due while `us` is still down on any machine, so it waits), its
    # host is stopped for 5 s: a silence only the heartbeat timeout can tell, and another
    # restart.
    faults = [
        {"at_s": 2.0, "kind": "remove_node", "target": "us"},
        {"at_s": 10.0, "kind": "hang_host", "target": "us", "duration_s": 5},
    ]
    with NodeReplacer(tpu_cluster) as replacer:
        run = run_chaos(chaos_config(tmp_path, "node-hang", BUDGET, faults))
    check_run(run, reference_loss(BUDGET))
    assert len(replacer.replaced) == 1 and replacer.replaced[0][0] == "v5p"
    node_lost, hang = failures(run, "us")
    assert node_lost.failure in (FailureKind.NODE_LOST, FailureKind.HANG)
    assert hang.failure is FailureKind.HANG
    # The heartbeat timeout in force (2 s on an idle machine; longer, up to its ceiling, when
    # the host's answers came slower: control/detector.py) + one poll and a late tick.
    timeout = hang.timeout_s
    assert timeout is not None and 2.0 <= timeout <= run.cfg.supervisor.heartbeat_timeout_max_s
    detection = run.outcome("hang_host").detection_s
    assert detection is not None and detection <= timeout + 1.5, (detection, timeout)
    assert failures(run, "eu") == []


# Faults that need no restart share a run, each on its own learner or one after the other: the
# tape attributes every detection and recovery to the earliest fault it explains
# (`control/recovery.py`), and a run's boot and compile cost more than its training here.
TRANSIENT = [  # on `eu`, one after the other; each recovers on its own
    {"at_s": 2.0, "kind": "cut_link", "target": EU, "duration_s": 4},
    {"at_s": 12.0, "kind": "slow_link", "target": EU, "duration_s": 4, "factor": 100.0},
    {"at_s": 22.0, "kind": "straggler", "target": "eu", "duration_s": 4, "factor": 5},
]


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_link_faults_and_a_straggler_are_seen_and_never_restart_the_learner(
    tpu_cluster: TpuCluster, tmp_path: Path, reference_loss: Reference
) -> None:
    run = run_chaos(chaos_config(tmp_path, "transient", BUDGET, TRANSIENT))
    check_run(run, reference_loss(BUDGET))
    for kind in ("cut_link", "slow_link", "straggler"):
        assert run.outcome(kind).learner == "eu", run.outcome(kind)
    assert failures(run, "eu") == [] and failures(run, "us") == []


def refused(run: ChaosRun, reason: str) -> list[str]:
    """The learners whose contributions were refused for `reason`, one entry per refusal."""
    return [
        e.learner for e in run.events if isinstance(e, ContributionRejected) and e.reason == reason
    ]


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_a_killed_group_restarts_and_corrupt_contributions_are_refused(
    tpu_cluster: TpuCluster, tmp_path: Path, reference_loss: Reference
) -> None:
    # `eu`'s whole group is killed: a crash, restarted. Once it is back, a NaN from it: refused,
    # and `eu` restarted again (its state may be corrupt). A huge contribution from `us`:
    # refused by the norm guard, which judges a fragment only after its first
    # `norm_guard_warmup_rounds` rounds (norms still swing then), hence later; the guard
    # protected the model, so `us` needs no restart.
    faults = [
        {"at_s": 2.0, "kind": "kill_group", "target": "eu"},
        {"at_s": 3.0, "kind": "corrupt_nan", "target": "eu"},
        {"at_s": 6.0, "kind": "corrupt_norm", "target": "us"},
    ]
    run = run_chaos(chaos_config(tmp_path, "group-corrupt", BUDGET, faults))
    check_run(run, reference_loss(BUDGET), rejections={"non_finite"})
    assert refused(run, "non_finite") == ["eu"]
    crash, numerical = failures(run, "eu")
    assert (crash.failure, numerical.failure) == (FailureKind.CRASH, FailureKind.NUMERICAL)
    assert "us" in refused(run, "norm_outlier"), run.summary["rejected"]
    assert failures(run, "us") == []


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_kill_synchronizer_loses_no_round(
    tpu_cluster: TpuCluster, tmp_path: Path, reference_loss: Reference
) -> None:
    # Killed twice: at a random moment (not a fixed one: a checkpoint, a round close or a
    # publication in flight may be what the kill interrupts), then 8 s later right after a
    # checkpoint write began. On a busy machine the second kill lands while the shard is still
    # recovering from the first (beside two busy processes, measured): it then comes back once,
    # and the first kill counts as superseded (`control/recovery.py`).
    # From the first second: learners that trained through a long restart before any round
    # merged (34 s at load 26) each left the untrained model alone; the first merge of such
    # work, taken through the outer momentum as a whole, ended at 4.0 (and an 18 s restart at
    # 5 s, at 2.73). `diloco.accelerate: window` takes it as it is (tests/unit/test_outage.py).
    at_s = round(random.uniform(1.0, 8.0), 2)
    faults = [
        {"kind": "kill_synchronizer", "at_s": at_s},
        {"kind": "kill_synchronizer", "at_s": at_s + 8.0, "during_checkpoint": True},
    ]
    run = run_chaos(chaos_config(tmp_path, "kill-sync", BUDGET, faults))
    # Without its synchronizer the global model cannot advance: no full uptime here.
    # Offers of a fragment being recovered are refused (and sent again once it is back), and
    # so are those of a learner the restarted shard has not seen register again yet. An offer
    # no newer than work the restored shard took back from its log (in flight across the kill,
    # or sent again) is fenced as a replay, its work counted once (a busy clean-clone run,
    # 2 such after the kill during a checkpoint write, no round lost).
    check_run(
        run,
        reference_loss(BUDGET),
        rejections={"recovering", "unknown_learner", "replayed"},
        full_uptime=False,
    )
    # Both kills landed, and the shard came back once for each kill not superseded (check_run
    # has checked that each one recovered or was superseded), losing no round any time.
    assert [o.fault for o in run.outcomes] == ["kill_synchronizer"] * 2, run.outcomes
    restored = [e for e in run.events if isinstance(e, SynchronizerRestored)]
    assert len(restored) == sum(not o.superseded for o in run.outcomes), (restored, run.outcomes)
    assert all(e.rounds_lost == 0 for e in restored), (at_s, restored)
    assert run.summary["synchronizer_restores"] == len(restored)
    _assert_versions_never_go_backwards(run)
    assert failures(run, "us") == [] and failures(run, "eu") == []  # learners kept training


def _assert_versions_never_go_backwards(run: ChaosRun) -> None:
    last: dict[int, int] = {}
    for e in run.events:
        if isinstance(e, RoundClosed):
            assert e.version > last.get(e.fragment, 0), (e, last)
            last[e.fragment] = e.version


STORM = [  # several kinds at once, on both learners and the synchronizer
    {"at_s": 1, "kind": "kill_host", "target": "us"},
    {"at_s": 1.5, "kind": "straggler", "target": "eu", "duration_s": 4, "factor": 4},
    {"at_s": 4, "kind": "cut_link", "target": EU, "duration_s": 5},
    {"at_s": 9, "kind": "corrupt_nan", "target": "eu"},
    {"at_s": 10, "kind": "hang_host", "target": "us", "duration_s": 4},
    {"at_s": 12, "kind": "kill_synchronizer"},
    {"at_s": 20, "kind": "corrupt_norm", "target": "eu"},
    {"at_s": 22, "kind": "kill_group", "target": "eu"},
    {"at_s": 24, "kind": "remove_node", "target": "us"},
]


# Honest offers refused as stale: 0 in each of the 8 idle storm runs of `LOSS_TOLERANCE`'s note.
# Before a43a9d1, learners holding a value under the number a fall-back renamed had every offer
# refused as stale for ~10 s (122-150).
STORM_MAX_STALE_REFUSALS = 30
# A straggler or a cut link that the storm's restarts hide: its learner's step-rate baseline is
# taken while a restarted peer compiles on the same cores (the straggler comes 0.5 s after the
# first kill), and a learner starved while it restarts was not training steadily. Their own
# tests assert that each is seen; here each must be seen and recover, or go unseen. (A CI run at
# load reached its token ceiling, 4x the budget, with a fault unsettled; its log
# did not say which.)
STORM_MAY_GO_UNNOTICED = frozenset({"straggler", "cut_link"})


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_TIMEOUT_S)
def test_storm_of_mixed_faults(
    tpu_cluster: TpuCluster, tmp_path: Path, reference_loss: Reference
) -> None:
    cfg = chaos_config(tmp_path, "storm", STORM_BUDGET, STORM)
    with NodeReplacer(tpu_cluster):
        run = run_chaos(cfg, may_go_unnoticed=STORM_MAY_GO_UNNOTICED)
    check_run(
        run,
        reference_loss(STORM_BUDGET),
        rejections={"non_finite", "recovering", "unknown_learner"},  # (the synchronizer's kill)
        full_uptime=False,  # the synchronizer is down for a while
        may_go_unnoticed=STORM_MAY_GO_UNNOTICED,
    )
    stale = run.summary["rejected"].get("stale_version", 0)
    assert stale <= STORM_MAX_STALE_REFUSALS, run.summary["rejected"]
    # A fault due while its learner is down (restarting) waits until it is back, however long
    # the restarts take (5 of 9 were injected at load 10 when such faults were skipped). Faults
    # waiting for the same learner go one at a time when it is back, in schedule order (when
    # they went together, the kill could interrupt the corruption's call: 8 of 9 in a CI run).
    # One may still be skipped: a call to a host that times out (20 s) on a loaded machine.
    injected = [o.fault for o in run.outcomes]
    assert len(injected) >= len(STORM) - 1, injected
    assert {"kill_synchronizer", "kill_host"} <= set(injected), injected
    _assert_versions_never_go_backwards(run)
