"""Each injected fault is matched to its detection and its recovery on the tape."""

from __future__ import annotations

import pytest

from ray_diloco.control.events import (
    ContributionRejected,
    FailureDetected,
    FailureKind,
    FaultInjected,
    LearnerDegraded,
    LearnerRecovered,
    LearnerRejoined,
    RoundClosed,
    SynchronizerLost,
    SynchronizerRestored,
)
from ray_diloco.control.recovery import fault_outcomes, summarize_outcomes

REGIONS = {"a": "us", "b": "eu"}


def test_lethal_faults_on_one_learner_are_attributed_in_order():
    tape = [
        FaultInjected(10.0, "kill_host", "a"),
        FailureDetected(10.4, "a", FailureKind.CRASH, 0.4),
        LearnerRejoined(16.0, "a", 1, {0: 3}, 5.6),
        FaultInjected(20.0, "hang_host", "a", duration_s=5.0),
        FailureDetected(22.1, "b", FailureKind.HANG, 2.1),  # another learner: not this fault
        FailureDetected(22.2, "a", FailureKind.HANG, 2.2),
        LearnerRejoined(21.0, "b", 1, {}, 1.0),
        LearnerRejoined(29.0, "a", 2, {0: 9}, 6.8),
    ]
    first, second = fault_outcomes(tape, REGIONS)
    assert (first.detection_s, first.recovery_s) == pytest.approx((0.4, 6.0))
    assert (second.detection_s, second.recovery_s) == pytest.approx((2.2, 9.0))


def test_a_numerical_failure_never_explains_a_lethal_fault():
    # The corrupted contribution was fenced unseen (lost with a synchronizer, say): the crash
    # that follows is the kill's detection, not the corruption's.
    tape = [
        FaultInjected(1.0, "corrupt_nan", "b"),
        FaultInjected(5.0, "kill_group", "b"),
        FailureDetected(5.3, "b", FailureKind.CRASH, 0.3),
        LearnerRejoined(9.0, "b", 1, {}, 3.7),
    ]
    nan, kill = fault_outcomes(tape, REGIONS)
    assert nan.detected_t is None and nan.recovered_t is None and nan.superseded
    assert (kill.detection_s, kill.recovery_s) == pytest.approx((0.3, 4.0))
    assert not kill.superseded


def test_a_fault_whose_restart_a_later_fault_kills_is_superseded():
    # The storm on a loaded CI machine: b restarted after its NaN, and the kill landed before
    # the new incarnation had contributed; its rejoin is the kill's recovery, not the NaN's.
    tape = [
        FaultInjected(29.2, "corrupt_nan", "b"),
        FailureDetected(30.0, "b", FailureKind.NUMERICAL, 0.3),
        FaultInjected(40.3, "corrupt_norm", "b"),  # waits for a contribution that never comes
        FaultInjected(42.3, "kill_group", "b"),
        FailureDetected(42.6, "b", FailureKind.CRASH, 0.2),
        LearnerRejoined(48.4, "b", 2, {0: 30}, 5.8),
        FaultInjected(50.0, "straggler", "b", duration_s=4.0),  # does not take b down
        FaultInjected(60.0, "kill_host", "b"),
        FailureDetected(60.5, "b", FailureKind.CRASH, 0.5),
        LearnerRejoined(66.0, "b", 3, {0: 40}, 5.5),
    ]
    nan, norm, kill, straggler, kill_host = fault_outcomes(tape, REGIONS)
    assert nan.detected_t == 30.0 and nan.recovered_t is None and nan.superseded
    assert norm.detected_t is None and norm.superseded
    assert kill.recovered_t == 48.4 and not kill.superseded
    assert straggler.detected_t is None and not straggler.superseded  # never excused
    assert kill_host.recovered_t == 66.0 and not kill_host.superseded
    # a fault still unrecovered with nothing after it on its learner is not excused either
    (last,) = fault_outcomes(tape[:2], REGIONS)
    assert last.recovered_t is None and not last.superseded


