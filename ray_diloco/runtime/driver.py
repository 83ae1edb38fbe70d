"""Layer: runtime (Ray shell; the driver process). `run_training`: one training run on Ray.

Connects to Ray first (`address`, else `RAY_ADDRESS`, else an embedded local Ray sized for the run),
writes `run_dir/config.json`, gets or creates the named detached synchronizer (every shard of it,
runtime/synchronizer/shards.py) and creates the run's supervisor (runtime/supervisor/actor.py),
which starts, watches and restarts the learner groups, injects chaos and records the event tape
`events.jsonl`. The driver then only watches: every `metrics.log_every_s` it reads both statuses,
makes a progress point of them (`observe/progress.py`: tokens, rates, ETA, loss, rounds, goodput,
uptime, every learner's state), appends it to `metrics.jsonl` and hands it to its `progress`
callback (the CLI's display; the library prints nothing). At the token budget it has the supervisor
stop the learners, evaluates the global parameters once more, writes `summary.json`, shuts the
supervisor down (learners killed, placement groups released) and (unless told to keep it) the
synchronizer, and writes the run report (`report.html` and its pictures, `observe/run_report.py`).
The driver computes nothing: everything that computes runs in the actors, except `check_task`, one
training step of the task before any actor starts (after Ray, as JAX must start after Ray's
processes fork).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import ray

from ray_diloco.config import ConfigError, RunConfig, check_output_dir, config_digest, dump_config
from ray_diloco.control.events import Event
from ray_diloco.control.protocol import (
    SupervisorStatus,
    SynchronizerStatus,
)
from ray_diloco.control.run_dir import Action, delete_run, run_dir_action
from ray_diloco.control.tape import read_tape
from ray_diloco.observe.progress import ProgressTracker
from ray_diloco.observe.report import write_json
from ray_diloco.observe.run_report import RUN_FILES, write_report
from ray_diloco.observe.telemetry import Telemetry
from ray_diloco.runtime.connect import connect
from ray_diloco.runtime.learner.compile_cache import use_compilation_cache
from ray_diloco.runtime.learner.group import regions_are_labelled
from ray_diloco.runtime.summary import run_summary
from ray_diloco.runtime.supervisor.actor import create_supervisor, supervisor_name
from ray_diloco.runtime.synchronizer.launch import create_synchronizer
from ray_diloco.runtime.synchronizer.shards import ShardSet

logger = logging.getLogger(__name__)

EMBEDDED_OBJECT_STORE_BYTES = 300 * 10**6
SCALE_HEADROOM_CPUS = 2  # an embedded Ray's room for learners added to the running job
# An embedded Ray has one node, so declaring it dead can only end the run. Ray's defaults (a
# 10 s answer, 5 misses) did that to a one-node test Ray whose raylet was starved at start on a
# busy 2-core machine; here the node gets 30 s to answer each check and 20 misses (~10 min).
ONE_NODE_HEALTH_CHECKS = {"health_check_timeout_ms": 30_000, "health_check_failure_threshold": 20}
# On a busy machine an embedded Ray's node can fail to start: its raylet waits 15 s (hard-coded
# in Ray 2.60) for the dashboard agent to write its port, then exits, and `ray.init` gives up
# 30 s later with this message (measured on 2 cores beside two busy processes and a chaos test:
# the agent's Python took 25 s to start). Nothing has run yet, so starting again is safe.
NODE_START_TIMED_OUT = "timed out during startup"
EMBEDDED_START_ATTEMPTS = 3
SYNC_START_TIMEOUT_S = 600.0  # building data and parameters on a busy laptop
STOP_TIMEOUT_S = 60.0
NO_EVENTS = 2**62  # a journal sequence number beyond any: status without the event list

Progress = Callable[[dict[str, Any]], None]
StopWhen = Callable[[SupervisorStatus], str | None]


def run_training(
    cfg: RunConfig,
    address: str | None = None,
    stop_synchronizer: bool = True,
    progress: Progress | None = None,
    stop_when: StopWhen | None = None,
    dashboard: bool = False,
    resume: bool = False,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Train `cfg` on Ray to its token budget; returns the summary (also in summary.json).
    `progress(point)` gets every progress point (`observe/progress.py`);
    `stop_when(supervisor_status)` may end the run earlier by returning a reason (benchmarks stop
    once their faults played
    out); `dashboard` starts the Ray dashboard with an embedded local Ray. An unfinished run of
    this config in `run_dir` resumes (`resume` insists on it); a finished run or another
    config's raises a ConfigError unless `overwrite` (`control/run_dir.py`)."""
    check_output_dir(cfg.run_dir, "run_dir")  # before Ray starts or anything is written
    run_dir = Path(cfg.run_dir).absolute()
    # What needs no config digest is refused before Ray starts (a finished run, nothing to
    # resume); the digest is the fitted config's, known once the task was built (below).
    run_dir_action(run_dir, None, resume, overwrite)
    embedded, dashboard_url = _connect(cfg, address, dashboard)
    try:
        # Before any actor starts: a task that cannot be built, fragmented or trained ends
        # the run here with one error line (JAX in the driver, after Ray has started).
        from ray_diloco.algorithm.setup import check_task, fitted_config

        # The run's compilation cache, as its actors use it: `check_task` compiles a train
        # step and an evaluation (8.9 s on 2 cores beside a busy process, 2.7 s loaded from
        # the cache), which a rerun or a resumed run of this run dir then loads.
        use_compilation_cache(cfg)
        cfg = fitted_config(cfg).model_copy(update={"run_dir": str(run_dir)})  # (any cwd)
        action = run_dir_action(run_dir, config_digest(cfg), resume, overwrite)
        logger.info("task checked: %s", check_task(cfg))
        elapsed_s = _prepare_run_dir(cfg, run_dir, action)
        dump_config(cfg, run_dir / "config.json")
        run = _Run(cfg, progress or _quiet, stop_when, elapsed_s, dashboard_url)
        return run.execute(stop_synchronizer or embedded)
    finally:
        if embedded:
            ray.shutdown()


