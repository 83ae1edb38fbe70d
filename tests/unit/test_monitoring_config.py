"""The Grafana dashboard in the repo is the generator's output and queries only series that
ray_diloco exports; event-driven metrics are recorded by failure kind."""

from __future__ import annotations

import json

from ray_diloco.control.events import (
    FailureDetected,
    FailureKind,
    LearnerRejoined,
    LearnerRestarted,
)
from ray_diloco.observe import grafana
from ray_diloco.runtime.metrics import PREFIX, SPECS, Metrics

SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def test_the_committed_dashboard_is_up_to_date():
    committed = grafana.OUT.read_text()
    assert committed == grafana.render(), "run `python -m ray_diloco.observe.grafana` and commit"
    panels = json.loads(committed)["panels"]
    assert all(p["targets"] and p["datasource"]["uid"] == "${datasource}" for p in panels)


def test_every_queried_series_is_one_ray_diloco_exports():
    exported = {
        f"ray_{PREFIX}{short}{suffix}"
        for short, (kind, *_rest) in SPECS.items()
        for suffix in SUFFIXES[kind]
    }
    assert grafana.series() <= exported, grafana.series() - exported
    for panel in grafana.PANELS:
        for target in panel.targets:
            assert 'run=~"$run"' in target.expr, (panel.title, target.expr)


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[float, dict[str, str] | None]] = []

    def inc(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.calls.append((value, tags))

    observe = inc


def test_restarts_and_recovery_are_recorded_by_the_failure_that_caused_them():
    objects = {
        k: _Recorder() for k in ("learner_restarts", "detection_seconds", "recovery_seconds")
    }
    m = Metrics(objects)
    m.observe_event(FailureDetected(1.0, "eu-0", FailureKind.PREEMPTION, 0.5))
    m.observe_event(LearnerRestarted(2.0, "eu-0", 1, 1, 1.0))
    m.observe_event(LearnerRejoined(5.0, "eu-0", 1, {}, 4.0))
    m.observe_event(LearnerRejoined(6.0, "eu-0", 1, {}, 5.0))  # no failure pending: nothing
    assert objects["detection_seconds"].calls == [(0.5, {"failure": "preemption"})]
    restarts = objects["learner_restarts"].calls
    assert restarts == [(1.0, {"learner": "eu-0", "failure": "preemption"})]
    assert objects["recovery_seconds"].calls == [(4.0, {"failure": "preemption"})]


def test_metrics_are_no_ops_without_ray():
    m = Metrics.create(True, "run")
    assert not m.enabled
    m.learner_up("a", True)  # nothing to record to, nothing raised
