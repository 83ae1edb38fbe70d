"""The in-process reference run and the two cores it drives (docs/algorithm.md sections 4-8)."""

from __future__ import annotations

import numpy as np
import pytest

from ray_diloco.algorithm import wire
from ray_diloco.algorithm.round_types import ContributionMeta, Verdict
from ray_diloco.algorithm.setup import Setup
from ray_diloco.algorithm.sync_core import SynchronizerCore
from ray_diloco.config import load_config
from ray_diloco.sim.run_summary import lost_fraction
from ray_diloco.sim.simulate import run_reference
from tests.sync_helpers import resume_without_learners

TINY = [
    "task_args.model.d_model=32",
    "task_args.model.num_layers=2",
    "task_args.model.num_heads=2",
    "task_args.model.d_ff=64",
    "task_args.model.seq_len=16",
    "task_args.data.source=synthetic",
    "task_args.data.eval_batches=2",
    "task_args.data.eval_batch_size=8",
    "diloco.sync_every=4",
    "diloco.num_fragments=4",
    "diloco.overlap_steps=1",
    "token_budget=12000",
    "learners.0.batch_size=8",
    "learners.1.batch_size=8",
    "learners.2.batch_size=8",
    "learners.3.batch_size=8",
]


def tiny(*extra: str):
    return load_config(None, [*TINY, *extra])


@pytest.fixture(scope="module")
def decoupled():
    return run_reference(tiny("learners.2.speed=0.7", "learners.3.jitter=0.2"))


def test_reference_run_is_deterministic(decoupled):
    again = run_reference(tiny("learners.2.speed=0.7", "learners.3.jitter=0.2"))
    assert again["heldout_loss"] == decoupled["heldout_loss"]
    assert again["rounds"] == decoupled["rounds"]


def test_decoupled_run_learns_and_keeps_the_ledger(decoupled):
    evals = decoupled["evals"]
    assert evals[-1]["heldout_loss"] < evals[0]["heldout_loss"] - 0.3
    assert decoupled["tokens"] >= 12000
    assert decoupled["ledger_violations"] == []
    assert all(v["contributions_merged"] > 0 for v in decoupled["learners"].values())
    shares = [v["merged_share"] for v in decoupled["learners"].values()]
    assert all(0.0 < s <= 1.0 for s in shares)
    # merged-work goodput counts only the step time whose work reached the global model
    assert decoupled["goodput_merged"] < decoupled["goodput"]
    # the slow learner took fewer steps than the fast ones: nobody waited for it
    steps = {k: v["inner_steps"] for k, v in decoupled["learners"].items()}
    assert steps["learner-2"] < steps["learner-0"]


def test_pulled_rounds_merge_every_learners_work(decoupled):
    # The defaults (`schedule: pull`): every live learner is asked for p when it falls due on
    # the leading learner's count; kept unsent work carries the steps between its answer and
    # the new version into its next answer. Offering on its own count and overwriting unsent
    # work, no learner merges 0.6 of it.
    offers = run_reference(
        tiny(
            "learners.2.speed=0.7",
            "learners.3.jitter=0.2",
            "diloco.schedule=offer",
            "diloco.keep_unsent_work=false",
        )
    )
    assert decoupled["ledger_violations"] == [] and decoupled["rejected"] == {}
    assert max(v["merged_share"] for v in offers["learners"].values()) < 0.6
    assert all(v["merged_share"] > 0.85 for v in decoupled["learners"].values())
    # ... the slow learner too, answering every pull as the others do
    merged = [v["contributions_merged"] for v in decoupled["learners"].values()]
    assert min(merged) >= 0.8 * max(merged)
    assert decoupled["evals"][-1]["heldout_loss"] < decoupled["evals"][0]["heldout_loss"] - 0.3


def test_synchronous_rounds_have_every_learner():
    s = run_reference(tiny("diloco.mode=synchronous", "learners.2.speed=0.7"))
    assert s["mean_contributors"] == 4.0
    assert s["rounds"] > 0
    steps = {v["inner_steps"] for v in s["learners"].values()}
    assert max(steps) - min(steps) <= 4  # a barrier every H steps keeps learners together


