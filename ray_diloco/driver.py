"""Layer: actors (Ray shell; the driver process). `run_training`: one training run on Ray.

Connects to Ray first (`address`, else `RAY_ADDRESS`, else an embedded local Ray sized for the
run), writes `run_dir/config.json`, gets or creates the named detached synchronizer, starts the
learner groups, and then only watches: every `metrics.log_every_s` it reads the synchronizer's
status, prints a progress line, appends it to `metrics.jsonl` and moves new events (rounds,
rejections, learner state changes) onto the event tape `events.jsonl`. At the token budget it
stops the learners, evaluates the global parameters once more, writes `summary.json`, releases
the placement groups and (unless told to keep it) shuts the synchronizer down. The driver never
imports JAX: everything that computes runs in the actors.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from ray_diloco.actors.learner_group import LearnerGroup, regions_are_labelled
from ray_diloco.actors.sync_restore import checkpoint_dir
from ray_diloco.actors.synchronizer import config_digest, get_or_create_synchronizer
from ray_diloco.config import ConfigError, RunConfig, dump_config
from ray_diloco.control.events import (
    Event,
    LearnerState,
    LearnerStateChanged,
    RunFinished,
    RunStarted,
    SynchronizerRestored,
    event_from_dict,
)
from ray_diloco.control.goodput import compute_goodput
from ray_diloco.control.tape import EventTape
from ray_diloco.report import progress_line, write_json

logger = logging.getLogger(__name__)

EMBEDDED_OBJECT_STORE_BYTES = 300 * 10**6
SYNC_START_TIMEOUT_S = 600.0  # building data and parameters on a busy laptop
STOP_TIMEOUT_S = 60.0
RUN_FILES = ("summary.json", "metrics.jsonl", "events.jsonl")

Progress = Callable[[str], None]


def print_progress(line: str) -> None:
    print(line, flush=True)  # the CLI's live display; the only print of the library


def run_training(
    cfg: RunConfig,
    address: str | None = None,
    stop_synchronizer: bool = True,
    progress: Progress = print_progress,
) -> dict[str, Any]:
    """Train `cfg` on Ray to its token budget; returns the summary (also in summary.json)."""
    embedded = _connect(cfg, address)
    try:
        run_dir = _prepare_run_dir(cfg)
        cfg = cfg.model_copy(update={"run_dir": str(run_dir)})  # actors may have another cwd
        dump_config(cfg, run_dir / "config.json")
        return _Run(cfg, progress).execute(stop_synchronizer or embedded)
    finally:
        if embedded:
            ray.shutdown()


def _connect(cfg: RunConfig, address: str | None) -> bool:
    """Connect to Ray; returns True when an embedded local Ray was started here."""
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        logger.info("connecting to Ray at %s", address)
        ray.init(address=address, namespace=cfg.synchronizer.namespace)
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    cpus = sum(max(1, round(lg.cpus_per_host)) * lg.num_hosts for lg in cfg.learners) + 1
    logger.info("starting an embedded local Ray with %d CPUs", cpus)
    ray.init(
        address="local",  # never a stale cluster from /tmp/ray/ray_current_cluster
        num_cpus=cpus,
        object_store_memory=EMBEDDED_OBJECT_STORE_BYTES,
        include_dashboard=False,
        namespace=cfg.synchronizer.namespace,
    )
    return True


def _prepare_run_dir(cfg: RunConfig) -> Path:
    run_dir = Path(cfg.run_dir).absolute()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".writable"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise ConfigError(
            f"run_dir={cfg.run_dir}: not writable ({err}); pick another run_dir"
        ) from None
    if (run_dir / "summary.json").exists() and not _synchronizer_alive(cfg):
        # A finished run is not resumed: start afresh. (A run dir without summary.json is an
        # interrupted run: the synchronizer resumes from its checkpoint.)
        logger.warning("run_dir %s holds a finished run; replacing it", run_dir)
        shutil.rmtree(checkpoint_dir(cfg.model_copy(update={"run_dir": str(run_dir)})), True)
        for name in RUN_FILES:
            (run_dir / name).unlink(missing_ok=True)
    return run_dir


def _synchronizer_alive(cfg: RunConfig) -> bool:
    try:
        ray.get_actor(cfg.synchronizer.name, namespace=cfg.synchronizer.namespace)
    except ValueError:
        return False
    return True


class _Run:
    def __init__(self, cfg: RunConfig, progress: Progress) -> None:
        self.cfg, self.progress = cfg, progress
        self.run_dir = Path(cfg.run_dir)
        self.t0 = time.time()
        self.tape = EventTape(self.run_dir / "events.jsonl")
        self.groups: list[LearnerGroup] = []
        self.sync: Any = None
        self.event_seq = 0
        self.last_rounds = 0
        self.rates: dict[str, tuple[float, int]] = {}  # learner -> (time, step) last seen
        self.last_tokens = 0
        self.restored_at: float | None = None

    def execute(self, stop_synchronizer: bool) -> dict[str, Any]:
        log_level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        self.tape.append(RunStarted(0.0, config_digest(self.cfg)))
        reason = "error"
        try:
            self.sync = get_or_create_synchronizer(self.cfg, log_level)
            # Learner processes boot (import JAX, load data) while the synchronizer builds.
            pin = regions_are_labelled()
            if not pin and any(lg.region != "local" for lg in self.cfg.learners):
                logger.info("no node has a region label: regions only select emulated links")
            for i in range(self.cfg.num_learners):
                group = LearnerGroup(self.cfg, i, log_level=log_level, pin_region=pin)
                self.groups.append(group)
                group.create()
            self._check_synchronizer()
            for group in self.groups:
                group.start()
            reason = self._watch()
            return self._finish(reason)
        finally:
            self._teardown(stop_synchronizer)
            self.tape.append(RunFinished(self._t(), self.last_tokens, reason))
            self.tape.close()

    def _t(self, wall: float | None = None) -> float:
        return (time.time() if wall is None else wall) - self.t0

    def _check_synchronizer(self) -> None:
        """Wait for the synchronizer and make sure it serves this run."""
        s = self.cfg.synchronizer
        logger.info("waiting for the synchronizer %s/%s to start", s.namespace, s.name)
        try:
            st = ray.get(self.sync.status.remote(), timeout=SYNC_START_TIMEOUT_S)
        except ray.exceptions.RayActorError as err:
            raise RuntimeError(f"the synchronizer {s.name!r} could not start: {err}") from err
        if st["config_digest"] != config_digest(self.cfg) or st["finished"]:
            what = "finished its run" if st["finished"] else "runs another config"
            raise RuntimeError(
                f"a synchronizer named {s.name!r} in namespace {s.namespace!r} already exists "
                f"and {what} (run {st['run']!r}); remove it with `ray kill-actor --name {s.name} "
                f"--namespace {s.namespace} --force --no-restart` or set synchronizer.name"
            )

    def _watch(self) -> str:
        """Log progress until the synchronizer says the budget is spent (or nobody trains)."""
        while True:
            time.sleep(self.cfg.metrics.log_every_s)
            st = self._poll()
            if st["finished"]:
                return "token budget reached"
            learners = [g.status() for g in self.groups]
            self._record_learners(learners)
            if all(not ls["alive"] or ls["state"] in ("finished", "dead") for ls in learners):
                logger.error("every learner stopped before the token budget")
                return "all learners stopped"

    def _poll(self) -> dict[str, Any]:
        st: dict[str, Any] = ray.get(self.sync.status.remote(self.event_seq), timeout=120)
        self.event_seq = st["event_seq"]
        for e in st["events"]:
            self.tape.append(_rebased(event_from_dict(e), self.t0))
        restored = st["restored"]
        if restored and restored["time"] != self.restored_at:  # a (re)start from a checkpoint
            self.restored_at = restored["time"]
            lost = max(0, self.last_rounds - restored["rounds"])  # rounds this driver saw
            versions = {int(p): v for p, v in restored["versions"].items()}
            self.tape.append(SynchronizerRestored(self._t(restored["time"]), versions, lost))
        self.last_rounds, self.last_tokens = st["rounds"], st["tokens"]
        point = self._point(st)
        self.progress(progress_line(point, self.cfg.token_budget))
        with open(self.run_dir / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps(point) + "\n")
        return st

    def _point(self, st: dict[str, Any]) -> dict[str, Any]:
        t = self._t()
        rates = {}
        for name, ls in st["learners"].items():
            t_prev, step_prev = self.rates.get(name, (self.t0, 0))
            rates[name] = (ls["step"] - step_prev) / max(1e-9, time.time() - t_prev)
            self.rates[name] = (time.time(), ls["step"])
        return {
            "t": t,
            "tokens": st["tokens"],
            "tokens_per_s": st["tokens"] / max(t, 1e-9),
            "heldout_loss": st["heldout_loss"],
            "rounds": st["rounds"],
            "contributors": st["mean_contributors"],
            "live": len(st["live"]),
            "step_rates": rates,
        }

    def _record_learners(self, statuses: list[dict[str, Any]]) -> None:
        for ls in statuses:
            for tr in ls["transitions"]:
                ev = LearnerStateChanged(
                    self._t(tr["time"]),
                    ls["learner"],
                    ls["incarnation"],
                    LearnerState(tr["state"]),
                    tr["reason"],
                )
                self.tape.append(ev)
            if ls.get("error") and ls.get("state") == "dead":
                logger.error("learner %s failed:\n%s", ls["learner"], ls["error"])

    def _finish(self, reason: str) -> dict[str, Any]:
        for g in self.groups:
            g.stop(STOP_TIMEOUT_S)
        final_learners = [g.status() for g in self.groups]
        self._record_learners(final_learners)
        loss = ray.get(self.sync.evaluate.remote(), timeout=300)
        st = self._poll()
        summary = _summary(self.cfg, st, final_learners, loss, self.t0)
        report = compute_goodput(self.tape.events, self._t(), _uptime_window(self.cfg, st))
        summary.update(goodput=report.goodput, uptime=report.uptime, stop_reason=reason)
        for name, acct in summary["learners"].items():
            if name in report.learners:  # seconds in each state, for step rates and goodput
                acct["seconds"] = report.learners[name].seconds
        write_json(self.run_dir / "summary.json", summary)
        return summary

    def _teardown(self, stop_synchronizer: bool) -> None:
        for g in self.groups:
            g.kill()
            g.release()
        if self.sync is None:
            return
        s = self.cfg.synchronizer
        try:
            if stop_synchronizer:
                ray.get(self.sync.shutdown.remote(), timeout=120)
                ray.kill(self.sync, no_restart=True)
                _wait_name_released(s.name, s.namespace)
            else:
                ray.get(self.sync.checkpoint.remote(), timeout=120)
                logger.warning("synchronizer %s/%s left running (detached)", s.namespace, s.name)
        except Exception:
            logger.exception("shutting down the synchronizer %s/%s", s.namespace, s.name)


def _wait_name_released(name: str, namespace: str, timeout_s: float = 10.0) -> None:
    """ray.kill is asynchronous: wait until the name is free, so the next run creates a
    fresh synchronizer instead of getting the dying one."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:
            return
        time.sleep(0.1)
    logger.warning(
        "synchronizer %s/%s still registered %.0f s after kill", namespace, name, timeout_s
    )


