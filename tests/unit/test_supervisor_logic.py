"""The supervisor's health and membership logic driven with fake collaborators and no Ray
(tests/supervisor_fakes.py): replies, failures, rejoins, joins, leaves, drains, retiring."""

from __future__ import annotations

import dataclasses

import pytest

from ray_diloco.config import RunConfig
from ray_diloco.control.events import LearnerState, StopReason, WorkLost
from ray_diloco.control.protocol import Registered
from ray_diloco.control.supervision import KillLearner, StartLearner
from tests.supervisor_fakes import Supervised, learner
from tests.unit.test_sync_shards import _status


def _training(sup: Supervised, name: str, now: float, step: int = 0) -> None:
    sup.ping(name, LearnerState.TRAINING, now, step=step)
    assert sup.control.watches[name].state is LearnerState.TRAINING


def test_a_dead_learner_is_restarted_and_the_work_since_its_last_merge_counted() -> None:
    sup = Supervised(["a", "b"])
    _training(sup, "a", 1.0)
    sup.sync.status = dataclasses.replace(_status(0, 3, {"a": 2}, []), merged_steps={"a": 4})
    sup.ping("a", LearnerState.TRAINING, 5.0, step=10)
    sup.ping("a", LearnerState.DEAD, 6.0, step=10, error="Traceback\nValueError: boom")
    assert [type(c) for c in sup.commands] == [KillLearner]
    lost = [e for e in sup.events if isinstance(e, WorkLost)]
    assert [(e.learner, e.steps) for e in lost] == [("a", 10 - 4)]  # steps since its merge
    failure = next(e for e in sup.events if e.kind == "failure_detected")
    assert failure.detail == "ValueError: boom"  # type: ignore[attr-defined]
    _, commands = sup.control.tick(1e6)  # past the backoff: the next incarnation starts
    assert any(isinstance(c, StartLearner) and c.incarnation == 1 for c in commands)
    assert sup.control.watches["b"].state is not LearnerState.DEAD


def test_a_merge_of_the_new_incarnation_is_its_rejoin() -> None:
    sup = Supervised(["a"])
    _training(sup, "a", 1.0)
    sup.ping("a", LearnerState.DEAD, 2.0)
    sup.control.tick(1e6)
    st = _status(0, 3, {"a": 1}, [])
    st = dataclasses.replace(
        st, merged_incarnations={"a": 1}, registered={"a": Registered(1, {0: 3})}
    )
    sup.health.on_sync_status(st, 1e6 + 1)
    assert "learner_rejoined" in sup.kinds()
    sup.health.on_sync_status(dataclasses.replace(st, finished=True), 1e6 + 2)
    assert sup.phase.over and sup.phase.ending


def test_nothing_fails_once_the_run_is_ending() -> None:
    sup = Supervised(["a"])
    _training(sup, "a", 1.0)
    sup.phase.finish = "stopped by the driver"
    sup.ping("a", LearnerState.DEAD, 2.0)
    assert sup.commands == [] and "failure_detected" not in sup.kinds()


def test_joins_are_queued_carried_out_on_the_loop_and_names_never_reused() -> None:
    sup = Supervised(["a"])
    sup.membership.request_join(learner("x"), "requested")
    with pytest.raises(ValueError, match="'x' is taken"):
        sup.membership.request_join(learner("x"), "requested")
    assert "x" not in sup.slots  # not before the loop's thread carries it out
    sup.membership.change(1.0)
    assert sup.slots["x"].launched == [0] and "learner_joined" in sup.kinds()
    assert "x" in sup.control.in_run()
    cfg = RunConfig.model_validate({"elastic": {"max_learners": 4}})
    full = Supervised(["a", "b", "c", "d"], cfg)
    with pytest.raises(ValueError, match="max_learners=4"):
        full.membership.request_join(learner("y"), "requested")


def test_a_graceful_leave_waits_for_the_goodbye_then_the_shards_acknowledge() -> None:
    sup = Supervised(["a", "b"])
    _training(sup, "a", 1.0)
    with pytest.raises(ValueError, match="no learner 'z'"):
        sup.membership.request_leave("z", "requested")
    sup.membership.request_leave("a", "requested")
    sup.membership.change(2.0)
    assert sup.slots["a"].left == ["requested"] and sup.leaves.sent == []  # goodbye first
    sup.ping("a", LearnerState.LEFT, 3.0)
    assert sup.leaves.sent == [("a", "requested")] and sup.slots["a"].released
    sup.leaves.acks.append(("a", "requested", 512))
    sup.membership.change(4.0)
    left = next(e for e in sup.events if e.kind == "learner_left")
    assert left.tokens_returned == 512  # type: ignore[attr-defined]
    assert "a" not in sup.control.in_run() and sup.commands == []


def test_a_leaving_learner_that_dies_is_not_restarted() -> None:
    sup = Supervised(["a"])
    _training(sup, "a", 1.0)
    sup.membership.request_leave("a", "requested")
    sup.membership.change(2.0)
    sup.ping("a", LearnerState.DEAD, 3.0)
    assert sup.commands == [] and sup.leaves.sent == [("a", "requested")]


def test_a_drained_node_makes_its_learner_leave() -> None:
    sup = Supervised(["a", "b"])
    _training(sup, "a", 1.0)
    _training(sup, "b", 1.0)
    sup.draining = {"node-a"}
    sup.membership.change(5.0)
    assert sup.slots["a"].left and not sup.slots["b"].left


def test_a_learner_given_up_on_retires_while_enough_others_remain() -> None:
    sup = Supervised(["a", "b", "c"])
    for name in ("a", "b", "c"):
        _training(sup, name, 1.0)
    sup.control.watches["a"].state = LearnerState.GAVE_UP
    sup.membership.retire_given_up()
    assert sup.slots["a"].released and sup.leaves.sent == [("a", "retired: gave up")]
    sup.membership.retire_given_up()
    assert len(sup.leaves.sent) == 1  # once


def test_only_host_0_says_why_a_multi_host_learner_finished() -> None:
    """The other hosts end when host 0's broadcast says so, with no reason of their own: a
    host 1 that finished before the supervisor heard of the budget is no crash."""
    sup = Supervised(["a"], hosts=2)
    for host in (0, 1):
        sup.ping("a", LearnerState.TRAINING, 1.0, host=host)
    sup.ping("a", LearnerState.FINISHED, 2.0, host=1)  # its stop reason: the default
    assert sup.commands == [] and "failure_detected" not in sup.kinds()
    sup.ping("a", LearnerState.FINISHED, 2.5, stop=StopReason.BUDGET, detail="budget")
    assert sup.control.watches["a"].state is LearnerState.FINISHED
