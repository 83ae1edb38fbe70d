"""Layer: observe. Turning run summaries into what people read (progress lines, tables, files).

No Ray, no JAX: it formats dicts produced by `algorithm/simulate.py` and the Ray driver.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any


def human(n: float) -> str:
    """1234567 -> '1.23M' (tokens, bytes)."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.3g}"


def duration(seconds: float) -> str:
    """75 -> '1:15', 3725 -> '1:02:05' (elapsed times, ETAs)."""
    s = max(0, round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


# How the displays name a learner's state: the words an operator uses.
STATE_WORDS = {"blocked": "waiting", "dead": "down", "gave_up": "gave up"}


def state_word(state: str) -> str:
    return STATE_WORDS.get(state, state)


def progress_line(point: Mapping[str, Any], budget: int) -> str:
    """One plain line of a progress point (a Ray run's or a reference run's)."""
    parts = []
    if "t" in point:
        parts.append(f"t={duration(point['t'])}")
    if budget:
        parts.append(f"{min(100, 100 * point['tokens'] / budget):.0f}%")
    parts.append(f"tokens {human(point['tokens'])}/{human(budget)}")
    if point.get("tokens_per_s"):
        parts.append(f"{human(point['tokens_per_s'])} tok/s")
    if point.get("eta_s") is not None:
        parts.append(f"ETA {duration(point['eta_s'])}")
    if point.get("heldout_loss") is not None:
        parts.append(f"heldout {point['heldout_loss']:.4f}")
    if "rounds" in point:
        parts.append(f"rounds {point['rounds']}")
    if point.get("contributors") is not None:
        parts.append(f"contributors/round {point['contributors']:.2f}")
    if point.get("goodput") is not None:
        parts.append(f"goodput {point['goodput']:.3f}")
    if point.get("uptime") is not None:
        parts.append(f"uptime {point['uptime']:.3f}")
    if point.get("learners"):
        parts.append("learners " + learner_states(point["learners"]))
    restarts = {k: v for k, v in (point.get("restarts") or {}).items() if v}
    if restarts:
        parts.append("restarts " + " ".join(f"{k}:{v}" for k, v in sorted(restarts.items())))
    recovery = {k: v for k, v in (point.get("recovery") or {}).items() if v is not None}
    if recovery:
        shown = " ".join(f"{k}:{v:.1f}s" for k, v in sorted(recovery.items()))
        parts.append(f"recovered in [{shown}]")
    return "  ".join(parts)


def learner_states(learners: Mapping[str, Mapping[str, Any]]) -> str:
    """'training 3, down 1 (eu-0)': how many learners are in each state, naming those that
    are not training."""
    by_state: dict[str, list[str]] = {}
    for name, ls in sorted(learners.items()):
        by_state.setdefault(ls["state"], []).append(name)
    parts = []
    for state, names in sorted(by_state.items(), key=lambda kv: (kv[0] != "training", kv[0])):
        named = "" if state == "training" else f" ({', '.join(names)})"
        parts.append(f"{state_word(state)} {len(names)}{named}")
    return ", ".join(parts)


def machine() -> str:
    """The machine a result was measured on, as results files and reports name it."""
    return f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}"


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def _tokens(s: Mapping[str, Any]) -> str:
    budget = f" of {human(s['token_budget'])}" if s.get("token_budget") is not None else ""
    return f"{human(s['tokens'])}{budget} tokens"


def _bytes(s: Mapping[str, Any]) -> str:
    per = f" ({s['bytes_per_token']:.1f} B/token)" if s.get("bytes_per_token") is not None else ""
    return f"{human(s['bytes_total'])}B{per}"


def _rejected(s: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(s["rejected"].items())) or "none"


def _lowest_share(s: Mapping[str, Any]) -> str:
    shares = {
        n: ls["merged_share"]
        for n, ls in (s.get("learners") or {}).items()
        if ls.get("merged_share") is not None
    }
    if len(shares) < 2:
        return ""
    name = min(shares, key=shares.__getitem__)
    return f" (lowest: {name} {100 * shares[name]:.1f}%)"


def _final_rounds(s: Mapping[str, Any]) -> str:
    f = s["final_rounds"]
    return (
        f"{f['rounds']:,}; at the budget held-out {f['heldout_loss_before']:.4f}, "
        f"{100 * f['merged_share_before']:.1f}% merged"
    )


# (key, measure, the value with its unit): one row each where the key has a figure.
SUMMARY_ROWS: tuple[tuple[str, str, Callable[[Mapping[str, Any]], str]], ...] = (
    ("mode", "mode", lambda s: str(s["mode"])),
    ("tokens", "tokens trained", _tokens),
    (
        "heldout_loss",
        "held-out loss (global params)",
        lambda s: f"{s['heldout_loss']:.4f} nats/token",
    ),
    ("rounds", "rounds (merges)", lambda s: f"{s['rounds']:,}"),
    (
        "mean_contributors",
        "mean contributors per round",
        lambda s: f"{s['mean_contributors']:.2f} learners",
    ),
    ("bytes_total", "bytes moved (up + down)", _bytes),
    (
        "dp_bytes_per_token",
        "data-parallel would move",
        lambda s: f"{s['dp_bytes_per_token']:.1f} B/token",
    ),
    ("goodput", "goodput", lambda s: f"{100 * s['goodput']:.1f}%"),
    (
        "goodput_merged",
        "goodput, merged work only",
        lambda s: f"{100 * s['goodput_merged']:.1f}%",
    ),
    (
        "merged_share",
        "trained tokens merged",
        lambda s: f"{100 * s['merged_share']:.1f}%" + _lowest_share(s),
    ),
    ("final_rounds", "final rounds (unsent work)", _final_rounds),
    ("uptime", "uptime", lambda s: f"{100 * s['uptime']:.1f}%"),
    ("tokens_per_s", "throughput (whole run)", lambda s: f"{human(s['tokens_per_s'])} tokens/s"),
    (
        "wall_time_s",
        "wall time",
        lambda s: f"{duration(s['wall_time_s'])} ({s['wall_time_s']:.1f} s)",
    ),
    ("virtual_time_s", "virtual time", lambda s: f"{s['virtual_time_s']:.1f} s"),
    ("num_failures", "failures detected", lambda s: str(s["num_failures"])),
    ("rejected", "rejected contributions", _rejected),
    ("stop_reason", "stopped because", lambda s: str(s["stop_reason"])),
)


def summary_rows(summary: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The run's key figures as (measure, value with its unit): what the terminal prints at the
    end of a run (`summary_table`) and the run report shows, the same rows in the same order.
    From a run's summary (a Ray run's or a reference run's) or, for a run still going, from
    its newest progress point (`observe/run_report.py` maps it to these keys); a row whose
    figure is missing is left out."""
    return [(m, show(summary)) for key, m, show in SUMMARY_ROWS if summary.get(key) is not None]


def summary_table(summary: Mapping[str, Any]) -> str:
    rows = [{"measure": m, "value": v} for m, v in summary_rows(summary)]
    return markdown_table(rows, ("measure", "value"))


def write_json(path: Path, obj: Any) -> None:
    """Write atomically (temp file + rename) so a crash never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str))
    tmp.replace(path)
