"""A synchronizer restarted after its last checkpoint recovers every round since: the
round log (algorithm/round_log.py) makes its ledger exact, the learners hand back the newest
values (`SynchronizerCore.provide`), and what nobody can hand back falls back to the checkpoint
under fresh version numbers."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest

from ray_diloco.algorithm import wire
from ray_diloco.algorithm.downstream import Message
from ray_diloco.algorithm.learner_core import LearnerCore
from ray_diloco.algorithm.round_log import LoggedRound, RoundLog
from ray_diloco.algorithm.round_types import ContributionMeta, Verdict
from ray_diloco.algorithm.setup import Setup
from ray_diloco.algorithm.sync_core import SynchronizerCore
from ray_diloco.config import load_config
from tests.sync_helpers import TINY, resume_without_learners

LEARNERS = ("a", "b")


@pytest.fixture(scope="module")
def setup() -> Setup:
    return Setup.build(
        load_config(None, [*TINY, "diloco.quorum_min=2", "diloco.max_staleness_versions=4"])
    )


class Run:
    """A synchronizer that logs every committed round, with a checkpoint taken on request."""

    def __init__(self, setup: Setup, log_dir: Path) -> None:
        self.setup = setup
        self.core = SynchronizerCore(setup.cfg, setup.plan, setup.init)
        self.log = RoundLog(log_dir)
        self.now = 0.0
        for name in LEARNERS:
            self.core.register(name, 0, now=0.0)
        self.cursor = 0

    def rounds(self, n: int) -> None:
        rng = np.random.default_rng(int(self.now))
        for _ in range(n):
            self.cursor += 512
            for name in LEARNERS:
                self.core.report(name, 0, self.now, 0.1, self.cursor)
            for p in range(self.setup.plan.num_fragments):
                base = self.core.book.versions()[p]
                for name in LEARNERS:
                    paths = self.setup.plan.fragments[p]
                    delta = {k: rng.normal(0, 0.01, np.shape(self.setup.init[k])) for k in paths}
                    meta = ContributionMeta(name, 0, p, base, 4 * (base + 1), 4, 256)
                    verdict = self.core.offer(meta, wire.encode_tree(delta, "bfloat16"), self.now)
                    assert verdict is Verdict.ACCEPTED
            self.now += 10.0
            for pub in self.core.poll(self.now):
                cursors = {n: self.core.ledger.account(n).cursor for n in LEARNERS}
                self.log.append(LoggedRound.of(pub.close, cursors))

    def restarted(self, checkpoint: dict) -> SynchronizerCore:
        """A new core from `checkpoint`, recovering from the log and this run's versions."""
        core = SynchronizerCore(self.setup.cfg, self.setup.plan, self.setup.init)
        core.load_state_dict(copy.deepcopy(checkpoint), now=self.now)
        core.start_recovery(self.log.entries(), self.core.book.versions())
        return core


def _ledger(core: SynchronizerCore) -> dict:
    return {n: (a.cursor, a.merged, a.contributions) for n, a in core.ledger.accounts.items()}


def test_learners_hand_back_every_round_since_the_checkpoint(setup: Setup, tmp_path: Path) -> None:
    run = Run(setup, tmp_path)
    run.rounds(2)
    checkpoint = copy.deepcopy(run.core.state_dict())  # a checkpoint is a copy
    run.log.compact(run.core.book.versions())  # what a checkpoint does to the log
    run.rounds(3)  # three rounds per fragment the checkpoint lacks
    core = run.restarted(checkpoint)
    assert sorted(core.recovering) == [0, 1] and core.wanted() == {0: 2, 1: 2}
    meta = ContributionMeta("a", 0, 0, 5, 4, 4, 256)
    assert core.offer(meta, {}, run.now) is Verdict.RECOVERING
    assert core.poll(run.now + 100.0) == []  # no round closes while recovering
    for p, (version, values) in run.core.snapshot().items():
        older = run.core.history.published[p][version - 1]  # a learner one version behind
        assert not core.provide(p, version - 1, older)
        assert core.provide(p, version, values)  # the newest logged: nothing newer can come
        assert core.finish_recovery(p) == (version, 0)
    assert core.recovering == {} and core.book.versions() == run.core.book.versions() == {
        0: 5,
        1: 5,
    }
    for p, (version, values) in run.core.snapshot().items():
        assert core.snapshot()[p][0] == version
        for k, v in values.items():
            np.testing.assert_array_equal(core.values[p][k], v)  # the learners' bfloat16 copy
    assert _ledger(core) == _ledger(run.core)
    assert core.ledger.violations() == []
    # The book remembers what was merged: a re-offer from the same base counts only new work.
    assert core.book.fragments[0].merged == run.core.book.fragments[0].merged


