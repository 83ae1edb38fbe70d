"""Shared plumbing for the benchmark scripts: where results go and how they are written.

Each benchmark prints a table, writes `<name>.json` and `<name>.md` under
`benchmarks/results/` (or `--out`), with the command line and the machine it ran on.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

from ray_diloco.observe.report import machine, markdown_table
from ray_diloco.runtime.learner.compile_cache import use_compilation_cache_dir

RESULTS = Path(__file__).resolve().parent / "results"
REFERENCE = Path(__file__).resolve().parent.parent / "jobs" / "reference.yaml"
# --quick: a tiny model (P = H = 8 fits its 20 leaves) so a smoke run takes seconds.
QUICK_MODEL = [
    "task_args.model.d_model=32",
    "task_args.model.num_layers=2",
    "task_args.model.d_ff=64",
    "diloco.sync_every=8",
    "diloco.num_fragments=8",
    "task_args.data.eval_batches=2",
]
# The quality benchmarks' variants start from docs/algorithm.md as written (every learner receives
# every round, a round steps in full, a new version overwrites the learner's values, bfloat16
# both ways, K = 1 with the grace window) and name what they change.
GRACE = ["diloco.grace_fraction=0.5"]  # docs/algorithm.md's grace window
NO_GRACE = ["diloco.grace_fraction=0"]
# Learners offering on their own count with bases at most 4 versions behind, as every quality row
# was measured before pulled rounds became the config's default.
OFFERS = ["diloco.schedule=offer", "diloco.max_staleness_versions=4"]
AS_WRITTEN = [
    *OFFERS,
    "diloco.quorum_min=1",
    *GRACE,
    "diloco.wire_dtype=bfloat16",
    "diloco.publish_delta=none",
    "diloco.publish_to=all",
    "diloco.round_step=full",
    "diloco.keep_unsent_work=false",
    "diloco.mixing_alpha=0",
]
# On top of AS_WRITTEN, two of the config's defaults: the sqrt step with Streaming DiLoCo's
# mixing.
MIX = ["diloco.round_step=sqrt", "diloco.mixing_alpha=0.25"]


def both_ways(bits: str) -> list[str]:
    """Offers up and publications down on a `bits` wire (int4: the config's default)."""
    return [f"diloco.wire_dtype={bits}", f"diloco.publish_delta={bits}"]


# On top of AS_WRITTEN: the mix on 4 bits both ways, with a quorum of two. Without the grace
# window (K2 + NO_GRACE) it was the 4-learner job files' rule before pulled rounds.
K2 = [*MIX, *both_ways("int4"), "diloco.quorum_min=2"]
# That rule whole, on top of the config's defaults (the rows that measured it as "decoupled").
OFFERS_K2 = [*OFFERS, "diloco.quorum_min=2", *NO_GRACE, "diloco.keep_unsent_work=false"]
# The config's default as the quality and heterogeneous benchmarks name it: rounds pulled by the
# synchronizer, K = 1 without the window, unsent work kept, bases up to 8 versions behind.
PULLED = "default: pulled, K=1, kept unsent work"

# Row names quality.py and quality_horizon.py share; the rows keep the names they were measured
# under, as the committed JSON holds them (f"{DEFAULT_K2}, no grace" was the job files' rule
# before PULLED; docs/decisions/ say how each earlier one led to it).
FRACTION_STEP = "decoupled K=1 grace, fraction step"
DEFAULT = "decoupled K=1 grace, sqrt step"
DEFAULT_ROW = f"{DEFAULT}, mixing alpha 0.25"
DEFAULT_K2 = f"{DEFAULT_ROW}, int4 both ways, K=2"


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="smoke setting, under two minutes")
    p.add_argument("--out", type=Path, default=RESULTS, help="directory for JSON/markdown/PNG")
    return p


def cache_compilations() -> None:
    """Share compiled programs between the in-process reference runs of a sweep. Each run
    builds its step functions anew, so JAX's in-memory cache misses and compiles again (about
    2 s of a 3 s quick run); the persistent cache turns that into a load. Not for benchmarks
    that time a start-up, which would then measure a warm cache."""
    use_compilation_cache_dir(str(Path(tempfile.gettempdir()) / "ray_diloco-jax-cache"))


def write_results(
    out: Path, name: str, rows: list[dict[str, Any]], columns: list[str], meta: dict[str, Any]
) -> Path:
    """Print the table and write JSON + markdown (git keeps their history); returns the
    markdown path."""
    out.mkdir(parents=True, exist_ok=True)
    # the script that ran (`name` is e.g. "goodput-quick" for a --quick run of goodput.py),
    # quoted as a shell would need it (variant names have spaces and commas)
    command = shlex.join(["python", f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    meta = {"command": command, "machine": machine(), "date": dt.date.today().isoformat(), **meta}
    table = markdown_table(rows, columns)
    print(table)
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    md = out / f"{name}.md"
    md.write_text(
        f"# {name}\n\nCommand: `{command}`  \nMachine: {meta['machine']}  \n"
        f"Date: {meta['date']}\n\n{table}\n"
    )
    return md


def plot_loss_curves(
    curves: list[tuple[str, list[dict[str, float]]]], path: Path, zoom_from: float = 0.5
) -> None:
    """Held-out loss over tokens: whole runs on the left, the part from `zoom_from` of the run
    on zoomed on the right (where variants part), one legend for both beside them; up to 40
    curves get their own look (colour x line style). A diverged curve leaves the zoom's top."""
    import matplotlib
    from matplotlib.figure import Figure

    from ray_diloco.sim.figures import save_figure

    # Tall enough for the legend: about 0.18 in a line at font size 8 (at 5.2 in, 30 curves
    # ran off the top and bottom).
    fig = Figure(figsize=(15, max(5.2, 0.18 * len(curves) + 0.8)))
    whole, tail, key = fig.subplots(1, 3, width_ratios=[1, 1, 0.8])
    colours = matplotlib.colormaps["tab10"].colors
    styles = ["-", "--", ":", "-."]
    for i, (label, evals) in enumerate(curves):
        tokens = [e["tokens"] / 1e6 for e in evals]
        losses = [e["heldout_loss"] for e in evals]
        look = {"color": colours[i % 10], "linestyle": styles[i // 10 % 4], "linewidth": 1.4}
        whole.plot(tokens, losses, **look)
        tail.plot(tokens, losses, label=label, **look)
    ends = sorted(evals[-1]["heldout_loss"] for _, evals in curves)
    end = max(e["tokens"] for _, evals in curves for e in evals) / 1e6
    tail.set_xlim(end * zoom_from, None)
    tail.set_ylim(ends[0] - 0.05, ends[len(ends) * 3 // 4] + 0.15)
    whole.set_title("whole run")
    tail.set_title(f"from {zoom_from:.0%} of the run, zoomed")
    for ax in (whole, tail):
        ax.set_xlabel("tokens (millions)")
        ax.set_ylabel("held-out loss (global parameters)")
        ax.grid(alpha=0.3)
    key.axis("off")
    key.legend(*tail.get_legend_handles_labels(), loc="center left", fontsize=8)
    save_figure(fig, path, dpi=110)
