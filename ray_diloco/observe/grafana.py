"""Layer: observe. The Grafana dashboard of a run, built from panel dataclasses (no Ray, no JAX).

As Ray builds its own dashboards (`ray/dashboard/modules/metrics/dashboards`: `Panel`,
`Target`, assembled into JSON), this module describes our panels as data with PromQL on the
`ray_diloco_*` series of `runtime/metrics.py` and writes `monitoring/grafana/ray_diloco.json`:

    python -m ray_diloco.observe.grafana   # rewrite the JSON (a unit test checks it is current)

Every query filters on the run's name (`run`, a multi-select dashboard variable), keeps the
`run` label through its aggregation and names the run in its legend, so several runs on one
panel stay apart; rates use Grafana's `$__rate_interval`; a panel's queries share one unit. The
datasource is the variable `${datasource}`, as in Ray's dashboards, so the file loads next to
them in the Grafana that Ray provisions (docs/observability.md).
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[1] / "monitoring" / "grafana" / "ray_diloco.json"
UID = "rayDilocoDashboard"
RUN = 'run=~"$run"'
# Grafana's own rate window: at least four scrape intervals, growing with the time range.
WINDOW = "$__rate_interval"
PERCENT, LOSS, TOKENS_PER_S = "percentunit", "none", "count:tokens/s"
SERIES = re.compile(r"\bray_diloco_[a-z_]+\b")


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str  # names the run ({{run}}): the run variable is multi-select
    unit: str  # Grafana's unit id of what the query measures


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    targets: list[Target]
    kind: str = "timeseries"  # or "stat"
    width: int = 12
    height: int = 8
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def unit(self) -> str:
        """The one unit of the panel's axis; a panel never mixes two."""
        units = {t.unit for t in self.targets}
        if len(units) != 1:
            raise ValueError(f"panel {self.title!r} mixes units {sorted(units)} on one axis")
        return units.pop()


def _by(*labels: str) -> str:
    """The labels a query keeps: always the run's, so the legend can name it."""
    return ", ".join(("run", *labels))


def _rate(series: str, *by: str) -> str:
    return f"sum by ({_by(*by)})(rate({series}{{{RUN}}}[{WINDOW}]))"


def _mean(histogram: str, *by: str) -> str:
    """Mean observation over the window: rate of the sum over rate of the count."""
    return f"{_rate(histogram + '_sum', *by)} / {_rate(histogram + '_count', *by)}"


def _quantile(q: float, histogram: str, *by: str) -> str:
    return f"histogram_quantile({q}, {_rate(histogram + '_bucket', 'le', *by)})"


def _cumulative_mean(histogram: str, by: str) -> str:
    """Mean over the whole run: failures are rare, a rate window would mostly show nothing."""
    keys = _by(by)
    return (
        f"sum by ({keys})({histogram}_sum{{{RUN}}}) / sum by ({keys})({histogram}_count{{{RUN}}})"
    )


