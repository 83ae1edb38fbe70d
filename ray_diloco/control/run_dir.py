"""Layer: control (pure Python; no Ray, no JAX). What a run dir holds, and what a new run may do
with it.

A run dir is new (nothing of a run in it), holds an unfinished run (an event tape, no summary:
its driver died or was stopped), or a finished one (`summary.json`). A run's config is the
digest its tape's first `RunStarted` carries. Without being told, a new run starts, an
unfinished run of the same config resumes (the synchronizer restores its checkpoint, the tape
goes on), and anything else is refused: a finished run, or another config's, is replaced only
with `overwrite`. `resume` insists on resuming. A reference run (`simulate`) resumes nothing:
it is refused any run dir that holds a run. Only `delete_run`, after `Action.OVERWRITE`,
deletes anything.
"""

from __future__ import annotations

import enum
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ray_diloco.config import ConfigError
from ray_diloco.control.events import RunStarted
from ray_diloco.control.tape import read_tape


class Held(enum.Enum):
    NOTHING = "no run"
    UNFINISHED = "an unfinished run"
    FINISHED = "a finished run"


class Action(enum.Enum):
    START = "start"  # nothing to keep: a fresh run
    RESUME = "resume"  # the unfinished run of this config goes on
    OVERWRITE = "overwrite"  # what the run dir holds is deleted first, as asked


@dataclass(frozen=True)
class RunDirState:
    held: Held
    config_digest: str | None  # the digest the run's tape names (None: no tape)

    def describe(self, digest: str | None) -> str:
        """E.g. "a finished run" or "an unfinished run of another config (digest ...)"."""
        if digest is None or self.config_digest in (None, digest):
            return self.held.value
        return f"{self.held.value} of another config (digest {self.config_digest}, not {digest})"


def read_run_dir(run_dir: Path) -> RunDirState:
    tape = run_dir / "events.jsonl"
    events = read_tape(tape) if tape.exists() else []
    digest = next((e.config_digest for e in events if isinstance(e, RunStarted)), None)
    if (run_dir / "summary.json").exists():
        return RunDirState(Held.FINISHED, digest)
    return RunDirState(Held.UNFINISHED if digest is not None else Held.NOTHING, digest)


def run_dir_action(
    run_dir: Path,
    digest: str | None,
    resume: bool = False,
    overwrite: bool = False,
    resumable: bool = True,
) -> Action:
    """What a run of config `digest` does with `run_dir`; a ConfigError (one line, naming what
    the run dir holds and the flag) where it may not go on without being told. A run that is
    not `resumable` (a reference run) is refused an unfinished run too. Without a `digest`
    the config is not compared: what is refused whatever the config is refused."""
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite: pass one of them, not both")
    state = read_run_dir(run_dir)
    if overwrite:
        return Action.OVERWRITE if state.held is not Held.NOTHING else Action.START
    same = digest is None or state.config_digest in (None, digest)
    if state.held is Held.UNFINISHED and same and resumable:
        return Action.RESUME
    if state.held is Held.NOTHING:
        if resume:
            raise ConfigError(
                f"run_dir={run_dir}: holds no run to resume; drop --resume to start one"
            )
        return Action.START
    what = state.describe(digest)
    hint = (
        "rerun it with its own config (config.json there) to resume it, "
        if state.held is Held.UNFINISHED and resumable
        else ""
    )
    raise ConfigError(
        f"run_dir={run_dir}: holds {what}; {hint}pass --overwrite to replace it "
        "(its checkpoints and records are deleted), or pick another run_dir"
    )


def delete_run(run_dir: Path, files: Iterable[str]) -> None:
    """Delete the run `run_dir` holds (its synchronizer checkpoints and the run's `files`), as
    `--overwrite` asked; the compilation cache stays (it holds no results)."""
    for shard_dir in (run_dir / "checkpoints").glob("synchronizer*"):
        shutil.rmtree(shard_dir, True)
    for name in files:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path, True)
        else:
            path.unlink(missing_ok=True)
