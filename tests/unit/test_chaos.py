"""Seeded chaos schedules: explicit entries, Poisson faults, determinism across processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from ray_diloco.config import ChaosConfig, ScheduledFault
from ray_diloco.control.chaos import LINK_FAULTS, FaultAction, chaos_schedule, due

ROOT = Path(__file__).resolve().parents[2]
LEARNERS = ["learner-0", "learner-1", "learner-2"]
REGIONS = ["us-east", "eu-west"]


def cfg(**kw) -> ChaosConfig:
    return ChaosConfig(enabled=True, **kw)


def poisson_cfg(seed: int = 7) -> ChaosConfig:
    return cfg(seed=seed, mtbf_s=20.0, kinds=("kill_host", "straggler", "cut_link"))


def test_disabled_means_no_faults():
    c = ChaosConfig(enabled=False, mtbf_s=1.0, schedule=(ScheduledFault(at_s=1, kind="kill_host"),))
    assert chaos_schedule(c, LEARNERS, REGIONS, horizon_s=100.0) == []


def test_explicit_entries_keep_fields_and_resolve_targets():
    c = cfg(
        seed=3,
        schedule=(
            ScheduledFault(at_s=5, kind="kill_host", target="learner-2", duration_s=2.0),
            ScheduledFault(at_s=1, kind="straggler", factor=3.0),
            ScheduledFault(at_s=2, kind="slow_link", factor=8.0),
            ScheduledFault(at_s=3, kind="kill_synchronizer"),
        ),
    )
    acts = chaos_schedule(c, LEARNERS, REGIONS, horizon_s=100.0)
    assert [a.at_s for a in acts] == [1.0, 2.0, 3.0, 5.0]
    straggler, slow, sync, kill = acts
    assert straggler.target in LEARNERS and straggler.factor == 3.0
    assert slow.target in REGIONS and slow.factor == 8.0
    assert sync.target is None
    assert kill == FaultAction(5.0, "kill_host", "learner-2", 2.0, 1.0)


def test_none_targets_depend_on_seed_only():
    sched = tuple(ScheduledFault(at_s=i, kind="kill_group") for i in range(12))
    a = chaos_schedule(cfg(seed=1, schedule=sched), LEARNERS, REGIONS, 10.0)
    b = chaos_schedule(cfg(seed=1, schedule=sched), list(reversed(LEARNERS)), REGIONS, 10.0)
    c = chaos_schedule(cfg(seed=2, schedule=sched), LEARNERS, REGIONS, 10.0)
    assert a == b  # the order the caller lists learners in does not matter
    assert [x.target for x in a] != [x.target for x in c]
    assert len({x.target for x in a}) > 1


def test_unknown_or_missing_target_is_an_error():
    bad = cfg(schedule=(ScheduledFault(at_s=1, kind="kill_host", target="nope"),))
    with pytest.raises(ValueError, match="not a known learner"):
        chaos_schedule(bad, LEARNERS, REGIONS, 10.0)
    link = cfg(schedule=(ScheduledFault(at_s=1, kind="cut_link"),))
    with pytest.raises(ValueError, match="region"):
        chaos_schedule(link, LEARNERS, [], 10.0)


def test_poisson_rate_and_fields():
    c = cfg(seed=11, mtbf_s=10.0, kinds=("kill_host",), fault_duration_s=1.5)
    acts = chaos_schedule(c, ["solo"], REGIONS, horizon_s=100_000.0)
    # 10,000 expected arrivals; a Poisson count is within 4% of that with overwhelming odds.
    assert 9_600 < len(acts) < 10_400
    assert all(a.target == "solo" and a.duration_s == 1.5 for a in acts)
    assert all(0 <= a.at_s < 100_000.0 for a in acts)


def test_poisson_kinds_targets_and_order():
    acts = chaos_schedule(poisson_cfg(), LEARNERS, REGIONS, horizon_s=1_000.0)
    assert {a.kind for a in acts} == {"kill_host", "straggler", "cut_link"}
    for a in acts:
        assert a.target in (REGIONS if a.kind in LINK_FAULTS else LEARNERS)
    assert acts == sorted(acts, key=lambda a: (a.at_s, a.target or "", a.kind))
    assert all(a.factor > 1 for a in acts if a.kind == "straggler")


def test_same_seed_same_schedule_other_seed_differs():
    a = chaos_schedule(poisson_cfg(7), LEARNERS, REGIONS, 500.0)
    assert a == chaos_schedule(poisson_cfg(7), LEARNERS, REGIONS, 500.0)
    assert a != chaos_schedule(poisson_cfg(8), LEARNERS, REGIONS, 500.0)


def test_adding_a_learner_keeps_the_others_faults():
    c = cfg(seed=5, mtbf_s=15.0, kinds=("kill_host",))
    small = chaos_schedule(c, LEARNERS[:2], REGIONS, 300.0)
    big = chaos_schedule(c, LEARNERS, REGIONS, 300.0)
    assert [a for a in big if a.target in LEARNERS[:2]] == small


_CHILD = """
import json, sys
from dataclasses import asdict
from ray_diloco.config import ChaosConfig, ScheduledFault
from ray_diloco.control.chaos import chaos_schedule
c = ChaosConfig(enabled=True, seed=7, mtbf_s=20.0, kinds=("kill_host", "straggler", "cut_link"),
                schedule=(ScheduledFault(at_s=4, kind="hang_host"),))
acts = chaos_schedule(c, ["learner-0", "learner-1", "learner-2"], ["us-east", "eu-west"], 500.0)
json.dump([asdict(a) for a in acts], sys.stdout)
"""


def test_identical_across_processes():
    mine = chaos_schedule(
        cfg(
            seed=7,
            mtbf_s=20.0,
            kinds=("kill_host", "straggler", "cut_link"),
            schedule=(ScheduledFault(at_s=4, kind="hang_host"),),
        ),
        LEARNERS,
        REGIONS,
        500.0,
    )
    outs = []
    for hash_seed in ("1", "2"):
        # Different string-hash salts: a schedule keyed on hash() would differ between these.
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        res = subprocess.run(
            [sys.executable, "-c", _CHILD],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=60,
        )
        assert res.returncode == 0, res.stderr
        outs.append(json.loads(res.stdout))
    assert outs[0] == outs[1] == json.loads(json.dumps([asdict(a) for a in mine]))
    assert len(mine) > 10


def test_due_fires_each_action_once():
    acts = [FaultAction(t, "kill_host", "a") for t in (0.0, 1.0, 2.5, 2.5, 4.0)]
    fired: list[FaultAction] = []
    last = float("-inf")
    for now in (0.0, 0.5, 2.5, 3.0, 10.0):
        fired += due(acts, last, now)
        last = now
    assert fired == acts
    assert due(acts, 1.0, 2.5) == acts[2:4]  # (last_t, now]: 1.0 excluded, 2.5 included
    assert due(acts, 4.0, 9.0) == []


def test_to_event_records_the_action():
    ev = FaultAction(3.0, "slow_link", "us-east", 2.0, 4.0).to_event(t=3.1, detail="x")
    assert (ev.t, ev.fault, ev.target, ev.duration_s, ev.detail) == (
        3.1,
        "slow_link",
        "us-east",
        2.0,
        "x",
    )