PANELS = [
    Panel(
        "Learners up",
        "Learners compiling, training or waiting for fragments (the supervisor's view).",
        [Target(f"sum by ({_by()})(ray_diloco_learner_up{{{RUN}}})", "{{run}}", "none")],
        kind="stat",
        width=4,
    ),
    Panel(
        "Learner up (1) or down (0)",
        "Which learner is down, and since when.",
        [
            Target(
                f"max by ({_by('learner')})(ray_diloco_learner_up{{{RUN}}})",
                "{{run}} {{learner}}",
                "none",
            )
        ],
        width=8,
        options={"min": 0, "max": 1},
    ),
    Panel(
        "Goodput, uptime and merged work",
        "Goodput: productive over allocated learner time so far. Uptime: share of the run in "
        "which the global model advanced (a round closed). Merged: the share of each learner's "
        "trained tokens whose work reached the global model (mean over synchronizer shards).",
        [
            Target(f"max by ({_by()})(ray_diloco_goodput{{{RUN}}})", "{{run}} goodput", PERCENT),
            Target(f"max by ({_by()})(ray_diloco_uptime{{{RUN}}})", "{{run}} uptime", PERCENT),
            Target(
                f"avg by ({_by('learner')})(ray_diloco_merged_share{{{RUN}}})",
                "{{run}} merged {{learner}}",
                PERCENT,
            ),
        ],
        options={"min": 0, "max": 1},
    ),
    Panel(
        "Loss",
        "Held-out loss of the global parameters and each learner's training loss.",
        [
            Target(
                f"max by ({_by()})(ray_diloco_heldout_loss{{{RUN}}})",
                "{{run}} held-out (global)",
                LOSS,
            ),
            Target(
                f"max by ({_by('learner')})(ray_diloco_training_loss{{{RUN}}})",
                "{{run}} train {{learner}}",
                LOSS,
            ),
        ],
    ),
    Panel(
        "Tokens per second",
        "Training tokens consumed per second, in all and per learner.",
        [
            Target(_rate("ray_diloco_tokens_total"), "{{run}} all learners", TOKENS_PER_S),
            Target(
                _rate("ray_diloco_tokens_total", "learner"), "{{run}} {{learner}}", TOKENS_PER_S
            ),
        ],
    ),
    Panel(
        "Outer rounds per minute",
        "Outer rounds closed per minute, all fragments together.",
        [
            Target(
                "60 * " + _rate("ray_diloco_outer_rounds_total"),
                "{{run}}",
                "count:rounds/min",
            )
        ],
        width=8,
    ),
    Panel(
        "Contributors per round",
        "Contributions merged per round, on average over the window.",
        [
            Target(
                _mean("ray_diloco_contributors_per_round"),
                "{{run}}",
                "count:contributors",
            )
        ],
        width=8,
    ),
    Panel(
        "Stale contributions",
        "Share of the merged contributions whose base was an older version of the fragment.",
        [
            Target(
                f"1 - sum by ({_by()})(rate(ray_diloco_staleness_versions_bucket"
                f'{{{RUN}, le="0.5"}}[{WINDOW}])) / {_rate("ray_diloco_staleness_versions_count")}',
                "{{run}}",
                PERCENT,
            )
        ],
        width=8,
        options={"min": 0, "max": 1},
    ),
    Panel(
        "Grace windows",
        "Grace window a round allowed after reaching quorum.",
        [
            Target(_quantile(0.5, "ray_diloco_grace_window_seconds"), "{{run}} p50", "s"),
            Target(_quantile(0.9, "ray_diloco_grace_window_seconds"), "{{run}} p90", "s"),
        ],
    ),
    Panel(
        "Rejected contributions",
        "Contributions refused per minute, by reason (stale, non-finite, norm outlier, "
        "fenced incarnation, ...).",
        [
            Target(
                "60 * " + _rate("ray_diloco_contributions_rejected_total", "reason"),
                "{{run}} {{reason}}",
                "count:rejected/min",
            )
        ],
    ),
    Panel(
        "Restarts by failure kind",
        "Learner restarts since the run started, by the failure that caused them.",
        [
            Target(
                f"sum by ({_by('failure')})(ray_diloco_learner_restarts_total{{{RUN}}})",
                "{{run}} {{failure}}",
                "count:restarts",
            )
        ],
    ),
    Panel(
        "Detection and recovery",
        "Mean seconds from a failure to its detection, and from detection until the "
        "restarted learner contributed again, by failure kind, over the run (Ray exports "
        "histogram sums from bucket midpoints: within about 20%).",
        [
            Target(
                _cumulative_mean("ray_diloco_detection_seconds", "failure"),
                "{{run}} detection {{failure}}",
                "s",
            ),
            Target(
                _cumulative_mean("ray_diloco_recovery_seconds", "failure"),
                "{{run}} recovery {{failure}}",
                "s",
            ),
        ],
    ),
    Panel(
        "Link bytes per second",
        "Bytes per second between each learner and the synchronizer: contributions up, "
        "published fragments down.",
        [
            Target(
                _rate("ray_diloco_link_bytes_total", "learner", "region", "direction"),
                "{{run}} {{learner}} ({{region}}) {{direction}}",
                "Bps",
            )
        ],
    ),
    Panel(
        "Inner step time",
        "Median wall time of one inner step, per learner.",
        [
            Target(
                _quantile(0.5, "ray_diloco_inner_step_seconds", "learner"),
                "{{run}} {{learner}}",
                "s",
            )
        ],
    ),
    Panel(
        "Synchronizer merge time",
        "Wall time of one merge and outer step.",
        [
            Target(_quantile(0.5, "ray_diloco_merge_seconds"), "{{run}} p50", "s"),
            Target(_quantile(0.9, "ray_diloco_merge_seconds"), "{{run}} p90", "s"),
        ],
    ),
    Panel(
        "Synchronizer memory",
        "Resident memory of the synchronizer process.",
        [
            Target(
                f"max by ({_by()})(ray_diloco_synchronizer_memory_bytes{{{RUN}}})",
                "{{run}} resident",
                "bytes",
            )
        ],
    ),
]


def series(panels: list[Panel] = PANELS) -> set[str]:
    """Every exported series name a panel queries (`ray_diloco_tokens_total`, ...)."""
    return {name for p in panels for t in p.targets for name in SERIES.findall(t.expr)}


def dashboard(panels: list[Panel] = PANELS) -> dict[str, Any]:
    out, x, y, row_h = [], 0, 0, 0
    for i, p in enumerate(panels):
        if x + p.width > 24:
            x, y, row_h = 0, y + row_h, 0
        out.append(_panel(i + 1, p, {"x": x, "y": y, "w": p.width, "h": p.height}))
        x, row_h = x + p.width, max(row_h, p.height)
    return {
        "title": "ray_diloco",
        "uid": UID,
        "description": (
            "Decoupled DiLoCo runs of ray_diloco (generated by ray_diloco/observe/grafana.py)"
        ),
        "tags": ["ray_diloco"],
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "graphTooltip": 1,
        "templating": {"list": _variables()},
        "panels": out,
    }


def _panel(pid: int, p: Panel, pos: dict[str, int]) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": p.unit, **p.options}
    if p.kind == "timeseries":
        defaults["custom"] = {"lineWidth": 2, "fillOpacity": 0, "showPoints": "never"}
    return {
        "id": pid,
        "type": p.kind,
        "title": p.title,
        "description": p.description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": pos,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "expr": t.expr,
                "legendFormat": t.legend,
                "refId": chr(ord("A") + i),
            }
            for i, t in enumerate(p.targets)
        ],
    }


def _variables() -> list[dict[str, Any]]:
    return [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus"},
        {
            "name": "run",
            "label": "Run",
            "type": "query",
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": {"query": "label_values(ray_diloco_tokens_total, run)", "refId": "run"},
            "refresh": 2,
            "includeAll": True,
            "multi": True,
            "allValue": ".*",
        },
    ]


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write the ray_diloco Grafana dashboard")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render())
    print(f"wrote {args.out} ({len(PANELS)} panels over {len(series())} series)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