def _quiet(point: dict[str, Any]) -> None:
    pass


def _connect(cfg: RunConfig, address: str | None, dashboard: bool) -> tuple[bool, str | None]:
    """Connect to Ray; returns whether an embedded local Ray was started here, and the
    address of the Ray dashboard if there is one."""
    if ray.is_initialized():
        return False, None
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        logger.info("connecting to Ray at %s", address)
        context = connect(address, cfg.synchronizer.namespace)
        return False, _url(context.dashboard_url)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    joins = [c.join for c in cfg.elastic.schedule if c.join is not None]
    cpus = sum(max(1, round(lg.cpus_per_host)) * lg.num_hosts for lg in (*cfg.learners, *joins))
    cpus += 1 + SCALE_HEADROOM_CPUS  # the synchronizer's side, and room to `ray-diloco scale`
    logger.info("starting an embedded local Ray with %d CPUs", cpus)
    context = _start_embedded(
        num_cpus=cpus,
        object_store_memory=EMBEDDED_OBJECT_STORE_BYTES,
        include_dashboard=dashboard,
        namespace=cfg.synchronizer.namespace,
    )
    return True, _url(context.dashboard_url) if dashboard else None


def _start_embedded(**init_args: Any) -> Any:
    """`ray.init` of a fresh local Ray, started again (up to `EMBEDDED_START_ATTEMPTS` in all)
    when its node never registers; a failed attempt's processes (its GCS, dashboard, monitors)
    are stopped first instead of living on until the driver exits."""

    def init() -> Any:
        return ray.init(
            address="local",  # never a stale cluster from /tmp/ray/ray_current_cluster
            _system_config=dict(ONE_NODE_HEALTH_CHECKS),  # Ray adds its own keys to it
            **init_args,
        )

    for attempt in range(2, EMBEDDED_START_ATTEMPTS + 1):
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        try:
            return init()
        except Exception as err:  # Ray raises a bare Exception when its node never registers
            if NODE_START_TIMED_OUT not in str(err):
                raise
            logger.warning(
                "the embedded local Ray did not come up (%s); starting it again (%d of %d)",
                err,
                attempt,
                EMBEDDED_START_ATTEMPTS,
            )
            started = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
            for proc in started:
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.kill()
            psutil.wait_procs(started, timeout=10)
    return init()


def _url(address: str | None) -> str | None:
    if not address:
        return None
    return address if "://" in address else f"http://{address}"