def test_without_learners_the_checkpoint_comes_back_under_a_fresh_number(
    setup: Setup, tmp_path: Path
) -> None:
    run = Run(setup, tmp_path)
    run.rounds(1)
    checkpoint = copy.deepcopy(run.core.state_dict())  # a checkpoint is a copy
    run.log.compact(run.core.book.versions())
    run.rounds(2)
    core = run.restarted(checkpoint)
    ledger_at_checkpoint = _ledger(run.restarted(checkpoint))
    # One learner hands back version 2 (not the newest, 3): the rounds past it are lost.
    assert not core.provide(0, 2, run.core.history.published[0][2])
    assert core.finish_recovery(0) == (2, 1)
    assert core.finish_recovery(1) == (1, 2)  # nobody: the checkpoint's value
    # Numbers that may exist somewhere are never reused: 4 names the same values as 2 (and 1).
    assert core.book.versions() == {0: 4, 1: 4}
    for k, v in run.core.history.published[0][2].items():
        np.testing.assert_array_equal(core.snapshot()[0][1][k], v)
    # The ledger has fragment 0's round 2 and nothing past the adopted versions.
    merged = {n: a.merged for n, a in core.ledger.accounts.items()}
    # (each round merges 256 tokens of each learner per fragment)
    assert merged == {n: {0: m[1][0] + 256, 1: m[1][1]} for n, m in ledger_at_checkpoint.items()}
    # A delta against a version nobody recovered cannot be rebuilt: stale.
    core.register("a", 0, now=run.now)
    stale = ContributionMeta("a", 0, 0, 3, 4, 4, 256)
    paths = setup.plan.fragments[0]
    zeros = wire.encode_tree({k: np.zeros(np.shape(setup.init[k])) for k in paths}, "bfloat16")
    assert core.offer(stale, zeros, run.now) is Verdict.STALE_VERSION
    assert core.offer(ContributionMeta("a", 0, 0, 2, 4, 4, 256), zeros, run.now).value in (
        "accepted",
        "empty",  # (its counters were merged already: nothing new to count)
    )


def test_a_learner_on_the_renamed_number_is_not_stale(setup: Setup, tmp_path: Path) -> None:
    # Six rounds past the checkpoint and nobody to hand them back: the checkpoint's value
    # (version 1) comes back as version 8. A learner that adopted it as 1 during the recovery
    # holds the newest value: its offer is judged from 8, not refused as 7 versions stale.
    run = Run(setup, tmp_path)
    run.rounds(1)
    checkpoint = copy.deepcopy(run.core.state_dict())
    run.log.compact(run.core.book.versions())
    run.rounds(6)
    core = run.restarted(checkpoint)
    assert [core.finish_recovery(p) for p in (0, 1)] == [(1, 6), (1, 6)]
    assert core.book.versions() == {0: 8, 1: 8}
    assert setup.cfg.diloco.max_staleness_versions < 8 - 1
    core.register("a", 0, now=run.now)
    paths = setup.plan.fragments[0]
    delta = wire.encode_tree({k: np.full(np.shape(setup.init[k]), 0.01) for k in paths}, "bfloat16")
    meta = ContributionMeta("a", 0, 0, 1, 4, 4, 256)
    assert core.offer(meta, delta, run.now) is Verdict.ACCEPTED
    assert core.book.fragments[0].pending["a"].meta.base_version == 8


