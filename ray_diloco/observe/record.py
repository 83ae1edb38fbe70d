"""Layer: observe (no Ray, no JAX). A finished or running run as its run dir holds it: the
config, the event tape, the progress points and the summary, read once for the report's page
(`run_report.py`) and its pictures (`run_plots.py`)."""

from __future__ import annotations

import functools
import itertools
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
from ray_diloco.control.goodput import compute_goodput
from ray_diloco.control.recovery import fault_outcomes
from ray_diloco.control.tape import read_tape

UPTIME_WINDOW_S = 10.0  # compute_goodput needs one; the report reads only its goodput here


class ReportError(ValueError):
    """The directory holds no run to report on."""


def grace_on(config: dict[str, Any]) -> bool:
    """Whether rounds of this config wait a grace window after quorum (never in synchronous
    mode, a barrier: algorithm/round_types.py)."""
    d = config.get("diloco", {})
    return (
        d.get("mode") != "synchronous"
        and d.get("grace_fraction", 0) > 0
        and d.get("grace_max_s", 0) > 0
    )


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

    def windowed_goodput(self, window_s: float, samples: int = 120) -> list[tuple[float, float]]:
        """(t, goodput of the `window_s` before t): productive over allocated learner seconds
        in that window alone (`control/goodput.py`'s accounting, differenced), so a fault or a
        boot shows where it happened instead of being averaged into the whole run."""
        end = self.end_t
        if end <= 0:
            return []
        out = []
        for i in range(1, samples + 1):
            t = end * i / samples
            now = compute_goodput(self.events, t, UPTIME_WINDOW_S)
            before = compute_goodput(self.events, max(0.0, t - window_s), UPTIME_WINDOW_S)
            allocated = now.allocated_s - before.allocated_s
            if allocated > 0:
                out.append((t, (now.productive_s - before.productive_s) / allocated))
        return out

    def training_curves(self) -> dict[str, list[dict[str, Any]]]:
        """Per learner, one entry per progress point where its step advanced: run time `t`,
        the run's tokens then (`run_tokens`), its `step`, its own `tokens`, training `loss` and
        `lr` (None where not reported)."""
        out: dict[str, list[dict[str, Any]]] = {}
        for p in self.points:
            for name, ls in (p.get("learners") or {}).items():
                curve = out.setdefault(name, [])
                step = ls.get("step")
                if step is None or (curve and step <= curve[-1]["step"]):
                    continue
                curve.append(
                    {
                        "t": p["t"],
                        "run_tokens": p.get("tokens", 0),
                        "step": step,
                        "tokens": ls.get("tokens", 0),
                        "loss": ls.get("loss"),
                        "lr": ls.get("lr"),
                    }
                )
        return out

    def link_rates(self) -> dict[str, dict[str, list[tuple[float, float]]]]:
        """Per region, per direction ("up", "down"): (t, bits per second) between consecutive
        progress points, summed over the region's learners (they share its link)."""
        pts = [p for p in self.points if "bytes_up" in p and "t" in p]
        out: dict[str, dict[str, list[tuple[float, float]]]] = {}
        for a, b in itertools.pairwise(pts):
            dt = b["t"] - a["t"]
            if dt <= 0:
                continue
            for key, direction in (("bytes_up", "up"), ("bytes_down", "down")):
                by_region: dict[str, float] = {}
                for name, nbytes in b[key].items():
                    # A restarted synchronizer counts from its checkpoint again: no negative rate.
                    moved = max(0, nbytes - a[key].get(name, 0))
                    region = self.regions.get(name, "local")
                    by_region[region] = by_region.get(region, 0.0) + 8 * moved / dt
                for region, rate in by_region.items():
                    series = out.setdefault(region, {"up": [], "down": []})[direction]
                    series.append(((a["t"] + b["t"]) / 2, rate))
        return out

    def link_totals(self) -> tuple[dict[str, int], dict[str, int]]:
        """Bytes up and down per learner: the summary's, else the newest progress point's."""
        if self.summary is not None and "bytes_per_link" in self.summary:
            links = self.summary["bytes_per_link"]
            return {n: v["up"] for n, v in links.items()}, {n: v["down"] for n, v in links.items()}
        last: dict[str, Any] = next((p for p in reversed(self.points) if "bytes_up" in p), {})
        return dict(last.get("bytes_up", {})), dict(last.get("bytes_down", {}))