def test_a_synchronizer_killed_again_while_it_restores_is_restored_once():
    # Measured on Ray beside two busy processes: the second kill came while the shard was still
    # recovering from the first, and the supervisor saw one restore, the second kill's.
    tape = [
        FaultInjected(30.0, "kill_synchronizer", None),
        SynchronizerLost(32.2, 2.0),
        FaultInjected(39.4, "kill_synchronizer", "0"),  # shard 0 named: the same shard
        SynchronizerLost(41.5, 2.0),
        SynchronizerRestored(47.5, {0: 27, 1: 30}, 0),
        RoundClosed(48.0, 0, 28, 1, 100),
        FaultInjected(60.0, "kill_synchronizer", "1"),  # another shard: not superseding
        SynchronizerLost(62.0, 2.0, shard=1),
    ]
    first, second, other = fault_outcomes(tape, REGIONS)
    assert first.detected_t == 32.2 and first.recovered_t is None and first.superseded
    assert second.detected_t == 41.5 and second.recovered_t == 48.0 and not second.superseded
    assert other.detected_t == 62.0 and other.recovered_t is None and not other.superseded


def test_corruption_straggler_link_and_synchronizer():
    tape = [
        FaultInjected(1.0, "corrupt_nan", "b"),
        ContributionRejected(1.5, "b", 0, 1, "non_finite"),
        FailureDetected(1.6, "b", FailureKind.NUMERICAL, 0.1),
        LearnerRejoined(7.0, "b", 1, {}, 5.4),
        FaultInjected(8.0, "straggler", "a", duration_s=4.0),
        LearnerDegraded(10.0, "a", "slow_steps"),
        LearnerRecovered(13.0, "a", "slow_steps", 3.0),
        FaultInjected(14.0, "cut_link", "eu", duration_s=4.0),
        LearnerDegraded(14.5, "a", "no_contributions"),  # not in eu: ignored
        LearnerDegraded(17.0, "b", "no_contributions"),
        LearnerRecovered(18.5, "b", "no_contributions", 1.5),
        FaultInjected(20.0, "kill_synchronizer", None),
        SynchronizerLost(22.0, 2.0),
        RoundClosed(24.0, 0, 5, 1, 100),  # before the restore: not the recovery
        SynchronizerRestored(25.0, {0: 4}, 1),
        RoundClosed(26.5, 0, 5, 1, 100),
        FaultInjected(30.0, "slow_link", "us", duration_s=2.0),  # never noticed
        FaultInjected(40.0, "corrupt_norm", "a"),
        ContributionRejected(40.2, "a", 0, 1, "norm_outlier"),
        LearnerDegraded(40.3, "a", "norm_outlier"),
        LearnerRecovered(41.0, "a", "norm_outlier", 0.7),
    ]
    outcomes = fault_outcomes(tape, REGIONS)

    def r(x: float | None) -> float | None:
        return None if x is None else round(x, 6)

    got = [(o.fault, o.learner, r(o.detection_s), r(o.recovery_s)) for o in outcomes]
    assert got == [
        ("corrupt_nan", "b", 0.5, 6.0),
        ("straggler", "a", 2.0, 5.0),
        ("cut_link", "b", 3.0, 4.5),
        ("kill_synchronizer", None, 2.0, 6.5),
        ("slow_link", "us", None, None),
        ("corrupt_norm", "a", 0.2, 1.0),
    ]
    summary = summarize_outcomes(outcomes)
    assert summary["slow_link"] == {
        "count": 1,
        "detected": 0,
        "recovered": 0,
        "detection_s_median": None,
        "recovery_s_median": None,
    }
    assert summary["cut_link"]["recovery_s_median"] == pytest.approx(4.5)
    assert outcomes[0].to_dict()["recovery_s"] == pytest.approx(6.0)
