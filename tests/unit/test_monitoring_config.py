"""The Grafana dashboard in the repo is the generator's output and queries only series that
ray_diloco exports; every legend names the run and every query keeps its label; rates use
Grafana's $__rate_interval; no panel mixes units; event-driven metrics are recorded by failure
kind."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ray_diloco.control.events import (
    FailureDetected,
    FailureKind,
    LearnerRejoined,
    LearnerRestarted,
)
from ray_diloco.observe import grafana
from ray_diloco.runtime.metrics import PREFIX, SPECS, Metrics

SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


ROOT = Path(__file__).resolve().parents[2]
AGGREGATION = re.compile(r"\b(sum|max|min|avg|count)\s*(by\s*\(([^)]*)\))?\s*\(")


def test_the_committed_dashboard_is_up_to_date():
    committed = grafana.OUT.read_text()
    assert committed == grafana.render(), "run `python -m ray_diloco.observe.grafana` and commit"
    # the copy README tells users to install: `... --out monitoring/grafana/ray_diloco.json`
    assert (ROOT / "monitoring" / "grafana" / "ray_diloco.json").read_text() == committed
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


def test_every_panel_legend_names_the_run_its_query_keeps():
    dashboard = grafana.dashboard()
    (run,) = [v for v in dashboard["templating"]["list"] if v["name"] == "run"]
    assert run["multi"]  # several runs on one panel: only the legend tells them apart
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            assert "{{run}}" in target["legendFormat"], (panel["title"], target["legendFormat"])
            for op, by, labels in AGGREGATION.findall(target["expr"]):
                kept = {label.strip() for label in labels.split(",")}
                assert by and "run" in kept, (panel["title"], op, target["expr"])


def test_rates_use_grafanas_rate_interval():
    text = grafana.render()
    assert "$window" not in text
    assert all(v["name"] != "window" for v in grafana.dashboard()["templating"]["list"])
    windows = re.findall(
        r"\[([^\]]+)\]", " ".join(t.expr for p in grafana.PANELS for t in p.targets)
    )
    assert windows and set(windows) == {"$__rate_interval"}


def test_no_panel_mixes_units_and_tokens_per_second_have_one():
    for panel in grafana.PANELS:
        assert len({t.unit for t in panel.targets}) == 1, panel.title
    (tokens,) = [p for p in grafana.PANELS if "tokens_total" in p.targets[0].expr]
    assert tokens.unit == "count:tokens/s"
    assert all(p["fieldConfig"]["defaults"]["unit"] != "" for p in grafana.dashboard()["panels"])


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
