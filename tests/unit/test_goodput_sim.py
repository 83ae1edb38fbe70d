"""The goodput simulator at scale (docs/algorithm.md section 10): closed forms, the published
anchors, monotonicity, and that the decoupled system really drives the synchronizer's
RoundBook."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ray_diloco.algorithm.round_types import Verdict
from ray_diloco.cli.goodput import simulate_goodput_main
from ray_diloco.config import ConfigError, GoodputSimConfig, load_config
from ray_diloco.sim.goodput_jobs import cluster, groups, shrinking, waiting
from ray_diloco.sim.goodput_sim import (
    PRESETS,
    DecoupledSim,
    data_parallel,
    elastic_dp,
    learner_bounds,
    simulate,
)
from ray_diloco.sim.goodput_sweep import PUBLISHED, format_table, plot, sweep
from ray_diloco.sim.goodput_trace import (
    FailureTrace,
    complement,
    make_trace,
    quorum_uptime,
    stalls,
    window_uptime,
    windows_touched,
)

pytestmark = pytest.mark.timeout(60)

DAY = 86_400.0

# Closed-form case: one learner on one slice, exponential up and down times.
MTTF_S, MTTR_S, PERIOD_S = 1000.0, 50.0, 200.0


def one_slice(**kw) -> GoodputSimConfig:
    base = dict(
        chips=1,
        chips_per_slice=1,
        num_learners=1,
        mtbi_chip_days=MTTF_S / DAY,
        recovery="exponential",
        recovery_median_s=MTTR_S * math.log(2),  # exponential is set by its median
        restart_cost_s=0.0,
        learner_mode="restart",
        learner_restart_s=0.0,
        checkpoint_interval_s=PERIOD_S,
        round_period_s=PERIOD_S,
        straggler_cv=0.0,
        duration_days=250.0,
        seed=7,
    )
    base.update(kw)
    return GoodputSimConfig(**base)


def analytic_goodput(period_s: float) -> float:
    """Alternating renewal process; a cycle = up time U ~ Exp(lam) + down time D, E[D] = MTTR.

    With no restart cost the job (or learner) runs exactly while its slice is up, and keeps
    only whole periods T of each up time (checkpoints, or contributions merged by the
    synchronizer): K = floor(U / T) is geometric with P(K >= k) = q^k, q = e^{-lam T}, so
    E[K] = q / (1 - q). By the renewal-reward theorem:
        goodput = T q / (1 - q) / (MTTF + MTTR)
    and as T -> 0 (nothing lost) T q / (1 - q) -> MTTF: MTTF / (MTTF + MTTR).

    Statistics: a 250-day run holds ~20k cycles; the relative error of the estimate has a
    std of ~0.2%, so 1% is > 5 standard deviations, and the seed is fixed.
    """
    lam = 1.0 / MTTF_S
    work = MTTF_S if period_s == 0 else period_s * (q := math.exp(-lam * period_s)) / (1 - q)
    return work / (MTTF_S + MTTR_S)


def test_closed_form_one_learner_matches_analytic_goodput():
    cfg = one_slice()
    trace = make_trace(cfg)
    assert trace.num_failures > 15_000
    expected = analytic_goodput(PERIOD_S)
    assert data_parallel(cfg, trace).goodput == pytest.approx(expected, rel=0.01)
    assert DecoupledSim(cfg, trace).run().goodput == pytest.approx(expected, rel=0.01)
    # Checkpointing every step: only the repair costs time.
    no_loss = one_slice(checkpoint_interval_s=0.0)
    assert data_parallel(no_loss, trace).goodput == pytest.approx(analytic_goodput(0), rel=0.01)


def test_one_cost_per_failure_gives_one_over_one_plus_lambda_d():
    # 64 one-chip slices swapped at once (median 1 ms), a cost d = 100 s per failure and a
    # failure every 50 s: lambda d = 2. The job runs Exp(lambda) between stalls of exactly d
    # (failures during a stall are repaired in parallel), so goodput = 1 / (1 + lambda d) =
    # 1/3. Had each failure during a stall restarted the recovery, it would be exp(-2) = 0.135.
    lam, d = 1 / 50.0, 100.0
    cfg = GoodputSimConfig(
        chips=64,
        chips_per_slice=1,
        num_learners=1,
        mtbi_chip_days=64 / lam / DAY,
        recovery="exponential",
        recovery_median_s=1e-3,
        restart_cost_s=d,
        reconfig_pause_s=d,
        duration_days=40.0,  # ~23k stalls: the estimate's std is ~0.3%
    )
    trace = make_trace(cfg)
    expected = 1 / (1 + lam * d)
    assert data_parallel(cfg, trace).goodput == pytest.approx(expected, rel=0.02)
    assert elastic_dp(cfg, trace).goodput == pytest.approx(expected, rel=0.02)
    # A spare learner is the same job with the re-mesh as its cost.
    assert DecoupledSim(cfg, trace).run().goodput == pytest.approx(expected, rel=0.02)


def test_calibrated_defaults_reproduce_the_published_anchors():
    # The full 30-day default at 1.2M chips takes ~1 s: data-parallel and elastic are
    # vectorised, and 8 learners offer once an hour (720 offers each).
    cfg = GoodputSimConfig()
    trace = make_trace(cfg)
    got = {
        "data_parallel": data_parallel(cfg, trace).goodput,
        "elastic_dp": elastic_dp(cfg, trace).goodput,
        "decoupled": DecoupledSim(cfg, trace).run().goodput,
    }
    want = {s: PUBLISHED[(s, m)] for s, m in [("data_parallel", 1), ("elastic_dp", 1)]}
    want["decoupled"] = PUBLISHED[("decoupled", 8)]
    for system, published in want.items():
        assert abs(got[system] - published) <= 0.03, (system, got[system], published)


def test_round_period_sets_resolution_not_goodput_for_learners_that_keep_state():
    base = GoodputSimConfig(chips=150_000, num_learners=4, duration_days=3.0, seed=4)
    trace = make_trace(base)
    for mode in ("spare", "shrink"):
        fine = base.model_copy(update={"learner_mode": mode, "round_period_s": 120.0})
        coarse = base.model_copy(update={"learner_mode": mode, "round_period_s": 3600.0})
        a, b = DecoupledSim(fine, trace).run(), DecoupledSim(coarse, trace).run()
        assert a.rounds > 10 * b.rounds
        # Only the unmerged tail at the end differs: at most one period per learner.
        assert abs(a.goodput - b.goodput) <= 3600.0 / (3 * DAY)


@pytest.mark.parametrize(
    ("mode", "recovery_s", "mtbi_days", "slices"),
    # Slow repairs, so that one big learner spends a lot of time down. A shrinking learner
    # does not wait for repairs; it pays a re-mesh per failure, so it needs more failures,
    # and at least 4 slices per learner: a slice back after the re-mesh waits for the
    # learner's next one, which costs half a learner of 2 slices (a documented limit).
    [("spare", 900.0, 256.0, 32), ("restart", 900.0, 256.0, 32), ("shrink", 10.0, 8.0, 64)],
)
def test_more_learners_never_lower_decoupled_goodput(
    mode: str, recovery_s: float, mtbi_days: float, slices: int
):
    cfg = GoodputSimConfig(
        chips=slices * 256,
        chips_per_slice=256,
        mtbi_chip_days=mtbi_days,  # 256: one failure per slice-day, ~100 failures in 3 days
        recovery_median_s=recovery_s,
        round_period_s=300.0,
        learner_mode=mode,
        duration_days=3.0,
        seed=3,
    )
    trace = make_trace(cfg)
    goodputs = [
        DecoupledSim(cfg.model_copy(update={"num_learners": m}), trace).run().goodput
        for m in (1, 2, 4, 8, 16)
    ]
    assert all(b >= a - 1e-9 for a, b in itertools.pairwise(goodputs)), goodputs
    assert goodputs[-1] > goodputs[0] + 0.1  # and the effect is not tiny


def test_no_failures_gives_full_goodput():
    for mode in ("spare", "shrink", "restart"):
        cfg = GoodputSimConfig(
            chips=4096,
            num_learners=4,
            mtbi_chip_days=1e12,
            duration_days=1.0,
            round_period_s=300.0,
            learner_mode=mode,
        )
        res = {r.system: r for r in simulate(cfg)}
        assert res["data_parallel"].failures == 0
        assert res["data_parallel"].goodput == 1.0
        assert res["data_parallel"].uptime == 1.0
        assert res["elastic_dp"].goodput == 1.0
        # Decoupled loses only the tail after the last merged contribution.
        assert res["decoupled"].goodput > 1 - 300.0 / DAY
        assert res["decoupled"].uptime == 1.0


def test_same_seed_same_result_and_seed_matters():
    cfg = GoodputSimConfig(
        chips=16 * 256,
        num_learners=4,
        mtbi_chip_days=64.0,
        round_period_s=120.0,
        straggler_cv=0.2,
        duration_days=2.0,
        seed=11,
    )
    assert simulate(cfg) == simulate(cfg)
    assert simulate(cfg) != simulate(cfg.model_copy(update={"seed": 12}))


def test_decoupled_drives_the_real_roundbook():
    cfg = GoodputSimConfig(
        chips=16 * 256,
        num_learners=4,
        mtbi_chip_days=32.0,
        recovery_median_s=60.0,
        learner_mode="restart",
        round_period_s=60.0,
        straggler_cv=0.3,
        duration_days=1.0,
        seed=5,
    )
    trace = make_trace(cfg)
    sim = DecoupledSim(cfg, trace)
    res = sim.run()
    assert res.rounds > 100
    assert res.rounds == len(sim.commits_s) == sim.book.fragments[0].version
    assert set(sim.verdicts) == {Verdict.ACCEPTED}
    # Every restart registered a new incarnation: the book knows each learner's latest one.
    for i, job in enumerate(sim.jobs):
        assert sim.book.members[f"learner-{i}"].incarnation == len(job.starts) - 1
    assert res.restarts == sum(len(j.starts) - 1 for j in sim.jobs) > 0
    # K = 1, yet some rounds merged several learners: the grace window let them in.
    assert sim.book.policy.quorum_min == 1
    assert max(sim.round_sizes) > 1
    merged, offered = sum(n * c for n, c in sim.round_sizes.items()), sum(sim.verdicts.values())
    assert offered - cfg.num_learners <= merged <= offered  # at most one pending per learner
    # Dead learners stopped reporting, so live() dropped them; those up at the end are live.
    live = sim.book.live(trace.duration_s)
    timeout = sim.book.policy.heartbeat_timeout_s
    for i, job in enumerate(sim.jobs):
        if job.ends[-1] < trace.duration_s - timeout:
            assert f"learner-{i}" not in live
        elif job.ends[-1] == trace.duration_s:
            assert f"learner-{i}" in live


def test_quorum_above_live_learners_stalls_the_global_model():
    # K = M = 2: the round needs both learners, so a down learner stops the global model.
    base = dict(
        chips=8 * 256,
        num_learners=2,
        mtbi_chip_days=16.0,
        recovery_median_s=300.0,
        round_period_s=120.0,
        duration_days=1.0,
        seed=2,
    )
    trace = make_trace(GoodputSimConfig(**base))
    k1 = DecoupledSim(GoodputSimConfig(**base, quorum_min=1), trace).run()
    k2 = DecoupledSim(GoodputSimConfig(**base, quorum_min=2), trace).run()
    assert k2.uptime < k1.uptime
    assert k2.rounds < k1.rounds


def test_trace_failure_count_matches_poisson_rate():
    cfg = GoodputSimConfig(chips=600 * 256, duration_days=30.0, recovery="pareto", recovery_sigma=2)
    trace = make_trace(cfg)
    lam = 256 / (cfg.mtbi_chip_days * DAY)
    # Each slice is down for a small fraction of the time, so failures ~ N lam T (slightly
    # less); a Poisson count is within 4 standard deviations of its mean.
    expected = 600 * lam * cfg.duration_days * DAY
    assert 0.97 * expected - 4 * expected**0.5 < trace.num_failures < expected + 4 * expected**0.5
    assert np.all(trace.return_s > trace.fail_s)
    assert np.all(np.diff(trace.fail_s) >= 0)
    assert make_trace(cfg).num_failures == trace.num_failures
    # Splitting into groups keeps every failure once, in time order.
    parts = trace.split([0, 100, 350, 600])
    assert sum(len(p) for p in parts) == trace.num_failures
    assert all(np.all(np.diff(trace.fail_s[p]) >= 0) for p in parts)
    assert set(trace.slice_id[parts[1]]) <= set(range(100, 350))


def test_stalls_absorb_failures_and_wait_for_late_slices():
    # Failure at 10 (back at 20, restart 5): stalled until 25. A failure at 22 whose slice is
    # back at 24 adds nothing; one at 23 back at 40 holds the job until 40 (no second restart).
    s, e = stalls(np.array([10.0, 22.0, 23.0, 50.0]), np.array([20.0, 24.0, 40.0, 51.0]), 5.0, 100)
    assert s.tolist() == [10.0, 50.0] and e.tolist() == [40.0, 56.0]
    a, b = complement(s, e, 100.0)
    assert a.tolist() == [0.0, 40.0, 56.0] and b.tolist() == [10.0, 50.0, 100.0]
    assert window_uptime(np.array([0.0]), np.array([10.0]), 40.0, 10.0) == 0.25
    first, stop = windows_touched(np.array([0.0, 12.0, 31.0]), np.array([5.0, 19.0, 45.0]), 10.0)
    assert first.tolist() == [0, 3] and stop.tolist() == [2, 5]
    jobs = [(np.array([0.0]), np.array([50.0])), (np.array([40.0]), np.array([100.0]))]
    assert quorum_uptime(jobs, 1, 100.0, 10.0) == 1.0
    assert quorum_uptime(jobs, 2, 100.0, 10.0) == 0.1


def test_shrinking_job_runs_on_its_healthy_slices_until_the_next_remesh():
    # Two slices of 10 chips. Slice 0 fails at 100 and is back at 150; slice 1 fails at 300
    # and is back at 305. Pause 20: the job runs [0,100) on 20 chips, [120,300) on 10 (slice
    # 0 is back at 150 but waits for the next re-mesh), then [320, 1000) on 20 (slice 1 came
    # back during the re-mesh at 300 and joined it with slice 0).
    trace = FailureTrace(
        1000.0,
        np.array([10, 10]),
        np.array([100.0, 300.0]),
        np.array([150.0, 305.0]),
        np.array([0, 1]),
    )
    job = shrinking(cluster(trace), 20.0)
    assert job.starts.tolist() == [0.0, 120.0, 320.0]
    assert job.chips.tolist() == [20.0, 10.0, 20.0]
    assert job.goodput() == pytest.approx((100 * 20 + 180 * 10 + 680 * 20) / (20 * 1000))
    # Waiting for the spare instead: stalled [100, 170) and [300, 325), always on 20 chips.
    spare = waiting(groups(trace, [0, 2])[0], 20.0)
    assert spare.starts.tolist() == [0.0, 170.0, 325.0] and set(spare.chips) == {20.0}
    four = make_trace(GoodputSimConfig(chips=4 * 256, num_learners=1))
    assert learner_bounds(four, 3) == [0, 1, 3, 4]


def test_sweep_table_and_plot(tmp_path: Path):
    cfg = GoodputSimConfig(duration_days=0.5, round_period_s=300.0)
    rows, profile = sweep(cfg, chips=(8_192, 1_200_000), learners=(2, 8))
    systems = {(r["system"], r["learners"]) for r in rows}
    assert ("decoupled", 8) in systems and ("elastic_dp_per_learner", 2) in systems
    assert {"trace", "data_parallel", "decoupled"} <= profile.keys()
    assert all(r["cpu_s"] >= 0 for r in rows)
    anchored = {(r["system"], r["learners"]) for r in rows if r["published"] is not None}
    assert anchored == {("data_parallel", 1), ("elastic_dp", 1), ("decoupled", 2), ("decoupled", 8)}
    table = format_table(rows)
    assert "| 8,192 |" in table and "decoupled M=8" in table and "N/M" in table
    assert "[88%]" in table and "[27%]" in table
    png = plot(rows, tmp_path / "g.png", "test")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_slow_repair_preset_is_much_harsher():
    fast = GoodputSimConfig(chips=150_000, num_learners=4, duration_days=2.0)
    slow = fast.model_copy(update=PRESETS["slow-repair"])
    trace_fast, trace_slow = make_trace(fast), make_trace(slow)
    for system in (data_parallel, elastic_dp):
        assert system(slow, trace_slow).goodput < system(fast, trace_fast).goodput - 0.2


def test_config_rejects_infinite_mean_pareto():
    with pytest.raises(ConfigError, match="recovery_sigma"):
        load_config(None, ["goodput_sim.recovery=pareto", "goodput_sim.recovery_sigma=0.5"])
    with pytest.raises(ConfigError, match="quorum_min"):
        load_config(None, ["goodput_sim.quorum_min=9"])
    with pytest.raises(ConfigError, match="learner_mode"):
        load_config(None, ["goodput_sim.learner_mode=hope"])


def test_cli_writes_outputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    argv = ["--chips", "4096", "8192", "--learners", "2", "4", "--days", "0.2"]
    argv += ["--set", "goodput_sim.round_period_s=300", "--out", str(tmp_path)]
    assert simulate_goodput_main(argv) == 0
    assert "decoupled M=4" in capsys.readouterr().out
    data = json.loads((tmp_path / "goodput_sim.json").read_text())
    assert data["goodput_sim"]["duration_days"] == 0.2 and len(data["rows"]) == 2 * (2 + 4)
    assert data["meta"]["cpu_s"] > 0 and data["meta"]["wall_s"] > 0
    assert "decoupled" in data["meta"]["cpu_s_by_part"]
    assert "simulate-goodput --chips 4096" in (tmp_path / "goodput_sim.md").read_text()
    assert (tmp_path / "goodput_sim.png").stat().st_size > 0
    preset = ["--preset", "slow-repair", "--chips", "4096", "--days", "0.1", "--out", str(tmp_path)]
    assert simulate_goodput_main(preset) == 0
    slow = json.loads((tmp_path / "goodput_sim_slow_repair.json").read_text())
    assert (
        slow["goodput_sim"]["learner_mode"] == "restart" and slow["meta"]["preset"] == "slow-repair"
    )
    bad = ["--set", "goodput_sim.recovery=pareto", "--set", "goodput_sim.recovery_sigma=0.5"]
    assert simulate_goodput_main(bad) == 2


def test_simulator_imports_neither_ray_nor_jax():
    code = (
        "import sys, ray_diloco.sim.goodput_sweep, ray_diloco.cli.goodput\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'jax')))"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
