"""The examples users copy (examples/*/config.yaml) keep working: each one's task loads by its
import path from the repository root and trains in the in-process reference run."""

from __future__ import annotations

from pathlib import Path

import pytest

from ray_diloco.config import load_config
from ray_diloco.sim.simulate import run_reference

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*/config.yaml"))


def test_every_example_has_a_readme_with_its_command() -> None:
    assert len(EXAMPLES) >= 2
    for config in EXAMPLES:
        readme = (config.parent / "README.md").read_text()
        assert f"ray-diloco train --config examples/{config.parent.name}/config.yaml" in readme


@pytest.mark.parametrize("config", EXAMPLES, ids=lambda p: p.parent.name)
def test_example_trains_in_the_reference_run(config: Path, tmp_path: Path) -> None:
    cfg = load_config(config, [f"run_dir={tmp_path}"])
    short = cfg.model_copy(update={"token_budget": cfg.token_budget // 4})
    summary = run_reference(short)
    evals = [e["heldout_loss"] for e in summary["evals"]]
    assert min(evals[-3:]) < 0.75 * evals[0], evals
