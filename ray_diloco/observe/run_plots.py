"""Layer: observe. The run report's pictures (matplotlib, no Ray, no JAX).

Each function draws one figure from a `RunRecord` (`observe/run_report.py`): the event tape, the
progress points of `metrics.jsonl` and, for a finished run, its summary. Time is the run clock
(seconds since the run started, as on the tape). Figures are `matplotlib.figure.Figure`s made
without pyplot, so drawing touches no global state and needs no display.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, MaxNLocator

from ray_diloco.control.events import (
    FailureDetected,
    FaultInjected,
    HeldoutEvaluated,
    LearnerRejoined,
    RoundClosed,
    SynchronizerLost,
)
from ray_diloco.observe.record import grace_on
from ray_diloco.observe.report import human

if TYPE_CHECKING:
    from ray_diloco.observe.record import RunRecord

TIME_LABEL = "run time (s since the run started)"
TOKENS_LABEL = "tokens trained (the whole run's)"
TOKENS = FuncFormatter(lambda x, _: human(x))
# Learner states on the timeline, in legend order, with the words the live display uses.
STATE_COLORS = {
    "starting": ("#c7c7c7", "starting"),
    "compiling": ("#f2c14e", "compiling"),
    "training": ("#4c9f50", "training"),
    "blocked": ("#7fb7e6", "waiting for fragments"),
    "restarting": ("#b07cc6", "restarting"),
    "dead": ("#d1495b", "down"),
    "gave_up": ("#3b3b3b", "gave up"),
    "finished": ("#ececec", "finished"),
    "left": ("#dfe6ee", "left the run"),
}
FAULT, FAILURE, RECOVERY = "#d1495b", "#e07b39", "#2e7d32"


def loss_and_timeline(rec: RunRecord) -> Figure:
    """Held-out loss against run time with fault, failure and recovery markers, above each
    learner's state over time (from the event tape)."""
    names = rec.learner_names
    fig = Figure(figsize=(10, 3.6 + 0.45 * len(names)), layout="constrained")
    loss_ax, tl_ax = fig.subplots(2, 1, sharex=True, height_ratios=[3, 0.8 + 0.45 * len(names)])
    _loss(loss_ax, rec)
    _timeline(tl_ax, rec, names)
    tl_ax.set_xlabel(TIME_LABEL)
    tl_ax.set_xlim(0, max(rec.end_t, 1.0))
    fig.suptitle(f"run {rec.name}: held-out loss and learner timeline")
    return fig


def _loss(ax: Axes, rec: RunRecord) -> None:
    evals = [(e.t, e.loss) for e in rec.events if isinstance(e, HeldoutEvaluated)]
    if rec.summary is not None and rec.summary.get("heldout_loss") is not None:
        evals.append((rec.end_t, rec.summary["heldout_loss"]))  # the driver's last evaluation
    if not evals:
        _empty(ax, "no evaluation yet")
    else:
        ts, losses = zip(*sorted(evals), strict=True)
        ax.plot(ts, losses, "o-", color="#1f4e79", markersize=3, label="held-out loss")
    ax.set_ylabel("held-out loss (nats/token)")
    handles = [Line2D([], [], color="#1f4e79", marker="o", markersize=3, label="held-out loss")]
    handles += _event_lines(ax, rec)
    _outside_legend(ax, handles)
    ax.grid(alpha=0.3)


def _event_lines(ax: Axes, rec: RunRecord) -> list[Line2D]:
    """Vertical lines at faults, detected failures and recoveries; their legend entries."""
    kinds: tuple[tuple[list[float], str, Any, str], ...] = (
        ([e.t for e in rec.events if isinstance(e, FaultInjected)], FAULT, "--", "fault injected"),
        (
            [e.t for e in rec.events if isinstance(e, FailureDetected | SynchronizerLost)],
            FAILURE,
            "-",
            "failure detected",
        ),
        (rec.recoveries(), RECOVERY, ":", "recovered"),
    )
    handles = []
    for ts, color, style, label in kinds:
        for t in ts:
            ax.axvline(t, color=color, linestyle=style, linewidth=1, alpha=0.8)
        if ts:
            handles.append(Line2D([], [], color=color, linestyle=style, label=label))
    return handles


