"""Layer: sim (pure, no Ray). Writing a matplotlib figure to a file: the simulators' sweeps and
the benchmarks draw with it."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def save_figure(fig: Any, path: str | Path, dpi: int = 120) -> Path:
    """Lay out, write (creating the folder) and close a matplotlib figure; closing matters
    because pyplot keeps every open figure alive."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out