def _prepare_run_dir(cfg: RunConfig, run_dir: Path, action: Action) -> float:
    """Make `run_dir` writable and do `action` with it; returns the run time its event tape
    already holds (0 for a new run; a resumed run's clock goes on from there)."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".writable"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise ConfigError(
            f"run_dir={cfg.run_dir}: not writable ({err}); pick another run_dir"
        ) from None
    if action is Action.OVERWRITE:
        logger.warning("run_dir %s: deleting the run it holds (--overwrite)", run_dir)
        delete_run(run_dir, RUN_FILES)
    elif action is Action.RESUME:
        logger.info("run_dir %s: resuming the unfinished run of this config", run_dir)
    return max((e.t for e in _read_tape(run_dir)), default=0.0)


def _read_tape(run_dir: Path) -> list[Event]:
    path = run_dir / "events.jsonl"
    return read_tape(path) if path.exists() else []


class _Run:
    def __init__(
        self,
        cfg: RunConfig,
        progress: Progress,
        stop_when: StopWhen | None,
        elapsed_s: float,
        dashboard_url: str | None,
    ) -> None:
        self.cfg, self.progress, self.stop_when = cfg, progress, stop_when
        self.run_dir = Path(cfg.run_dir)
        # The run clock of a resumed run goes on where its tape stopped: the tape stays one
        # time line (goodput and uptime over every session; the gap between them is not run
        # time, the new session's boot is).
        self.t0 = time.time() - elapsed_s
        self.sync: ShardSet | None = None
        self.sup: Any = None
        self.done = False
        regions = {lg.name: lg.region for lg in cfg.learners}
        from ray_diloco.algorithm.setup import learning_rate, task_of  # (JAX after Ray)

        lr_at = learning_rate(cfg, task_of(cfg))  # the task `check_task` built: cached
        speeds = {lg.name: lg.speed for lg in cfg.learners}
        self.tracker = ProgressTracker(cfg.token_budget, regions, dashboard_url, lr_at, speeds)
        self.telemetry = Telemetry(cfg, self.run_dir, self.t0)

    def execute(self, stop_synchronizer: bool) -> dict[str, Any]:
        log_level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        try:
            self.sync = ShardSet(self.cfg, create_synchronizer(self.cfg, log_level))
            pin = regions_are_labelled()
            if not pin and any(lg.region != "local" for lg in self.cfg.learners):
                logger.info("no node has a region label: regions only select emulated links")
            digest = config_digest(self.cfg)
            handles = self.sync.handles
            self.sup = create_supervisor(self.cfg, self.t0, handles, log_level, pin, digest)
            # Learner processes boot (import JAX, load data) while the synchronizer builds;
            # they register with it once it is up.
            ray.get(self.sup.start.remote(), timeout=SYNC_START_TIMEOUT_S)
            self._check_synchronizer()
            return self._finish(self._watch())
        finally:
            self.telemetry.close()
            self._teardown(stop_synchronizer)
            self._report()

    def _t(self) -> float:
        return time.time() - self.t0

    def _check_synchronizer(self) -> None:
        """Wait for the synchronizer and make sure it serves this run."""
        s = self.cfg.synchronizer
        assert self.sync is not None
        logger.info("waiting for the synchronizer %s/%s to start", s.namespace, s.name)
        try:
            st = self.sync.status(NO_EVENTS, SYNC_START_TIMEOUT_S)
        except ray.exceptions.RayActorError as err:
            raise RuntimeError(f"the synchronizer {s.name!r} could not start: {err}") from err
        if st.config_digest != config_digest(self.cfg) or st.finished:
            what = "finished its run" if st.finished else "runs another config"
            raise RuntimeError(
                f"a synchronizer named {s.name!r} in namespace {s.namespace!r} already exists "
                f"and {what} (run {st.run!r}); remove it with `ray kill-actor --name {s.name} "
                f"--namespace {s.namespace} --force --no-restart` or set synchronizer.name"
            )

    def _watch(self) -> str:
        """Log progress until the budget is spent, every learner was given up, or the
        caller's `stop_when` says so."""
        while True:
            time.sleep(self.cfg.metrics.log_every_s)
            st, sup = self._poll()
            if st.finished:
                return "token budget reached"
            if st.merge_error:
                logger.error("the synchronizer cannot merge: %s", st.merge_error)
                return f"the synchronizer cannot merge ({st.merge_error})"
            if sup.all_gave_up:
                # The learners stop at the budget too: a shard answering late (being restored)
                # can make the synchronizer's answer older than the supervisor's. Ask again.
                assert self.sync is not None
                if self.sync.status(NO_EVENTS, 120).finished:
                    return "token budget reached"
                logger.error("every learner was given up before the token budget")
                return "every learner gave up"
            why = self.stop_when(sup) if self.stop_when is not None else None
            if why:
                return why

    def _poll(self) -> tuple[SynchronizerStatus, SupervisorStatus]:
        """The synchronizer's and the supervisor's status; one progress point from both."""
        assert self.sync is not None
        st = self.sync.status(NO_EVENTS, 120)
        sup: SupervisorStatus = ray.get(self.sup.status.remote(), timeout=120)
        point = self.tracker.point(self._t(), st, sup)
        with open(self.run_dir / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps(point) + "\n")
        self.telemetry.write(point)
        self.progress(point)
        return st, sup

    def _report(self) -> None:
        """The run report, finished or not (an interrupted run's is worth reading too)."""
        try:
            path = write_report(self.run_dir)
        except Exception:  # the run's own files are written: a failed picture must not hide it
            logger.exception("writing the run report of %s", self.run_dir)
        else:
            logger.info("run report: %s", path)

    def _finish(self, reason: str) -> dict[str, Any]:
        """Stop the learners (through the supervisor), evaluate once more, write the summary."""
        assert self.sync is not None
        over = self.sync.status(NO_EVENTS, 120).finished  # the learners hand in their work
        ray.get(self.sup.finish.remote(reason, over), timeout=60)
        deadline = time.monotonic() + 2 * STOP_TIMEOUT_S
        while not (sup := ray.get(self.sup.status.remote(), timeout=120)).done:
            if time.monotonic() > deadline:
                logger.warning("the supervisor did not stop the learners in time")
                break
            logger.info("waiting for the supervisor to stop the learners")
            time.sleep(0.2)
        self.done = True
        at_budget: tuple[SynchronizerStatus, float] | None = None
        if self.cfg.diloco.final_rounds and over:
            # The global model as the budget left it, then with the learners' last work (a
            # run stopped for another reason, a failing merge among them, ends as it stands).
            at_budget = self.sync.status(NO_EVENTS, 120), self.sync.evaluate(300)
            merged = self.sync.final_rounds(120)
            logger.info("final rounds: %d merged the learners' last work", merged)
        loss = self.sync.evaluate(300)
        # The final rounds and the evaluations after the learners stopped, onto the tape.
        ray.get(self.sup.record_last_events.remote(), timeout=120)
        st, _ = self._poll()
        summary = run_summary(self.cfg, st, sup, loss, self.t0)
        if at_budget is not None:
            before, loss_before = at_budget
            summary["final_rounds"] = {
                "rounds": st.rounds - before.rounds,
                "heldout_loss_before": loss_before,
                "merged_share_before": before.merged_share(),
            }
        summary["stop_reason"] = reason
        write_json(self.run_dir / "summary.json", summary)
        return summary

    def _teardown(self, stop_synchronizer: bool) -> None:
        if self.sup is not None:
            try:
                # Kills every learner, frees the placement groups, closes the event tape.
                ray.get(self.sup.shutdown.remote(), timeout=120)
            except Exception:
                logger.exception("shutting down the supervisor")
            ray.kill(self.sup, no_restart=True)
            _wait_name_released(supervisor_name(self.cfg), self.cfg.synchronizer.namespace)
        if self.sync is None:
            return
        s = self.cfg.synchronizer
        try:
            if stop_synchronizer:
                self.sync.shutdown(120)
                self.sync.kill()
                for name in self.sync.names():
                    _wait_name_released(name, s.namespace)
            else:
                self.sync.checkpoint(120)
                logger.warning("synchronizer %s/%s left running (detached)", s.namespace, s.name)
        except Exception:
            logger.exception("shutting down the synchronizer %s/%s", s.namespace, s.name)


def _wait_name_released(name: str, namespace: str, timeout_s: float = 10.0) -> None:
    """ray.kill is asynchronous: wait until the name is free, so the next run creates a
    fresh actor instead of getting the dying one."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:
            return
        time.sleep(0.1)
    logger.warning("actor %s/%s still registered %.0f s after kill", namespace, name, timeout_s)