def _rebased(event: Event, t0: float) -> Event:
    return dataclasses.replace(event, t=event.t - t0)


def _uptime_window(cfg: RunConfig, st: dict[str, Any]) -> float:
    """Two sync periods of a fragment at the learners' mean step time."""
    times = [ls["step_time_s"] for ls in st["learners"].values() if ls["step_time_s"]]
    step = sum(times) / len(times) if times else 1.0
    return max(1.0, 2 * cfg.diloco.sync_every * step)


def _summary(
    cfg: RunConfig,
    st: dict[str, Any],
    learners: list[dict[str, Any]],
    loss: float,
    t0: float,
) -> dict[str, Any]:
    """The keys of `simulate.summarize_diloco` that apply, plus wall-clock measures."""
    tokens, wall_s = st["tokens"], time.time() - t0
    up, down = sum(st["bytes_up"].values()), sum(st["bytes_down"].values())
    tokens_per_dp_step = sum(lg.batch_size for lg in cfg.learners) * cfg.model.seq_len
    dp_per_token = 2 * 4 * st["num_params"] * cfg.num_learners / tokens_per_dp_step
    names = [lg.name for lg in cfg.learners]
    by_name = {ls["learner"]: ls for ls in learners}
    return {
        "mode": cfg.diloco.mode,
        "heldout_loss": loss,
        "num_params": st["num_params"],
        "evals": [{**e, "t": e["time"] - t0} for e in st["evals"]],
        "tokens": tokens,
        "rounds": st["rounds"],
        "mean_contributors": st["mean_contributors"],
        "bytes_up": up,
        "bytes_down": down,
        "bytes_total": up + down,
        "bytes_per_token": (up + down) / max(1, tokens),
        "dp_bytes_per_token": dp_per_token,
        "bytes_per_link": {
            n: {"up": st["bytes_up"].get(n, 0), "down": st["bytes_down"].get(n, 0)} for n in names
        },
        "rejected": st["rejected"],
        "ledger_violations": st["ledger_violations"],
        "wall_time_s": wall_s,
        "tokens_per_s": tokens / max(wall_s, 1e-9),
        "learners": {
            n: {
                "inner_steps": by_name.get(n, {}).get(
                    "step", st["learners"].get(n, {}).get("step")
                ),
                "tokens": st["learners"].get(n, {}).get("cursor", 0),
                "contributions_merged": st["contributions_merged"].get(n, 0),
                "state": by_name.get(n, {}).get("state"),
            }
            for n in names
        },
    }
