"""Learners joining and leaving a running job in the reference run (`elastic.schedule`): a
joiner starts from the newest global fragments and contributes, a leaver offers its unsent
work and gives its unread data back, and the ledger stays exact."""

from __future__ import annotations

import pytest

from ray_diloco.config import ConfigError, load_config
from ray_diloco.sim.simulate import run_reference
from tests.unit.test_simulate import tiny

# The run lasts ~2.3 virtual s (four learners of 128 tokens a 0.05 s step): extra boots at 0.5 s
# for 0.2 s, learner-3 leaves at 1.5 s.
JOIN = (
    "elastic.schedule=[{at_s: 0.5, join: {name: extra, batch_size: 8}},"
    " {at_s: 1.5, leave: learner-3}]"
)


@pytest.fixture(scope="module")
def elastic():
    overrides = ["elastic.lease_tokens=1024", "token_budget=24000", "chaos.restart_s=0.2"]
    return run_reference(tiny(JOIN, *overrides))


def test_a_joiner_contributes_and_a_leaver_stops_without_losing_data(elastic) -> None:
    learners = elastic["learners"]
    assert learners["extra"]["contributions_merged"] > 0
    assert learners["extra"]["tokens"] > 0
    # the leaver trained until it left (1.5 virtual s at 0.05 s a step, 128 tokens a step)
    assert learners["learner-3"]["tokens"] <= 1.5 / 0.05 * 128 + 128
    assert learners["learner-0"]["tokens"] > learners["learner-3"]["tokens"]
    assert elastic["ledger_violations"] == []  # no token read twice, none lost, none merged twice
    assert elastic["tokens"] >= 24000
    evals = [e["heldout_loss"] for e in elastic["evals"]]
    assert evals[-1] < evals[0] - 1.0


def test_a_static_run_reads_the_same_data_with_or_without_small_leases() -> None:
    plain = run_reference(tiny())
    leased = run_reference(tiny("elastic.lease_tokens=512"))
    assert leased["heldout_loss"] == plain["heldout_loss"]


def test_schedule_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"elastic\.schedule.*'ghost' leaves"):
        load_config(None, ["elastic.schedule=[{at_s: 1, leave: ghost}]"])
    with pytest.raises(ConfigError, match="exactly one of join"):
        load_config(None, ["elastic.schedule=[{at_s: 1}]"])
    with pytest.raises(ConfigError, match=r"'learner-0' joins at 1\.0s but that name is taken"):
        load_config(None, ["elastic.schedule=[{at_s: 1, join: {name: learner-0}}]"])
