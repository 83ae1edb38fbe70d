"""Layer: observe (no Ray, no JAX). A finished or running run as its run dir holds it: the
config, the event tape, the progress points and the summary, read once for the report's page
(`run_report.py`) and its pictures (`run_plots.py`)."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray_diloco.control.events import (
    Event,
    HeldoutEvaluated,
    LearnerJoined,
    LearnerRejoined,
    LearnerStateChanged,
    RoundClosed,
    RunStarted,
    SynchronizerLost,
    SynchronizerRestored,
)
from ray_diloco.control.recovery import fault_outcomes
from ray_diloco.control.tape import read_tape


class ReportError(ValueError):
    """The directory holds no run to report on."""


@dataclass(frozen=True)
class RunRecord:
    """Everything the report reads from a run dir."""

    run_dir: Path
    config: dict[str, Any]
    summary: dict[str, Any] | None
    points: list[dict[str, Any]]
    events: list[Event]

    @classmethod
    def load(cls, run_dir: str | Path) -> RunRecord:
        d = Path(run_dir)
        if not (d / "config.json").is_file() or not (d / "events.jsonl").is_file():
            raise ReportError(
                f"{d}: no config.json and events.jsonl; give the run_dir of a "
                "`ray-diloco train` run"
            )
        summary_path, points_path = d / "summary.json", d / "metrics.jsonl"
        points = []
        if points_path.exists():
            for line in points_path.read_text().splitlines():
                try:
                    points.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # the last line of a running driver, half written
        return cls(
            run_dir=d,
            config=json.loads((d / "config.json").read_text()),
            summary=json.loads(summary_path.read_text()) if summary_path.exists() else None,
            points=points,
            events=read_tape(d / "events.jsonl"),
        )

    @property
    def name(self) -> str:
        return str(self.config.get("name", self.run_dir.name))

    @property
    def learner_names(self) -> list[str]:
        """The config's learners, then those that joined the running job (the tape's order)."""
        return list(self.regions)

    @functools.cached_property
    def regions(self) -> dict[str, str]:
        """Region per learner (once: the plots label every learner from it)."""
        out = {lg["name"]: lg.get("region", "local") for lg in self.config.get("learners", [])}
        for e in self.events:
            if isinstance(e, LearnerJoined):
                out.setdefault(e.learner, e.region)
        return out

    def label(self, learner: str) -> str:
        region = self.regions.get(learner)
        return f"{learner} ({region})" if region else learner

    @property
    def end_t(self) -> float:
        """Run time of the end of the run (finished) or of the newest record (running)."""
        if self.summary is not None:
            return float(self.summary["wall_time_s"])
        times = [e.t for e in self.events] + [p["t"] for p in self.points if "t" in p]
        return max(times, default=0.0)

    def state_spans(self) -> dict[str, list[tuple[str, float, float]]]:
        """Per learner: (state, start, end) from the tape; a learner is `starting` from the
        run's start (or the first event naming it), and again at a later RunStarted (a resumed
        run)."""
        open_: dict[str, tuple[str, float]] = {}
        spans: dict[str, list[tuple[str, float, float]]] = {}

        def change(name: str, state: str, t: float) -> None:
            if name in open_:
                before, since = open_[name]
                if t > since:
                    spans.setdefault(name, []).append((before, since, t))
            open_[name] = (state, t)

        events = sorted(self.events, key=lambda e: e.t)
        # Every learner of the config is being started from the run's start on (one that
        # joined later is from its first event on, below).
        start = next((e.t for e in events if isinstance(e, RunStarted)), None)
        if start is not None:
            open_.update(
                {lg["name"]: ("starting", start) for lg in self.config.get("learners", [])}
            )
        for e in events:
            learner = getattr(e, "learner", None)
            if isinstance(learner, str) and learner not in open_:
                open_[learner] = ("starting", e.t)
            if isinstance(e, LearnerStateChanged):
                change(e.learner, e.state.value, e.t)
            elif isinstance(e, RunStarted):
                for name in list(open_):
                    change(name, "starting", e.t)
        for name in list(open_):
            change(name, "", self.end_t)
        return spans

    def synchronizer_down(self) -> list[tuple[float, float]]:
        """Spans from a SynchronizerLost to the first sign of a synchronizer at work again
        (a round closed, an evaluation, a restore), or to the end."""
        spans, lost = [], None
        for e in sorted(self.events, key=lambda e: e.t):
            if isinstance(e, SynchronizerLost) and lost is None:
                lost = e.t
            elif isinstance(e, RoundClosed | HeldoutEvaluated | SynchronizerRestored) and (
                lost is not None and e.t > lost
            ):
                spans.append((lost, e.t))
                lost = None
        if lost is not None:
            spans.append((lost, self.end_t))
        return spans

    def recoveries(self) -> list[float]:
        """When failures were over: restarted learners contributing again, the synchronizer
        restored, and the recovery of every injected fault (`control.recovery`); a degraded
        learner recovering on its own is not one."""
        times = {e.t for e in self.events if isinstance(e, LearnerRejoined | SynchronizerRestored)}
        for o in fault_outcomes(self.events, self.regions):
            if o.recovered_t is not None:
                times.add(o.recovered_t)
        return sorted(times)

    def link_totals(self) -> tuple[dict[str, int], dict[str, int]]:
        """Bytes up and down per learner: the summary's, else the newest progress point's."""
        if self.summary is not None and "bytes_per_link" in self.summary:
            links = self.summary["bytes_per_link"]
            return {n: v["up"] for n, v in links.items()}, {n: v["down"] for n, v in links.items()}
        last: dict[str, Any] = next((p for p in reversed(self.points) if "bytes_up" in p), {})
        return dict(last.get("bytes_up", {})), dict(last.get("bytes_down", {}))