def test_decoupled_in_lock_step_is_synchronous_diloco_with_an_overlap_of_one():
    # Learners of one speed without jitter and rounds of every learner: a decoupled learner
    # applies a new version at the first step boundary after it arrives, one step after its
    # offer here (a round merges and publishes within a step: sync_time_s < step_time_s). That
    # is synchronous DiLoCo with tau = 1, bit for bit: what decoupling changes is only what
    # happens when learners drift apart. (At the quality horizon tau = 1 costs synchronous
    # DiLoCo about 4% against tau = 2 at batch 32, 0.5% at 128: quality_horizon.py's
    # "overlap 1" rows.)
    assert "diloco.overlap_steps=1" in TINY
    decoupled = run_reference(
        tiny(
            "diloco.quorum_min=4",
            "diloco.grace_fraction=0",
            "diloco.schedule=offer",
            "diloco.keep_unsent_work=false",
        )
    )
    synchronous = run_reference(tiny("diloco.mode=synchronous"))
    assert decoupled["heldout_loss"] == synchronous["heldout_loss"]
    assert decoupled["rounds"] == synchronous["rounds"] > 0


def test_data_parallel_reference_and_bytes():
    s = run_reference(tiny("diloco.mode=data_parallel"))
    assert s["bytes_per_token"] == s["dp_bytes_per_token"] > 0
    assert s["evals"][-1]["heldout_loss"] < s["evals"][0]["heldout_loss"]


def test_the_default_int4_wire_moves_fewer_bytes_than_bfloat16(decoupled):
    bfloat16 = ["diloco.wire_dtype=bfloat16", "diloco.publish_delta=none"]
    wide = run_reference(tiny("learners.2.speed=0.7", "learners.3.jitter=0.2", *bfloat16))
    assert decoupled["bytes_up"] < 0.4 * wide["bytes_up"]
    assert decoupled["bytes_down"] < 0.4 * wide["bytes_down"]


def _core():
    cfg = tiny()
    setup = Setup.build(cfg)
    return cfg, setup, SynchronizerCore(cfg, setup.plan, setup.init)


def test_sync_core_fences_non_finite_and_unknown_bases():
    _, setup, core = _core()
    core.register("learner-0", 0, now=0.0)
    paths = setup.plan.fragments[0]
    zeros = {k: np.zeros_like(np.asarray(setup.init[k])) for k in paths}
    meta = ContributionMeta("learner-0", 0, 0, 0, 4, 4, 512)
    bad = dict(wire.encode_tree(zeros, "float32"))
    k0 = paths[0]
    nan = np.full(np.asarray(setup.init[k0]).shape, np.nan, np.float32)
    bad[k0] = wire.Encoded("float32", nan.shape, nan.tobytes(), b"")
    assert core.offer(meta, bad, now=0.0) is Verdict.NON_FINITE
    stale = ContributionMeta("learner-0", 0, 0, 7, 4, 4, 512)
    assert core.offer(stale, wire.encode_tree(zeros, "float32"), now=0.0) is Verdict.FUTURE_VERSION
    # A NaN is reported as such even when its base is unknown: the learner needs a restart.
    bad_base = ContributionMeta("learner-0", 0, 0, 7, 4, 4, 512)
    assert core.offer(bad_base, bad, now=0.0) is Verdict.NON_FINITE
    assert core.rejected == {"non_finite": 2, "future_version": 1}
    assert core.offer(meta, wire.encode_tree(zeros, "float32"), now=0.0) is Verdict.ACCEPTED
    (pub,) = core.poll(now=10.0)
    assert pub.version == 1 and core.ledger.account("learner-0").merged == {0: 512}


def _moved_by(tokens_small: int, tokens_large: int) -> float:
    """How far one round moves fragment 0 when learner-0 offers a delta of 0.01 with
    `tokens_small` tokens and learner-1 one of 0.03 (the same direction) with `tokens_large`."""
    _, setup, core = _core()
    paths = setup.plan.fragments[0]
    for i, (size, tokens) in enumerate([(0.01, tokens_small), (0.03, tokens_large)]):
        name = f"learner-{i}"
        core.register(name, 0, now=0.0)
        delta = {k: np.full(np.asarray(setup.init[k]).shape, size, np.float32) for k in paths}
        meta = ContributionMeta(name, 0, 0, 0, 4, 4, tokens)
        assert core.offer(meta, wire.encode_tree(delta, "float32"), now=0.0) is Verdict.ACCEPTED
    before = {k: np.asarray(setup.init[k], np.float32) for k in paths}
    (pub,) = core.poll(now=10.0)
    assert len(pub.close.contributions) == 2
    return float(sum(np.abs(core.values[0][k] - before[k]).sum() for k in paths))


