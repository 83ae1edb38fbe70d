"""Layer: observe. The run report (no Ray, no JAX): `report.html` and its pictures in the run dir.

Written by the driver at the end of every run and by `ray-diloco report RUN_DIR` for a
finished or a running one. It reads only the run dir: `config.json`, the event tape
`events.jsonl`, the progress points `metrics.jsonl` and, once the run finished, `summary.json`.
`report.html` is one self-contained file (pictures embedded) with the key figures, the pictures
of `observe/run_plots.py`, each learner's time per state and every injected fault's detection and
recovery; the pictures are also written as PNGs next to it.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

from ray_diloco.control.recovery import fault_outcomes
from ray_diloco.observe.record import RunRecord, grace_on
from ray_diloco.observe.report import duration, state_word, summary_rows
from ray_diloco.observe.telemetry import TENSORBOARD_DIR

PICTURES = ("training.png", "loss_timeline.png", "rounds.png", "goodput.png", "links.png")
REPORT_FILES = ("report.html", *PICTURES)
# Everything a run writes in its run dir but its checkpoints and compilation cache.
RUN_FILES = (
    "summary.json",
    "metrics.jsonl",
    "events.jsonl",
    "config.json",
    TENSORBOARD_DIR,
    "wandb",  # an offline W&B run (metrics.wandb.mode)
    *REPORT_FILES,
)
CAPTIONS = {
    "training.png": "Each learner's training loss (its last reported step at every poll) and "
    "the global parameters' held-out loss, against tokens and against run time; below, each "
    "learner's inner learning rate and the run's throughput.",
    "loss_timeline.png": "Held-out loss of the global parameters against run time, with "
    "injected faults, detected failures and recoveries; below, each learner's state over time.",
    "rounds.png": "Contributions merged per round; with a grace window on, the window each "
    "round allowed after reaching quorum against the time it actually waited.",
    "goodput.png": "Goodput (productive over allocated learner time) over a sliding window and "
    "over the run so far, and uptime (share of the run in which the global model advanced).",
    "links.png": "The rate each region's link carried (its learners together) up and down, "
    "against the emulated link's capacity; the bytes each learner moved in all.",
}


def write_report(run_dir: str | Path) -> Path:
    """Write report.html and the PNGs into `run_dir`; returns the path of report.html."""
    from ray_diloco.observe.run_plots import FIGURES

    rec = RunRecord.load(run_dir)
    pngs: dict[str, bytes] = {}
    for name, draw in FIGURES.items():
        buf = io.BytesIO()
        draw(rec).savefig(buf, format="png", dpi=110)
        pngs[name] = buf.getvalue()
        (rec.run_dir / name).write_bytes(pngs[name])
    path = rec.run_dir / "report.html"
    tmp = path.with_suffix(".html.tmp")
    tmp.write_text(render_html(rec, pngs))
    tmp.replace(path)
    return path


def render_html(rec: RunRecord, pngs: dict[str, bytes]) -> str:
    sections = [
        f"<h1>Run {_e(rec.name)}</h1>",
        f"<p class='status'>{_e(_status(rec))}</p>",
        _table(["measure", "value"], _key_figures(rec)),
    ]
    for name, data in pngs.items():
        src = "data:image/png;base64," + base64.b64encode(data).decode()
        sections.append(
            f"<figure><img src='{src}' alt='{_e(name)}'>"
            f"<figcaption>{_e(CAPTIONS.get(name, ''))} ({_e(name)})</figcaption></figure>"
        )
    sections += ["<h2>Learners</h2>", _learners(rec), "<h2>Injected faults</h2>", _faults(rec)]
    sections += ["<h2>Config</h2>", _config(rec)]
    return _PAGE.format(title=_e(f"ray_diloco run {rec.name}"), body="\n".join(sections))


def _status(rec: RunRecord) -> str:
    where = f"run dir {rec.run_dir.resolve()}"
    if rec.summary is not None:
        reason = rec.summary.get("stop_reason", "finished")
        return f"Finished after {duration(rec.end_t)} ({reason}); {where}."
    return (
        f"Not finished: as of {duration(rec.end_t)} of run time (running, or its driver "
        f"stopped); {where}."
    )


def _key_figures(rec: RunRecord) -> list[list[str]]:
    """The rows the terminal printed (`summary_rows`): from the summary of a finished run,
    else from its newest progress point."""
    if rec.summary is not None:
        now = {"token_budget": rec.config["token_budget"], **rec.summary}
    else:
        last = rec.points[-1] if rec.points else {}
        keys = ("tokens", "heldout_loss", "rounds", "goodput", "uptime")
        now = {k: last.get(k) for k in keys} | {
            "mean_contributors": last.get("contributors"),
            "token_budget": rec.config["token_budget"],
            "wall_time_s": rec.end_t,
        }
    return [list(row) for row in summary_rows(now)]


def _learners(rec: RunRecord) -> str:
    states = ["starting", "compiling", "training", "blocked", "restarting", "dead"]
    spans = rec.state_spans()
    last = (rec.points[-1] if rec.points else {}).get("learners", {})
    rows = []
    for name in rec.learner_names:
        seconds = {s: 0.0 for s in states}
        for state, start, end in spans.get(name, []):
            if state in seconds:
                seconds[state] += end - start
        now = last.get(name, {})
        rows.append(
            [
                rec.label(name),
                state_word(now.get("state", "–")),
                str(now.get("restarts", 0)),
                str(now.get("merged", "–")),
                *(f"{seconds[s]:.1f}" for s in states),
            ]
        )
    head = ["learner", "state", "restarts", "merged", *(f"{state_word(s)} (s)" for s in states)]
    return _table(head, rows)


def _config(rec: RunRecord) -> str:
    """The method's knobs and every learner at a glance, then the whole config.json."""
    c = rec.config
    d, outer = c.get("diloco", {}), c.get("outer", {})
    grace = (
        f"{d.get('grace_fraction')} of the round, at most {d.get('grace_max_s')} s"
        if grace_on(c)
        else "off"
    )
    rows = [
        ["task", str(c.get("task"))],
        ["mode", str(d.get("mode"))],
        ["H (inner steps per sync of a fragment)", str(d.get("sync_every"))],
        ["P (fragments)", str(d.get("num_fragments"))],
        ["K (quorum)", str(d.get("quorum_min"))],
        ["grace window", grace],
        ["wire (up / down)", f"{d.get('wire_dtype')} / {d.get('publish_delta') or 'full'}"],
        ["inner lr (peak)", str(c.get("inner", {}).get("lr"))],
        ["outer lr, momentum", f"{outer.get('lr')}, {outer.get('momentum')}"],
        ["token budget", f"{c.get('token_budget'):,} tokens"],
    ]
    links = c.get("links", {})
    learners = [
        [
            lg["name"],
            lg.get("region", "local"),
            str(lg.get("batch_size")),
            str(lg.get("speed", 1.0)),
            _link(links, lg.get("region", "local")),
        ]
        for lg in c.get("learners", [])
    ]
    whole = json.dumps(c, indent=2, sort_keys=True)
    return (
        _table(["setting", "value"], rows)
        + _table(["learner", "region", "batch size", "speed", "emulated link"], learners)
        + f"<details><summary>config.json</summary><pre>{_e(whole)}</pre></details>"
    )