def test_resumed_run_adopts_the_checkpoint_at_once(setup: Setup, tmp_path: Path) -> None:
    run = Run(setup, tmp_path)
    run.rounds(1)
    checkpoint = copy.deepcopy(run.core.state_dict())  # a checkpoint is a copy
    run.rounds(1)
    core = SynchronizerCore(setup.cfg, setup.plan, setup.init)
    core.load_state_dict(copy.deepcopy(checkpoint), now=run.now)
    # one round of each fragment lost
    assert resume_without_learners(core, run.core.book.versions()) == 2
    assert core.recovering == {} and core.book.versions() == {0: 3, 1: 3}


def test_round_log_survives_a_torn_line_and_drops_what_is_covered(tmp_path: Path) -> None:
    log = RoundLog(tmp_path)
    for v in (1, 2, 3):
        log.append(LoggedRound(0, v, (), {"a": 100 * v}))
    log.append(LoggedRound(1, 1, (), {}))
    with open(log.path, "a") as fh:
        fh.write('{"fragment": 0, "vers')  # the process died mid-line
    assert [(e.fragment, e.version) for e in log.entries()] == [(0, 1), (0, 2), (0, 3), (1, 1)]
    log.compact({0: 1})
    log.discard(0, 2)
    assert [(e.fragment, e.version) for e in RoundLog(tmp_path).entries()] == [(0, 2), (1, 1)]


def test_a_learner_holds_its_newest_publication(setup: Setup) -> None:
    # What a restarted synchronizer asks for: the applied version, or a newer one received
    # for the next step boundary.
    cfg = setup.cfg
    core = LearnerCore(
        cfg, cfg.learners[0], setup.task, setup.layout, setup.plan, _snapshot(setup, 3)
    )
    core.receive(Message(1, 5, None, wire.encode_tree(_values(setup, 1, 9.0), "bfloat16")))
    held = core.held()
    assert held[0][0] == 3 and held[1][0] == 5
    for v in held[1][1].values():
        np.testing.assert_array_equal(np.asarray(v), 9.0)


def test_a_rejoining_learner_keeps_the_work_of_the_outage(setup: Setup) -> None:
    # It trained on while its shard was down. Fragment 0 is still at its base on the restarted
    # shard: the steps since stay, for its next offer. Fragment 1 moved on: adopted.
    cfg = setup.cfg
    core = LearnerCore(
        cfg, cfg.learners[0], setup.task, setup.layout, setup.plan, _snapshot(setup, 3)
    )
    for _ in range(4):
        core.train_step(*core.next_batch())
    trained = {k: np.asarray(core.params[k]) for k in setup.plan.fragments[0]}
    snapshot = _snapshot(setup, 3) | {1: (5, _values(setup, 1, 9.0))}
    assert core.rejoin(snapshot) == [0]
    assert core.steps_since == [4, 0] and core.base_version == [3, 5]
    for k, v in trained.items():
        np.testing.assert_array_equal(np.asarray(core.params[k]), v)
        assert not np.array_equal(v, np.asarray(setup.init[k]))
    for k in setup.plan.fragments[1]:
        np.testing.assert_array_equal(np.asarray(core.params[k]), 9.0)
    (meta, _), *_ = core.final_offers()
    assert (meta.fragment, meta.base_version, meta.num_steps) == (0, 3, 4)


def _values(setup: Setup, p: int, fill: float) -> dict[str, np.ndarray]:
    return {k: np.full(np.shape(setup.init[k]), fill, np.float32) for k in setup.plan.fragments[p]}


def _snapshot(setup: Setup, version: int) -> dict:
    return {
        p: (version, {k: np.asarray(setup.init[k]) for k in paths})
        for p, paths in enumerate(setup.plan.fragments)
    }