def _timeline(ax: Axes, rec: RunRecord, names: Sequence[str]) -> None:
    rows = list(names)
    spans = rec.state_spans()
    for y, name in enumerate(rows):
        for state, start, end in spans.get(name, []):
            color = STATE_COLORS.get(state, ("#ffffff", state))[0]
            ax.broken_barh([(start, end - start)], (y - 0.4, 0.8), color=color)
    down = rec.synchronizer_down()
    if down:
        rows.append("synchronizer")
        ax.broken_barh([(a, b - a) for a, b in down], (len(rows) - 1.4, 0.8), color="#d1495b")
    row = {n: i for i, n in enumerate(rows)}
    fail = [(e.t, row[e.learner]) for e in rec.events if isinstance(e, FailureDetected)]
    back = [(e.t, row[e.learner]) for e in rec.events if isinstance(e, LearnerRejoined)]
    for points, marker, color in ((fail, "x", FAULT), (back, "^", RECOVERY)):
        if points:
            xs, ys = zip(*points, strict=True)
            ax.scatter(xs, ys, marker=marker, color=color, zorder=3, s=40)
    ax.set_yticks(range(len(rows)), [rec.label(n) for n in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    seen = {s for spans_ in spans.values() for s, _, _ in spans_}
    handles: list[Any] = [
        Patch(color=c, label=w) for s, (c, w) in STATE_COLORS.items() if s in seen
    ]
    if down:
        handles.append(Patch(color="#d1495b", label="synchronizer unanswered"))
    if fail:
        handles.append(Line2D([], [], marker="x", color=FAULT, ls="", label="failure detected"))
    if back:
        handles.append(Line2D([], [], marker="^", color=RECOVERY, ls="", label="rejoined"))
    ax.figure.legend(
        handles=handles,
        loc="outside lower center",
        ncol=min(len(handles), 6),
        fontsize="small",
        frameon=False,
    )
    ax.grid(axis="x", alpha=0.3)


def training(rec: RunRecord) -> Figure:
    """Every learner's training loss and the global parameters' held-out loss against tokens
    and against run time; below, each learner's learning rate against its tokens and the
    run's throughput against time (from the progress points and the event tape)."""
    fig = Figure(figsize=(11, 7), layout="constrained")
    (by_tokens, by_time), (lr_ax, rate_ax) = fig.subplots(2, 2, height_ratios=[2.2, 1])
    names = rec.learner_names
    colors = {n: f"C{i % 10}" for i, n in enumerate(names)}
    curves = rec.training_curves()
    evals = sorted((e.t, e.tokens, e.loss) for e in rec.events if isinstance(e, HeldoutEvaluated))
    for ax, x in ((by_tokens, "run_tokens"), (by_time, "t")):
        for name in names:
            pts = [p for p in curves.get(name, []) if p["loss"] is not None]
            if pts:
                xs = [p[x] for p in pts]
                ax.plot(xs, [p["loss"] for p in pts], color=colors[name], lw=1.2, alpha=0.85)
        if evals:
            xs = [e[1] if x == "run_tokens" else e[0] for e in evals]
            ax.plot(xs, [e[2] for e in evals], "o-", color="black", markersize=3, lw=1.5)
        if not evals and not any(curves.values()):
            _empty(ax, "no loss reported yet")
        ax.grid(alpha=0.3)
    by_tokens.set_ylabel("loss (nats/token)")
    by_tokens.set_xlabel(TOKENS_LABEL)
    by_tokens.xaxis.set_major_formatter(TOKENS)
    by_time.set_xlabel(TIME_LABEL)
    drawn = [n for n in names if any(p["loss"] is not None for p in curves.get(n, []))]
    handles = [Line2D([], [], color=colors[n], label=f"{rec.label(n)} training") for n in drawn]
    handles.append(
        Line2D([], [], color="black", marker="o", markersize=3, label="held-out (global params)")
    )
    _outside_legend(by_time, handles)
    lrs = False
    for name in names:
        pts = [p for p in curves.get(name, []) if p["lr"] is not None]
        if pts:
            lrs = True
            lr_ax.plot([p["run_tokens"] for p in pts], [p["lr"] for p in pts], color=colors[name])
    if not lrs:
        _empty(lr_ax, "no learning rate reported")
    lr_ax.set_xlabel(TOKENS_LABEL)
    lr_ax.xaxis.set_major_formatter(TOKENS)
    lr_ax.set_ylabel("inner learning rate")
    lr_ax.grid(alpha=0.3)
    pts = [p for p in rec.points if p.get("tokens_per_s") is not None and "t" in p]
    if pts:
        rate_ax.plot([p["t"] for p in pts], [p["tokens_per_s"] for p in pts], color="#1f4e79")
    else:
        _empty(rate_ax, "no throughput in the progress points yet")
    rate_ax.set_xlabel(TIME_LABEL)
    rate_ax.set_ylabel("tokens/s (last 10 s)")
    rate_ax.set_ylim(bottom=0)
    rate_ax.grid(alpha=0.3)
    for ax in (by_time, rate_ax):
        ax.set_xlim(0, max(rec.end_t, 1.0))
    fig.suptitle(f"run {rec.name}: training curves")
    return fig


def rounds(rec: RunRecord) -> Figure:
    """Contributors merged per round and the grace window each round allowed (and used)."""
    closed = [e for e in rec.events if isinstance(e, RoundClosed)]
    graced = grace_on(rec.config)
    fig = Figure(figsize=(10, 5.5 if graced else 3.4), layout="constrained")
    axes = list(fig.subplots(2, 1, sharex=True)) if graced else [fig.subplots()]
    top = axes[0]
    fig.suptitle(f"run {rec.name}: rounds ({len(closed)} closed)")
    if not closed:
        for ax in axes:
            _empty(ax, "no round closed yet")
    else:
        ts = [e.t for e in closed]
        counts = [e.num_contributors for e in closed]
        top.scatter(ts, counts, s=6, alpha=0.35, color="#1f4e79", label="one round")
        k = min(len(closed), max(5, len(closed) // 30))
        top.plot(ts, _rolling_mean(counts, k), color="#d1495b", label=f"mean of {k} rounds")
        top.set_ylim(0, max(counts) + 0.5)
        top.yaxis.set_major_locator(MaxNLocator(integer=True))
        _outside_legend(top)
    top.set_ylabel("contributors per round")
    if graced:
        _grace(axes[1], closed)
    axes[-1].set_xlabel(TIME_LABEL)
    axes[-1].set_xlim(0, max(rec.end_t, 1.0))
    for ax in axes:
        ax.grid(alpha=0.3)
    return fig


def _grace(ax: Axes, closed: Sequence[RoundClosed]) -> None:
    """The grace window each round allowed after quorum against the time it waited."""
    graced = [e for e in closed if e.grace_s is not None]
    if graced:
        ts = [e.t for e in graced]
        ax.scatter(
            ts,
            [math.nan if e.grace_s is None else e.grace_s for e in graced],
            s=30,
            facecolors="none",
            edgecolors="#e07b39",
            label="grace window allowed after quorum",
        )
        ax.scatter(
            ts,
            [math.nan if e.waited_s is None else e.waited_s for e in graced],
            s=6,
            color="#1f4e79",
            label="time the round waited after quorum",
        )
        _outside_legend(ax)
    elif closed:
        _empty(ax, "grace windows not recorded on this tape")
    ax.set_ylabel("seconds")
    ax.set_ylim(bottom=0)


def goodput(rec: RunRecord) -> Figure:
    """Goodput over a sliding window (where a boot, a fault or a stall happened), beside the
    run-so-far goodput and uptime the driver measured at every poll."""
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    ax = fig.subplots()
    window = goodput_window_s(rec.end_t)
    windowed = rec.windowed_goodput(window)
    pts = [p for p in rec.points if p.get("goodput") is not None]
    if not windowed and not pts:
        _empty(ax, "no learner time yet")
    if windowed:
        wts, values = zip(*windowed, strict=True)
        ax.plot(wts, values, color="#4c9f50", lw=2, label=f"goodput (last {window:.0f} s)")
    if pts:
        ts = [p["t"] for p in pts]
        ax.plot(
            ts,
            [p["goodput"] for p in pts],
            "--",
            color="#4c9f50",
            lw=1,
            label="goodput (run so far)",
        )
        # Before the first round uptime is not measured yet (None): a gap, not a drop to 0.
        up = [math.nan if p.get("uptime") is None else p["uptime"] for p in pts]
        ax.plot(ts, up, color="#1f4e79", lw=1, label="uptime (run so far)")
    handles, _ = ax.get_legend_handles_labels()
    handles += _event_lines(ax, rec)
    _outside_legend(ax, handles)
    ax.set_ylim(0, 1.05)
    ax.set_xlim(0, max(rec.end_t, 1.0))
    ax.set_ylabel("fraction")
    ax.set_xlabel(TIME_LABEL)
    ax.set_title(f"run {rec.name}: goodput and uptime")
    ax.grid(alpha=0.3)
    return fig


def goodput_window_s(end_t: float) -> float:
    """A twentieth of the run, at least 10 s: short enough to place an event, long enough to
    hold a few progress polls."""
    return max(10.0, end_t / 20)


def links(rec: RunRecord) -> Figure:
    """Each region's link to the synchronizer: the rate it carried up and down (its learners
    together, between progress polls) against the emulated link's capacity; and the bytes
    each learner moved in all."""
    fig = Figure(figsize=(11, 7), layout="constrained")
    over_time, totals = fig.subplots(2, 1, height_ratios=[1.5, 1])
    rates = rec.link_rates()
    capacity = {r: 1e3 * v["bandwidth_gbps"] for r, v in rec.config.get("links", {}).items()}
    regions = sorted(rates)
    colors = {r: f"C{i % 10}" for i, r in enumerate(regions)}
    if not rates:
        _empty(over_time, "no two progress points yet")
    handles: list[Any] = []
    for i, region in enumerate(regions):
        width = 3.0 - 1.8 * i / len(regions)  # later regions thinner: equal rates stay visible
        for direction, style in (("up", "-"), ("down", "--")):
            series = rates[region][direction]
            if series:
                ts, bps = zip(*series, strict=True)
                mbps = [b / 1e6 if b > 0 else math.nan for b in bps]  # (log scale: no zero)
                over_time.plot(ts, mbps, style, color=colors[region], lw=width)
        label = rec_region_label(rec, region)
        if region in capacity:
            over_time.axhline(capacity[region], color=colors[region], ls=":", lw=2)
            label += f", link {capacity[region]:,.0f} Mbit/s (dotted)"
        else:
            label += ", no emulated link"
        handles.append(Line2D([], [], color=colors[region], label=label))
    handles += [
        Line2D([], [], color="grey", ls="-", label="up (contributions)"),
        Line2D([], [], color="grey", ls="--", label="down (published fragments)"),
    ]
    _outside_legend(over_time, handles)
    over_time.set_xlabel(TIME_LABEL)
    over_time.set_ylabel("Mbit/s")
    over_time.set_yscale("log")  # a rate far below its link's capacity stays readable
    over_time.set_xlim(0, max(rec.end_t, 1.0))
    over_time.grid(alpha=0.3)
    names = rec.learner_names
    up, down = rec.link_totals()
    xs = range(len(names))
    totals.bar(
        [x - 0.2 for x in xs], [up.get(n, 0) / 1e6 for n in names], 0.4, color="#555555", label="up"
    )
    totals.bar(
        [x + 0.2 for x in xs],
        [down.get(n, 0) / 1e6 for n in names],
        0.4,
        color="#bbbbbb",
        label="down",
    )
    totals.set_xticks(list(xs), [rec.label(n) for n in names])
    totals.set_ylabel("MB in all")
    _outside_legend(totals)
    totals.grid(axis="y", alpha=0.3)
    fig.suptitle(f"run {rec.name}: link rates per region, bytes per learner")
    return fig


def rec_region_label(rec: RunRecord, region: str) -> str:
    learners = [n for n in rec.learner_names if rec.regions.get(n) == region]
    return f"{region} ({', '.join(learners)})" if learners else region


FIGURES = {
    "training.png": training,
    "loss_timeline.png": loss_and_timeline,
    "rounds.png": rounds,
    "goodput.png": goodput,
    "links.png": links,
}


def _rolling_mean(values: Sequence[float], k: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - k] if i >= k else 0.0)
        out.append(total / min(i + 1, k))
    return out


def _outside_legend(ax: Axes, handles: list[Any] | None = None) -> None:
    """A legend right of the axes, where it cannot hide a data point."""
    if handles is None:
        handles = ax.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")


def _empty(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="grey")
