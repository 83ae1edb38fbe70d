"""A rerun never destroys a run: `train` on a run dir holding a finished run, or a run of
another config, is one `error:` line naming what the run dir holds and `--overwrite`, exit 2,
and every file left as it was; an unfinished run of the same config resumes; `--resume` and
`--overwrite` say what to do explicitly. A finished run is refused before Ray or JAX starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ray_diloco import cli
from ray_diloco.config import ConfigError, config_digest, load_config
from ray_diloco.control.events import RunStarted
from ray_diloco.control.run_dir import Action, Held, delete_run, read_run_dir, run_dir_action
from ray_diloco.control.tape import EventTape
from ray_diloco.observe.run_report import RUN_FILES

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "fixtures" / "tiny_train.yaml"


def _digest(run_dir: Path, *overrides: str) -> str:
    cfg = load_config(TINY, [f"run_dir={run_dir.absolute()}", *overrides])
    return config_digest(cfg)


def _a_run(run_dir: Path, digest: str, finished: bool) -> None:
    """What a driver leaves: its tape (the RunStarted of `digest`), a synchronizer checkpoint,
    the compilation cache and, for a finished run, its summary."""
    with EventTape(run_dir / "events.jsonl") as tape:
        tape.append(RunStarted(t=0.0, config_digest=digest))
    (run_dir / "checkpoints" / "synchronizer" / "4").mkdir(parents=True)
    (run_dir / "checkpoints" / "synchronizer" / "4" / "state").write_text("weights")
    (run_dir / "jax_cache").mkdir()
    (run_dir / "metrics.jsonl").write_text("{}\n")
    if finished:
        (run_dir / "summary.json").write_text(json.dumps({"tokens": 5120}))


def _files(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    ("command", "finished", "overrides", "names"),
    [
        ("train", True, [], "holds a finished run; pass --overwrite"),
        ("train", True, ["--set", "seed=1"], "holds a finished run; pass --overwrite"),
        ("simulate", True, [], "holds a finished run; pass --overwrite"),
        # A reference run resumes nothing: an unfinished run is refused whatever its config.
        ("simulate", False, [], "holds an unfinished run; pass --overwrite"),
    ],
)
def test_a_rerun_on_a_finished_run_is_refused_before_ray_starts_and_deletes_nothing(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    command: str,
    finished: bool,
    overrides: list[str],
    names: str,
) -> None:
    run_dir = tmp_path / "run"
    _a_run(run_dir, _digest(run_dir), finished)
    before = _files(tmp_path)
    args = ["--config", str(TINY), "--set", f"run_dir={run_dir}", *overrides]
    assert cli.main([command, *args]) == 2
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: run_dir={run_dir}: "), err
    assert names in lines[0] and "--overwrite" in lines[0], err
    assert "Traceback" not in out + err
    assert _files(tmp_path) == before


def test_an_unfinished_run_resumes_with_its_own_config_only(tmp_path: Path) -> None:
    # (`train` compares the config once its task is built, after Ray started: here directly.)
    digest = _digest(tmp_path)
    _a_run(tmp_path, digest, finished=False)
    assert read_run_dir(tmp_path).held is Held.UNFINISHED
    assert run_dir_action(tmp_path, digest) is Action.RESUME
    assert run_dir_action(tmp_path, digest, resume=True) is Action.RESUME
    other = _digest(tmp_path, "seed=1")
    with pytest.raises(ConfigError) as err:
        run_dir_action(tmp_path, other)
    assert f"holds an unfinished run of another config (digest {digest}, not {other})" in str(
        err.value
    )
    assert "rerun it with its own config (config.json there) to resume it" in str(err.value)
    assert run_dir_action(tmp_path, other, overwrite=True) is Action.OVERWRITE
    with pytest.raises(ConfigError, match="holds an unfinished run; pass --overwrite"):
        run_dir_action(tmp_path, digest, resumable=False)  # a reference run resumes nothing


def test_resume_needs_a_run_and_overwrite_replaces_only_the_run(tmp_path: Path) -> None:
    new = tmp_path / "new"
    assert run_dir_action(new, "d") is Action.START
    assert run_dir_action(new, "d", overwrite=True) is Action.START  # nothing to delete
    with pytest.raises(ConfigError, match="holds no run to resume; drop --resume"):
        run_dir_action(new, "d", resume=True)
    with pytest.raises(ConfigError, match="not both"):
        run_dir_action(new, "d", resume=True, overwrite=True)

    run_dir = tmp_path / "run"
    _a_run(run_dir, "other", finished=True)
    with pytest.raises(ConfigError, match="holds a finished run of another config"):
        run_dir_action(run_dir, "d", resume=True)
    assert run_dir_action(run_dir, "d", overwrite=True) is Action.OVERWRITE
    (run_dir / "notes.txt").write_text("the user's own")
    delete_run(run_dir, RUN_FILES)
    assert sorted(_files(run_dir)) == ["notes.txt"]
    assert (run_dir / "jax_cache").is_dir()  # compiled programs are no results: kept
    assert read_run_dir(run_dir).held is Held.NOTHING
