"""MkDocs hook (mkdocs.yml `hooks:`): serve the benchmarks' plots under `results/`.

The plots are written beside their JSON in `benchmarks/results/`; the results pages in
`docs/results/` show them as `NAME.png`, so the site needs them there and git holds one copy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parent / "results"


def on_files(files: Files, config: Any) -> Files:
    for png in sorted(RESULTS.glob("*.png")):
        files.append(
            File(
                f"results/{png.name}",
                str(RESULTS.parent),
                config["site_dir"],
                config["use_directory_urls"],
            )
        )
    return files
