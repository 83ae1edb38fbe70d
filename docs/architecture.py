"""Draw docs/architecture.png: learners on their slices, the synchronizer's shards, the
supervisor, and what travels on each link.

    python docs/architecture.py
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

OUT = Path(__file__).resolve().parent / "architecture.png"

LEARNER = "#dbe9f6"
SYNC = "#fde4c8"
SUPER = "#e3f1dc"
HEAD = "#f4f4f4"
EDGE = "#444444"


def box(ax, x, y, w, h, colour, title, lines=(), size=9):
    ax.add_patch(
        FancyBboxPatch(
            (x, y),
            w,
            h,
            boxstyle="round,pad=0.02,rounding_size=0.08",
            facecolor=colour,
            edgecolor=EDGE,
            linewidth=1.1,
        )
    )
    ax.text(
        x + w / 2, y + h - 0.12, title, ha="center", va="top", fontsize=size + 1, fontweight="bold"
    )
    for i, line in enumerate(lines):
        ax.text(x + w / 2, y + h - 0.45 - 0.27 * i, line, ha="center", va="top", fontsize=size)


def chips(ax, x, y, hosts, per_host):
    """A slice: one row of chips per host."""
    for h in range(hosts):
        for c in range(per_host):
            ax.add_patch(
                FancyBboxPatch(
                    (x + 0.22 * c, y - 0.24 * h),
                    0.17,
                    0.17,
                    boxstyle="square,pad=0",
                    facecolor="#7aa6d6",
                    edgecolor="white",
                )
            )


def arrow(ax, a, b, colour, label=None, at=0.5, offset=(0, 0), rad=0.0, style="-|>", size=8.5):
    ax.add_patch(
        FancyArrowPatch(
            a,
            b,
            arrowstyle=style,
            mutation_scale=13,
            color=colour,
            linewidth=1.6,
            connectionstyle=f"arc3,rad={rad}",
        )
    )
    if label:
        x = a[0] + (b[0] - a[0]) * at + offset[0]
        y = a[1] + (b[1] - a[1]) * at + offset[1]
        ax.text(
            x,
            y,
            label,
            fontsize=size,
            color=colour,
            ha="center",
            va="center",
            bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.0},
        )


def main() -> None:
    fig = Figure(figsize=(12, 8))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, 12)
    ax.set_ylim(0, 8)
    ax.axis("off")
    up, down, watch = "#c0392b", "#1f618d", "#2e8b57"

    # Regions: the head's on the left, a second one across the WAN on the right.
    for x, w, name in ((0.15, 7.25, "region us-east5"), (7.65, 4.2, "region europe-west4")):
        ax.add_patch(
            FancyBboxPatch(
                (x, 1.0),
                w,
                6.85,
                boxstyle="round,pad=0,rounding_size=0.1",
                facecolor="none",
                edgecolor="#999999",
                linestyle="--",
            )
        )
        ax.text(x + 0.15, 7.75, name, fontsize=9, color="#666666", va="top")
    ax.text(7.95, 4.45, "WAN link", fontsize=8.5, color="#666666", ha="left")

    # The head: supervisor, driver and the synchronizer's shards (a stack: S detached actors).
    box(
        ax,
        0.4,
        4.6,
        6.75,
        2.9,
        HEAD,
        "Ray head (CPU node)  -  the job's driver: progress, report",
        size=8,
    )
    box(
        ax,
        0.6,
        4.8,
        1.85,
        2.1,
        SUPER,
        "Supervisor",
        ["detects failures", "restarts learners", "injects chaos", "event tape"],
    )
    for k in (2, 1):
        ax.add_patch(
            FancyBboxPatch(
                (2.75 + 0.12 * k, 4.8 + 0.1 * k),
                4.0,
                2.0,
                boxstyle="round,pad=0.02,rounding_size=0.08",
                facecolor=SYNC,
                edgecolor=EDGE,
                linewidth=0.8,
            )
        )
    box(
        ax,
        2.75,
        4.8,
        4.0,
        2.0,
        SYNC,
        "Synchronizer shards",
        [
            "detached actors; fragments split by bytes",
            "per fragment: quorum K, grace window, fencing,",
            "guards, token-weighted RDA merge, outer step",
            "shard 0 also: token ledger, data leases, eval",
        ],
    )

    # Learners: each a Ray actor group on one whole slice, one mesh over all its chips.
    learners = (
        (0.6, "learner us-0", "TPU v5p 2x2x2: 2 hosts x 4 chips", 2, 4),
        (3.95, "learner us-1", "TPU v5p 2x2x2: 2 hosts x 4 chips", 2, 4),
        (8.3, "learner eu-0", "TPU v6e 2x4: 1 host x 8 chips", 1, 8),
    )
    for x, name, shape, hosts, per_host in learners:
        box(ax, x, 1.25, 3.0, 2.15, LEARNER, name, [shape, "one mesh; inner AdamW steps"])
        chips(
            ax, x + 1.5 - (0.22 * per_host - 0.05) / 2, 1.8 if hosts == 2 else 1.65, hosts, per_host
        )

    # Offers up (red) and publications down (blue), learner <-> synchronizer.
    for a, b in (
        ((2.7, 3.45), (3.2, 4.75)),
        ((5.2, 3.45), (5.0, 4.75)),
        ((8.7, 3.45), (6.6, 4.75)),
    ):
        arrow(ax, a, b, up)
        arrow(ax, (b[0] + 0.3, b[1]), (a[0] + 0.3, a[1]), down)

    # Supervision: a bus from the supervisor to every learner (watch, restart).
    ax.plot([1.3, 1.3], [4.75, 3.95], color=watch, linewidth=1.6, linestyle="--")
    ax.plot([1.3, 10.6], [3.95, 3.95], color=watch, linewidth=1.6, linestyle="--")
    for x in (1.3, 4.6, 10.6):
        arrow(ax, (x, 3.95), (x, 3.45), watch)

    # Legend.
    items = (
        (up, "offer: one fragment's delta to its base, 4 bits; one fragment falls due a step"),
        (down, "publication: a merged fragment, as a 4-bit difference to what the learner holds"),
        (watch, "supervision: progress reports, failure detection, restarts, chaos"),
    )
    for i, (colour, text) in enumerate(items):
        y = 0.75 - 0.27 * i
        ax.plot(
            [0.4, 0.9],
            [y, y],
            color=colour,
            linewidth=2.2,
            linestyle="--" if colour == watch else "-",
        )
        ax.text(1.0, y, text, fontsize=9, va="center")
    ax.text(
        11.8,
        0.48,
        "Gradients stay inside a slice;\nno learner waits for another.",
        fontsize=9,
        ha="right",
        va="center",
        color="#333333",
    )
    fig.savefig(OUT, dpi=110)
    print(OUT)


if __name__ == "__main__":
    main()
