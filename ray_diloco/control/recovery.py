"""Layer: control (pure Python; no Ray, no JAX). What each injected fault cost, from the tape.

For every `FaultInjected` on an event tape, `fault_outcomes` finds the event that shows the
fault was noticed (detection) and the one that shows its effect is over (recovery), and the
seconds from the injection to each. Per fault kind:

================================  ==============================  ============================
fault                             detected by                     recovered by
================================  ==============================  ============================
kill_host, kill_group,            FailureDetected of the target   LearnerRejoined of the target
remove_node, hang_host            (not numerical)                 (it contributes again)
corrupt_nan                       ContributionRejected(non_finite) LearnerRejoined of the target
                                  or FailureDetected(numerical)   (it is restarted)
corrupt_norm                      ContributionRejected or          LearnerRecovered(norm_outlier)
                                  LearnerDegraded (norm_outlier)   (merged again; no restart)
straggler                         LearnerDegraded(slow_steps)     LearnerRecovered(slow_steps)
cut_link, slow_link (a region)    LearnerDegraded(no_contri-      LearnerRecovered of that
                                  butions) of a learner there     learner
kill_synchronizer (a shard)       SynchronizerLost of the shard   the shard's first RoundClosed
                                                                  after its SynchronizerRestored
================================  ==============================  ============================

Each event explains at most one fault (the earliest unexplained one before it), so a storm
with repeated faults on one learner is attributed in order. A fault on a learner that another
fault takes down (lethal or corrupt_nan) before the first one was detected and recovered from
is `superseded`: the later fault killed the process that would have shown it (a corruption
waiting for the next contribution, a restarted learner that had not contributed yet), and the
events after belong to the later fault. So is a synchronizer kill whose shard is killed again
before it was restored. The chaos tests and `benchmarks/recovery.py` read
their numbers from here.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from ray_diloco.control.events import (
    ContributionRejected,
    Event,
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

LETHAL = frozenset({"kill_host", "kill_group", "remove_node", "hang_host"})
LINK = frozenset({"cut_link", "slow_link"})
# Faults after which the supervisor restarts the learner: detected as a failure, recovered
# when it rejoins.
RESTARTED = LETHAL | {"corrupt_nan"}
# Faults whose events a later fault can cut short (`_takes_down`); a straggler or a link fault
# is never excused.
SUPERSEDABLE = RESTARTED | {"corrupt_norm", "kill_synchronizer"}
# Rejections that make the supervisor restart the learner (its state may be corrupt) and
# those it only records (the rejection protected the model; the learner heals itself).
RESTART_REASONS = frozenset({"non_finite"})
DEGRADE_REASONS = frozenset({"norm_outlier"})


@dataclass(frozen=True)
class FaultOutcome:
    fault: str
    target: str | None
    t: float
    learner: str | None  # the learner that showed it (for a region: the first one)
    detected_t: float | None
    recovered_t: float | None
    superseded: bool = False  # another fault took its learner down before it was over

    @property
    def detection_s(self) -> float | None:
        return None if self.detected_t is None else self.detected_t - self.t

    @property
    def recovery_s(self) -> float | None:
        """Seconds from the injection until the fault's effect was over."""
        return None if self.recovered_t is None else self.recovered_t - self.t

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "detection_s": self.detection_s, "recovery_s": self.recovery_s}


Match = Callable[[Event], bool]


def fault_outcomes(events: Iterable[Event], regions: Mapping[str, str]) -> list[FaultOutcome]:
    """One outcome per injected fault, in injection order; `regions` maps learner -> region."""
    evs = sorted(events, key=lambda e: e.t)  # stable: ties keep tape order
    used: set[int] = set()
    out = []
    for i, e in enumerate(evs):
        if isinstance(e, FaultInjected):
            out.append(_outcome(e, evs, i, used, regions))
    return out


def _shard(target: str | None) -> int:
    """The shard a `kill_synchronizer` targets (no target: shard 0)."""
    return int(target or 0)


def _takes_down(e: Event, fault: FaultInjected) -> bool:
    """Whether `e` is a later fault that takes down what `fault` hit: its learner, or (a
    synchronizer kill) the same shard again."""
    if not isinstance(e, FaultInjected):
        return False
    if fault.fault == "kill_synchronizer":
        return e.fault == "kill_synchronizer" and _shard(e.target) == _shard(fault.target)
    return e.target == fault.target and e.fault in RESTARTED


def _find(
    evs: list[Event], start: int, used: set[int], match: Match, end: int | None = None
) -> int | None:
    for j in range(start, len(evs) if end is None else end):
        if j not in used and match(evs[j]):
            used.add(j)
            return j
    return None