def test_sync_core_weights_contributions_by_their_tokens():
    # Token weights tokens^2/steps: 512 and 2048 tokens in 4 steps weigh 1 and 16. Both deltas
    # point the same way, so the merged norm is their weighted mean and the first outer step is
    # linear in it: (1 x 0.01 + 16 x 0.03) / (16 x 0.01 + 1 x 0.03) = 0.49 / 0.19 times as far
    # when the larger delta has the tokens. Uniform weights would move both rounds equally.
    ratio = _moved_by(512, 2048) / _moved_by(2048, 512)
    assert ratio == pytest.approx(0.49 / 0.19, rel=1e-3)


def test_merged_share_is_the_work_that_reached_the_global_model():
    _, setup, core = _core()
    core.register("learner-0", 0, now=0.0)
    core.report("learner-0", 0, now=0.0, step_time_s=1.0, cursor=1024)
    paths = setup.plan.fragments[0]
    zeros = {k: np.zeros_like(np.asarray(setup.init[k])) for k in paths}
    meta = ContributionMeta("learner-0", 0, 0, 0, 4, 4, 512)
    assert core.offer(meta, wire.encode_tree(zeros, "float32"), now=0.0) is Verdict.ACCEPTED
    assert core.merged_shares() == {"learner-0": 0.0}  # pending is not merged
    core.poll(now=10.0)
    # half of its 1024 tokens merged into one of the 4 fragments
    assert core.merged_shares() == {"learner-0": pytest.approx(512 / (4 * 1024))}


def test_work_lost_is_the_refused_tokens_share_of_every_fragments_work():
    _, setup, core = _core()
    core.register("learner-0", 0, now=0.0)
    core.report("learner-0", 0, now=0.0, step_time_s=1.0, cursor=1024)
    paths = setup.plan.fragments[0]
    zeros = {k: np.zeros_like(np.asarray(setup.init[k])) for k in paths}
    future = ContributionMeta("learner-0", 0, 0, 7, 4, 4, 512)
    assert core.offer(future, wire.encode_tree(zeros, "float32"), 0.0) is Verdict.FUTURE_VERSION
    # 512 tokens of work on one of 4 fragments of 1024 trained tokens: an eighth of its work
    assert lost_fraction(core) == pytest.approx(512 / (4 * 1024))


def test_sync_core_state_round_trips():
    cfg, setup, core = _core()
    core.register("learner-0", 0, now=0.0)
    paths = setup.plan.fragments[1]
    delta = {k: np.full(np.asarray(setup.init[k]).shape, 0.01, np.float32) for k in paths}
    core.offer(
        ContributionMeta("learner-0", 0, 1, 0, 4, 4, 512), wire.encode_tree(delta, "float32"), 0.0
    )
    core.poll(now=10.0)
    restored = SynchronizerCore(cfg, setup.plan, setup.init)
    restored.load_state_dict(core.state_dict(), now=11.0)
    assert restored.book.versions() == core.book.versions()
    for p, (v, vals) in core.snapshot().items():
        rv, rvals = restored.snapshot()[p]
        assert rv == v and all(np.array_equal(rvals[k], vals[k]) for k in vals)
    assert restored.ledger.state_dict() == core.ledger.state_dict()


def test_goodput_counts_waiting_on_the_slow_learner(decoupled):
    barrier = run_reference(
        tiny("diloco.mode=synchronous", "learners.2.speed=0.7", "learners.3.jitter=0.2")
    )
    # nobody waits in decoupled mode (only the unfinished last step is lost); the barrier makes
    # the three fast learners wait for the 30% slower one
    assert decoupled["goodput"] > 0.95
    assert barrier["goodput"] < 0.9