def _link(links: dict[str, Any], region: str) -> str:
    return f"{links[region]['bandwidth_gbps']} Gbit/s" if region in links else "–"


def _faults(rec: RunRecord) -> str:
    outcomes = fault_outcomes(rec.events, rec.regions)
    if not outcomes:
        return "<p>none</p>"
    rows = [
        [
            o.fault,
            o.target or "–",
            f"{o.t:.1f}",
            _f(o.detection_s, "{:.2f}"),
            _f(o.recovery_s, "{:.2f}"),
        ]
        for o in outcomes
    ]
    return _table(["fault", "target", "at (s)", "detected after (s)", "recovered after (s)"], rows)


def _table(head: list[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th>{_e(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def _f(value: float | None, fmt: str = "{:.3f}") -> str:
    return "–" if value is None else fmt.format(value)


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1150px; color: #222; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1.5em; }}
th, td {{ border-bottom: 1px solid #ddd; padding: 0.25em 0.8em; text-align: right; }}
th:first-child, td:first-child {{ text-align: left; }}
figure {{ margin: 1.5em 0; }} img {{ max-width: 100%; }}
figcaption {{ color: #555; font-size: 0.9em; }} .status {{ color: #555; }}
pre {{ background: #f6f6f6; padding: 0.8em; font-size: 0.8em; max-height: 30em; overflow: auto; }}
</style></head>
<body>
{body}
</body></html>
"""
