"""Watching a run on a local Ray with its dashboard: every series the Grafana dashboard queries
is exported with the run's name and moves, the actors carry readable names, and the run leaves
its report behind."""

from __future__ import annotations

import re
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from ray_diloco.config import load_config
from ray_diloco.observe.grafana import series
from ray_diloco.observe.run_report import REPORT_FILES
from tests.cluster_helpers import free_port, patient_node_start, prepare_ray_env

pytestmark = pytest.mark.ray

TINY = Path(__file__).resolve().parents[1] / "fixtures" / "tiny_train.yaml"
SAMPLE = re.compile(r"^(ray_diloco_[a-z_]+)\{([^}]*)\} (\S+)$")
# Gauges that hold one value while the run is healthy: uptime is 1 for as long as the global
# model keeps advancing (here, through b's restart too), so it must be exported as a fraction,
# not move.
STEADY = {"ray_diloco_uptime"}


class DashboardRay(NamedTuple):
    metrics_url: str
    dashboard_url: str


@pytest.fixture(scope="module")
def ray_with_dashboard() -> Iterator[DashboardRay]:
    # As tests/ray/conftest.py's ray_local, plus the dashboard: the state API (actor names)
    # needs it.
    prepare_ray_env()
    import ray

    from ray_diloco.runtime.driver import ONE_NODE_HEALTH_CHECKS

    if ray.is_initialized():
        ray.shutdown()
    port = free_port()
    with patient_node_start(minimal_agent=False):  # a busy machine registers nodes slowly
        context = ray.init(
            address="local",
            num_cpus=4,
            object_store_memory=200 * 10**6,
            include_dashboard=True,
            dashboard_port=free_port(),
            namespace="diloco-test-monitoring",
            _metrics_export_port=port,
            _system_config={"metrics_report_interval_ms": 1000, **ONE_NODE_HEALTH_CHECKS},
        )
    try:
        yield DashboardRay(f"http://127.0.0.1:{port}/metrics", f"http://{context.dashboard_url}")
    finally:
        ray.shutdown()


@pytest.mark.timeout(240)
def test_dashboard_series_move_and_actors_are_named(
    ray_with_dashboard: DashboardRay, tmp_path: Path
) -> None:
    # A NaN contribution from `b`: a rejection, a numerical failure, a restart and a rejoin,
    # so the failure panels have something to show. The run stops as soon as every series a
    # panel queries has moved (the budget is only a cap).
    cfg = load_config(
        TINY,
        [
            f"run_dir={tmp_path / 'watched'}",
            "synchronizer.name=sync-watched",
            "diloco.mode=decoupled",
            "token_budget=400000",
            "pace=step_time",
            "step_time_s=0.05",
            "chaos.enabled=true",
            "chaos.schedule=[{at_s: 1, kind: corrupt_nan, target: b}]",
        ],
    )
    from ray.util.state import list_actors

    from ray_diloco.runtime.driver import run_training

    scrapes: list[str] = []
    names: set[str] = set()

    def watch(point: dict[str, Any]) -> None:
        scrapes.append(_scrape(ray_with_dashboard.metrics_url))
        if not names and point["tokens"] > 0:
            alive = list_actors(
                ray_with_dashboard.dashboard_url, filters=[("state", "=", "ALIVE")], detail=True
            )
            names.update(a.repr_name for a in alive)

    def stop_when(sup: dict[str, Any]) -> str | None:
        return "every series moved" if not _unmoved(scrapes, cfg.name) else None

    summary = run_training(cfg, progress=watch, stop_when=stop_when)
    assert summary["stop_reason"] == "every series moved", (
        f"queried by a dashboard panel but never exported or never moved: "
        f"{_unmoved(scrapes, cfg.name)}"
    )
    assert {"Synchronizer(run=tiny)", "Supervisor(run=tiny)"} <= names, names
    learner = re.compile(r"LearnerHost\(a host 0/1 incarnation \d+, local\)")
    assert any(learner.fullmatch(n or "") for n in names), names
    run_dir = Path(cfg.run_dir)
    assert all((run_dir / f).stat().st_size > 0 for f in REPORT_FILES)
    assert "non_finite" in (run_dir / "report.html").read_text()


def _unmoved(scrapes: list[str], run: str) -> list[str]:
    """The series a dashboard panel queries that were not exported with the run's name or
    never moved: counters and histograms still at 0, gauges that took a single value (a
    STEADY gauge: one outside [0, 1])."""
    values = _values(scrapes, run)
    out = []
    for name in sorted(series()):
        if name.endswith("_sum"):  # a sum may stay 0 (staleness): its count must move
            name = name.removesuffix("_sum") + "_count"
        seen = values.get(name, [])
        counted = name.endswith(("_total", "_count", "_bucket"))
        if name in STEADY:
            moved = all(0 <= v <= 1 for v in seen)
        else:
            moved = max(seen, default=0) > 0 if counted else len(set(seen)) >= 2
        if not seen or not moved:
            out.append(name)
    return out


def _values(scrapes: list[str], run: str) -> dict[str, list[float]]:
    """Every sample of every `ray_diloco_*` series of the run, per series name."""
    out: dict[str, list[float]] = defaultdict(list)
    for text in scrapes:
        for line in text.splitlines():
            m = SAMPLE.match(line)
            if m and f'run="{run}"' in m.group(2):
                out[m.group(1)].append(float(m.group(3)))
    return out


def _scrape(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return str(resp.read().decode())
    except OSError:
        return ""
