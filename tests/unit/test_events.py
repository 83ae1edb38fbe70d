"""Event tape entries: every event kind round-trips through to_dict/JSON/event_from_dict."""

from __future__ import annotations

import json

import pytest

from ray_diloco.control.events import (
    ContributionRejected,
    Event,
    FailureDetected,
    FailureKind,
    FaultInjected,
    GiveUp,
    HeldoutEvaluated,
    LearnerDegraded,
    LearnerJoined,
    LearnerLeft,
    LearnerRecovered,
    LearnerRejoined,
    LearnerRestarted,
    LearnerState,
    LearnerStateChanged,
    NoAction,
    Restart,
    RoundClosed,
    RunFinished,
    RunStarted,
    SynchronizerLost,
    SynchronizerRestored,
    WorkLost,
    event_from_dict,
    event_kinds,
)

SAMPLES: list[Event] = [
    RunStarted(0.0, config_digest="abc123"),
    LearnerStateChanged(1.5, "learner-0", 2, LearnerState.TRAINING, reason="compiled"),
    FaultInjected(2.0, fault="kill_host", target="learner-1", duration_s=3.0, detail="host 0"),
    FaultInjected(2.5, fault="kill_synchronizer", target=None),
    FailureDetected(3.0, "learner-1", FailureKind.NODE_LOST, detection_s=1.0),
    LearnerRestarted(4.0, "learner-1", incarnation=1, attempt=1, recovered_in_s=1.0),
    LearnerRejoined(6.0, "learner-1", 1, adopted_versions={0: 7, 3: 5}, recovered_in_s=3.0),
    ContributionRejected(6.5, "learner-1", 0, fragment=3, reason="stale incarnation"),
    RoundClosed(7.0, fragment=3, version=6, num_contributors=2, tokens=4096),
    RoundClosed(7.1, 1, 7, 1, 2048, grace_s=0.25, waited_s=0.1),
    HeldoutEvaluated(7.2, tokens=4096, rounds=6, loss=3.25),
    WorkLost(7.5, "learner-2", steps=12, seconds=0.6),
    SynchronizerRestored(8.0, from_versions={0: 4, 1: 4}, rounds_lost=3),
    SynchronizerLost(7.8, detection_s=2.0, detail="status unanswered"),
    LearnerDegraded(8.2, "learner-1", cause="slow_steps", detail="2.0 vs 9.0 steps/s"),
    LearnerRecovered(8.4, "learner-1", cause="slow_steps", degraded_s=5.0),
    LearnerJoined(8.5, "spare-0", region="asia-east1", accelerator="cpu", reason="scavenged"),
    LearnerLeft(8.7, "spare-0", reason="its node is being drained", tokens_returned=4096),
    RunFinished(9.0, tokens=2_000_000, reason="token budget"),
]


def test_every_registered_kind_has_a_sample():
    assert {type(e).kind for e in SAMPLES} == set(event_kinds())


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: type(e).kind)
def test_round_trip_through_json(event):
    wire = json.loads(json.dumps(event.to_dict()))
    assert wire["kind"] == type(event).kind
    back = event_from_dict(wire)
    assert back == event
    assert type(back) is type(event)


def test_enums_and_int_keys_come_back_typed():
    ev = event_from_dict(json.loads(json.dumps(SAMPLES[6].to_dict())))
    assert isinstance(ev, LearnerRejoined)
    assert all(isinstance(k, int) for k in ev.adopted_versions)
    ev2 = event_from_dict(SAMPLES[4].to_dict())
    assert isinstance(ev2, FailureDetected)
    assert ev2.failure is FailureKind.NODE_LOST
    assert SAMPLES[1].to_dict()["state"] == "training"


def test_int_time_is_read_back_as_float():
    ev = event_from_dict({"kind": "run_started", "t": 3, "config_digest": "x"})
    assert isinstance(ev.t, float)


def test_events_are_frozen():
    with pytest.raises(AttributeError):
        SAMPLES[0].t = 5.0  # type: ignore[misc]


@pytest.mark.parametrize(
    "bad",
    [
        {"kind": "no_such_event", "t": 0.0},
        {"kind": "run_started", "t": 0.0},  # missing field
        {"kind": "run_started", "t": 0.0, "config_digest": "x", "extra": 1},
        {"kind": "learner_state_changed", "t": 0, "learner": "a", "incarnation": 0, "state": "?"},
    ],
)
def test_invalid_dicts_raise_value_error(bad):
    with pytest.raises(ValueError):
        event_from_dict(bad)


def test_decisions_are_frozen_values():
    r = Restart("learner-0", delay_s=1.0, reason="crash", rebuild_group=False)
    assert r.attempt == 1
    assert r == Restart("learner-0", 1.0, "crash", False)
    with pytest.raises(AttributeError):
        r.delay_s = 2.0  # type: ignore[misc]
    assert GiveUp("learner-0", "budget") != NoAction()
