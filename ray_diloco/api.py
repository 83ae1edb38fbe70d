"""Top level (the public API): the Python API for notebooks and scripts, in the words of Ray Train.

    import ray_diloco

    trainer = ray_diloco.Trainer("my_pkg.tasks:make_task", "jobs/local.yaml",
                                 task_args={"width": 128}, overrides=["token_budget=1e6"])
    result = trainer.fit()              # on Ray: embedded local Ray, or RAY_ADDRESS / address=
    result.metrics["heldout_loss"]      # the run's summary (also run_dir/summary.json)
    params = result.params()            # the final global parameters, as the task's pytree

`Trainer.simulate()` runs the same config in process on a virtual clock (the reference run, no
Ray). `train(...)` and `simulate(...)` are one-call shorthands. A task is named by import path,
or passed as its factory: one that other processes cannot import by name (defined in a script
or a notebook cell) travels inside the config by value, as Ray ships remote functions.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ray_diloco.config import (
    RunConfig,
    apply_overrides,
    build_config,
    check_output_dir,
    dump_config,
    load_config,
)
from ray_diloco.task import TaskFactory, task_spec


@dataclass(frozen=True)
class Result:
    """What a finished run leaves: its summary (`metrics`), its run dir (`path`) and config,
    and the final global parameters (`params()`)."""

    metrics: dict[str, Any]
    path: Path
    config: RunConfig
    _params: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def checkpoint(self) -> Path | None:
        """The synchronizer's newest Orbax checkpoint of the run (None for a reference run);
        of shard 0 when the synchronizer was sharded (`checkpoints()` lists every shard's)."""
        return self.checkpoints()[0]

    def checkpoints(self) -> list[Path | None]:
        """The newest Orbax checkpoint of each synchronizer shard (None where there is none)."""
        from ray_diloco.algorithm.shards import shard_directory

        out: list[Path | None] = []
        for shard in range(self.config.synchronizer.num_shards):
            root = shard_directory(self.path, shard)
            steps = sorted((int(p.name) for p in root.glob("*") if p.name.isdigit()), reverse=True)
            out.append(root / str(steps[0]) if steps else None)
        return out

    def params(self) -> Any:
        """The final global parameters as the task's own pytree: from the run's last Orbax
        checkpoints (a Ray run: every shard's fragments), or kept in memory (a reference run)."""
        from ray_diloco.algorithm import checkpoint
        from ray_diloco.algorithm.setup import layout_of

        flat = self._params
        if flat is None:
            flat = {}
            for path in self.checkpoints():
                if path is None:
                    raise FileNotFoundError(
                        f"{self.path}: no synchronizer checkpoint (was checkpoint.enabled false?)"
                    )
                saved = checkpoint.Checkpointer(path.parent, self.config.checkpoint.keep)
                loaded = saved.restore()
                saved.close()
                assert loaded is not None
                flat.update(checkpoint.global_values(loaded[0]))
        return layout_of(self.config).unflatten(flat)


class Trainer:
    """A run of `task` with `config` (a RunConfig, a YAML path, a dict, or None for the
    defaults); `task_args` replaces the config's (a task other than the config's starts from
    none), `overrides` are dotted `key=value` strings applied on top (as `--set`)."""

    def __init__(
        self,
        task: str | TaskFactory | None = None,
        config: RunConfig | str | Path | Mapping[str, Any] | None = None,
        *,
        task_args: Mapping[str, Any] | None = None,
        overrides: Sequence[str] = (),
    ) -> None:
        # What the config leaves unset stays unset (a default fitted to the task, such as
        # diloco.num_fragments, is fitted only where the user did not choose it).
        if isinstance(config, RunConfig):
            tree = config.model_dump(mode="json", exclude_unset=True)
        elif isinstance(config, Mapping):
            tree = dict(config)
        else:
            tree = load_config(config).model_dump(mode="json", exclude_unset=True)
        if task is not None:
            spec = task_spec(task)
            if spec != tree.get("task") and task_args is None:
                task_args = {}  # the config's task_args were written for its own task
            tree["task"] = spec
        if task_args is not None:
            tree["task_args"] = dict(task_args)
        apply_overrides(tree, list(overrides))
        self.config = build_config(tree, "ray_diloco.Trainer")

    def fit(
        self,
        address: str | None = None,
        progress: bool = True,
        resume: bool = False,
        overwrite: bool = False,
    ) -> Result:
        """Train on Ray to the token budget (`ray_diloco.runtime.driver.run_training`); `progress`
        shows the live display (plain lines when stdout is not a terminal). An unfinished run of
        this config in the run dir resumes (`resume` insists on it); a finished run or another
        config's raises a ConfigError unless `overwrite` replaces it."""
        from ray_diloco.observe.display import progress_display, run_title
        from ray_diloco.runtime.driver import run_training

        cfg = self.config
        display = progress_display(run_title(cfg)) if progress else contextlib.nullcontext()
        with display as show:
            summary = run_training(
                cfg, address=address, progress=show, resume=resume, overwrite=overwrite
            )
        return Result(summary, Path(cfg.run_dir).absolute(), cfg)

    def simulate(self, progress: bool = False, overwrite: bool = False) -> Result:
        """The in-process reference run of the same config on a virtual clock (no Ray). A run
        dir that holds a run raises a ConfigError unless `overwrite` replaces it."""
        from ray_diloco.algorithm.setup import check_task, fitted_config
        from ray_diloco.control.run_dir import Action, delete_run, run_dir_action
        from ray_diloco.observe.report import progress_line, write_json
        from ray_diloco.observe.run_report import RUN_FILES
        from ray_diloco.sim.simulate import reference_run

        cfg = self.config
        check_output_dir(cfg.run_dir, "run_dir")  # before a run whose results it cannot keep
        run_dir = Path(cfg.run_dir).absolute()
        # A reference run resumes nothing: any run the run dir holds is refused, whatever its
        # config.
        action = run_dir_action(run_dir, None, overwrite=overwrite, resumable=False)
        cfg = fitted_config(cfg)
        check_task(cfg)
        if action is Action.OVERWRITE:
            delete_run(run_dir, RUN_FILES)
        show = (
            (lambda p: print(progress_line(p, cfg.token_budget), flush=True)) if progress else None
        )
        summary, params = reference_run(cfg, progress=show)
        dump_config(cfg, run_dir / "config.json")
        write_json(run_dir / "summary.json", summary)
        return Result(json.loads(json.dumps(summary)), run_dir, cfg, params)


def train(
    task: str | TaskFactory | None = None,
    config: RunConfig | str | Path | Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> Result:
    """`Trainer(task, config, ...).fit()`; `address`/`progress`/`resume`/`overwrite` go to
    `fit`."""
    fit_keys = ("address", "progress", "resume", "overwrite")
    fit_args = {k: kwargs.pop(k) for k in fit_keys if k in kwargs}
    return Trainer(task, config, **kwargs).fit(**fit_args)


def simulate(
    task: str | TaskFactory | None = None,
    config: RunConfig | str | Path | Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> Result:
    """`Trainer(task, config, ...).simulate()`; `progress`/`overwrite` go to `simulate`."""
    sim_args = {k: kwargs.pop(k) for k in ("progress", "overwrite") if k in kwargs}
    return Trainer(task, config, **kwargs).simulate(**sim_args)