def test_resumed_versions_skip_every_lost_version_number():
    cfg, setup, core = _core()
    core.register("learner-0", 0, now=0.0)
    paths = setup.plan.fragments[0]
    delta = {k: np.full(np.asarray(setup.init[k]).shape, 0.01, np.float32) for k in paths}
    enc = wire.encode_tree(delta, "float32")
    core.offer(ContributionMeta("learner-0", 0, 0, 0, 4, 4, 512), enc, 0.0)
    core.poll(now=10.0)  # fragment 0 at version 1: the checkpoint
    restored = SynchronizerCore(cfg, setup.plan, setup.init)
    restored.load_state_dict(core.state_dict(), now=11.0)
    # versions 2 and 3 of fragment 0 were published after the checkpoint, then lost
    assert resume_without_learners(restored, {0: 3, 1: 0}) == 2
    assert restored.book.versions()[0] == 4 and set(restored.book.versions().values()) == {4, 0}
    version, values = restored.snapshot()[0]
    assert version == 4 and all(np.array_equal(values[k], core.snapshot()[0][1][k]) for k in paths)
    # a delta against a lost version (3) cannot be reconstructed: stale, not merged
    restored.register("learner-0", 0, now=12.0)
    stale = ContributionMeta("learner-0", 0, 0, 3, 4, 4, 512)
    assert restored.offer(stale, enc, now=12.0) is Verdict.STALE_VERSION
    assert resume_without_learners(restored, {0: 4}) == 0  # nothing newer: unchanged


@pytest.mark.parametrize("mode", ["decoupled", "data_parallel"])
def test_failures_strike_on_the_shared_schedule_and_cost_goodput(mode):
    faults = ["chaos.enabled=true", "chaos.mtbf_s=2.0", "chaos.seed=3", "chaos.restart_s=0.2"]
    base = run_reference(tiny(f"diloco.mode={mode}", "step_time_s=0.05"))
    hit = run_reference(tiny(f"diloco.mode={mode}", "step_time_s=0.05", *faults))
    times = hit["failure_times"]
    assert base["failure_times"] == [] and base["failures"] == 0
    assert len(times) == hit["failures"] > 0 and times == sorted(times)
    assert times[0] > 0 and times[-1] <= hit["virtual_time_s"]
    assert hit["goodput"] < base["goodput"]
    assert hit["tokens"] >= 12000 and hit["heldout_loss"] == hit["heldout_loss"]


@pytest.mark.parametrize("seed", [0, 7])
def test_synchronous_learners_never_deadlock_on_a_restart(seed):
    # A restart fences the learner's entry in an open round; the round used to wait for the
    # new incarnation's offer, which its schedule (from its data cursor) made only a window
    # later, while that learner waited, blocked, on a round that needed the others' offers.
    # These seeds stalled at 20k and 16k of 24k tokens (the event queue ran dry).
    faults = ["chaos.enabled=true", "chaos.mtbf_s=1.0", "chaos.restart_s=0.5"]
    s = run_reference(
        tiny("diloco.mode=synchronous", "token_budget=24000", *faults, f"chaos.seed={seed}")
    )
    assert s["failures"] > 10
    assert s["tokens"] >= 24000


def test_plan_link_loads_are_the_reference_runs_byte_rates(decoupled):
    # `ray-diloco plan` predicts each region's bytes per second at step_time_s; the reference
    # run moves its bytes on that virtual clock, so its upstream rate is the prediction (up to
    # the run's ragged end) and its downstream rate stays under the predicted bound (to 3%).
    from ray_diloco.algorithm.setup import fragment_plan
    from ray_diloco.cluster.plan import learner_link_loads

    cfg = tiny("learners.2.speed=0.7", "learners.3.jitter=0.2")
    (load,) = learner_link_loads(cfg, fragment_plan(cfg).sizes, "local")
    seconds = decoupled["virtual_time_s"]
    assert decoupled["bytes_up"] / seconds == pytest.approx(load.up, rel=0.03)
    # (pulled rounds: the pull follows whichever learner is ahead, a little faster than the
    # fastest one's mean pace when they jitter)
    assert decoupled["bytes_down"] / seconds <= load.down * 1.03