def _outcome(
    fault: FaultInjected, evs: list[Event], i: int, used: set[int], regions: Mapping[str, str]
) -> FaultOutcome:
    kind, target = fault.fault, fault.target
    learner: str | None = target
    shard = _shard(target) if kind == "kill_synchronizer" else 0
    detect: Match
    recover: Callable[[str | None], Match]
    if kind in RESTARTED:

        def detect(e: Event) -> bool:
            if isinstance(e, FailureDetected):
                # A numerical failure is the corruption's doing; any other kind, a lethal
                # fault's: in a storm, neither explains the other.
                numerical = e.failure == FailureKind.NUMERICAL
                return e.learner == target and numerical == (kind == "corrupt_nan")
            return (
                kind == "corrupt_nan"
                and isinstance(e, ContributionRejected)
                and e.learner == target
                and e.reason in RESTART_REASONS
            )

        def recover(who: str | None) -> Match:
            return lambda e: isinstance(e, LearnerRejoined) and e.learner == who

    elif kind == "corrupt_norm":

        def detect(e: Event) -> bool:
            if isinstance(e, ContributionRejected | LearnerDegraded):
                reason = e.reason if isinstance(e, ContributionRejected) else e.cause
                return e.learner == target and reason in DEGRADE_REASONS
            return False

        def recover(who: str | None) -> Match:
            return lambda e: (
                isinstance(e, LearnerRecovered) and e.learner == who and e.cause in DEGRADE_REASONS
            )

    elif kind == "straggler" or kind in LINK:
        cause = "slow_steps" if kind == "straggler" else "no_contributions"
        members = (
            {target} if kind == "straggler" else {n for n, r in regions.items() if r == target}
        )

        def detect(e: Event) -> bool:
            return isinstance(e, LearnerDegraded) and e.cause == cause and e.learner in members

        def recover(who: str | None) -> Match:
            return lambda e: (
                isinstance(e, LearnerRecovered) and e.cause == cause and e.learner == who
            )

    else:  # kill_synchronizer of shard `shard`
        learner = None

        def detect(e: Event) -> bool:
            return isinstance(e, SynchronizerLost) and e.shard == shard

        def recover(who: str | None) -> Match:
            return lambda e: isinstance(e, SynchronizerRestored) and e.shard == shard

    # Where a later fault takes the same learner (or shard) down: what follows is that
    # fault's. A shard killed again while it restores comes back once, for the second kill.
    end = None
    if kind in SUPERSEDABLE:
        end = next((j for j in range(i + 1, len(evs)) if _takes_down(evs[j], fault)), None)
    d = _find(evs, i + 1, used, detect, end)
    if d is None:
        return FaultOutcome(kind, target, fault.t, learner, None, None, end is not None)
    if kind in LINK | {"straggler"}:
        learner = getattr(evs[d], "learner", learner)
    if isinstance(evs[d], ContributionRejected):
        # The supervisor's reaction to the rejection belongs to this fault too.
        follow = FailureDetected if kind == "corrupt_nan" else LearnerDegraded
        _find(evs, d + 1, used, lambda e: isinstance(e, follow) and e.learner == target)
    r = _find(evs, d + 1, used, recover(learner), end)
    if r is not None and kind == "kill_synchronizer":
        # Recovered when the shard's fragments advance again, not when the process is back.
        r = _find(evs, r + 1, set(), lambda e: isinstance(e, RoundClosed) and e.shard == shard)
    if r is None:
        return FaultOutcome(kind, target, fault.t, learner, evs[d].t, None, end is not None)
    return FaultOutcome(kind, target, fault.t, learner, evs[d].t, evs[r].t)


def summarize_outcomes(outcomes: Iterable[FaultOutcome]) -> dict[str, dict[str, Any]]:
    """Per fault kind: how many, how many detected/recovered, median seconds to each."""
    by_kind: dict[str, list[FaultOutcome]] = {}
    for o in outcomes:
        by_kind.setdefault(o.fault, []).append(o)
    out = {}
    for kind, items in sorted(by_kind.items()):
        det = [o.detection_s for o in items if o.detection_s is not None]
        rec = [o.recovery_s for o in items if o.recovery_s is not None]
        out[kind] = {
            "count": len(items),
            "detected": len(det),
            "recovered": len(rec),
            "detection_s_median": statistics.median(det) if det else None,
            "recovery_s_median": statistics.median(rec) if rec else None,
        }
    return out


def tape_summary(
    events: Iterable[Event],
    end_t: float,
    uptime_window_s: float,
    regions: Mapping[str, str],
    live: bool = False,
) -> dict[str, Any]:
    """Everything a status or summary reports from the tape: goodput and uptime (goodput.py;
    `live`: the run goes on after `end_t`), seconds per state of every learner, failures, and
    each injected fault's outcome."""
    from ray_diloco.control.goodput import compute_goodput

    evs = list(events)
    report = compute_goodput(evs, end_t, uptime_window_s, live)
    outcomes = fault_outcomes(evs, regions)
    return {
        "goodput": report.goodput,
        "uptime": report.uptime,
        "uptime_window_s": uptime_window_s,
        "learner_seconds": {n: b.seconds for n, b in report.learners.items()},
        "num_failures": report.num_failures,
        "recovery": summarize_outcomes(outcomes),
        "faults": [o.to_dict() for o in outcomes],
    }
