"""Layer: runtime. The run's Prometheus metrics, a thin registry over `ray.util.metrics`.

Every name is prefixed `diloco_`; Ray exports them as `ray_diloco_*` (counters with a `_total`
suffix, histograms as `_bucket`/`_sum`/`_count`) on each node's metrics export port, so the Ray
dashboard's Grafana, our dashboard (`monitoring/grafana/ray_diloco.json`, built by
`ray_diloco/observe/grafana.py`) and any Prometheus scraping the cluster see them. Every series
carries the run's name (`run`); other tags are few and of low cardinality (learner names, a region,
a direction, a reason, a failure kind); round, fragment and version numbers are never tags.

Who records what: learners (host 0) tokens, step time and training loss; the synchronizer
rounds, contributors, grace windows, staleness, merge time, its memory, link bytes, held-out
loss and rejections; the supervisor goodput, uptime, which learners are up, and from its event
tape restarts, detection and recovery seconds by failure kind (`observe_event`).

`Metrics.create(enabled, run)` returns a recorder whose methods are no-ops when metrics are
disabled or Ray is not initialised in this process, so algorithm-level callers and unit tests
need no Ray. Importing this module never imports ray; Ray metric objects are made per process
(each actor calls `Metrics.create` itself).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Literal

from ray_diloco.control.events import (
    Event,
    FailureDetected,
    FailureKind,
    LearnerRejoined,
    LearnerRestarted,
)

logger = logging.getLogger(__name__)

PREFIX = "diloco_"
RUN_TAG = "run"
# Ray (2.60) exports a histogram's `_sum` as the sum of its bucket midpoints, not of the values
# observed: counts (contributors, versions) get half-integer boundaries so that every integer is
# a midpoint and means from `_sum / _count` are exact; seconds get buckets fine enough for a
# mean within about 20%.
_SECONDS = (0.25, 0.5, 1, 1.5, 2, 3, 5, 7.5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 300, 600)
_COUNTS = (0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 7.5, 8.5, 12.5, 16.5, 32.5)

# name -> (kind, description, tag keys besides `run`, histogram boundaries)
SPECS: dict[str, tuple[str, str, tuple[str, ...], tuple[float, ...]]] = {
    "tokens": ("counter", "Training tokens consumed by a learner", ("learner",), ()),
    "inner_step_seconds": (
        "histogram",
        "Wall time of one inner step",
        ("learner",),
        (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
    ),
    "training_loss": ("gauge", "Training loss of a learner's last inner step", ("learner",), ()),
    "outer_rounds": ("counter", "Closed outer rounds (all fragments)", (), ()),
    "contributors_per_round": (
        "histogram",
        "Contributions merged in one round",
        (),
        _COUNTS,
    ),
    "grace_window_seconds": (
        "histogram",
        "Grace window a round allowed after reaching quorum",
        (),
        (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0),
    ),
    "staleness_versions": (
        "histogram",
        "Versions between a contribution's base and the global version",
        (),
        _COUNTS,
    ),
    "merge_seconds": (
        "histogram",
        "Wall time of one merge and outer step in the synchronizer",
        (),
        (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    ),
    "synchronizer_memory_bytes": (
        "gauge",
        "Resident memory of the synchronizer process",
        (),
        (),
    ),
    "link_bytes": (
        "counter",
        "Bytes moved between a learner and the synchronizer",
        ("learner", "region", "direction"),
        (),
    ),
    "merged_share": (
        "gauge",
        "Share of a learner's trained tokens whose work reached the global model, over the "
        "fragments of one synchronizer shard",
        ("learner", "shard"),
        (),
    ),
    "heldout_loss": ("gauge", "Held-out loss of the global model", (), ()),
    "global_version": ("gauge", "Version of the fragment published last", (), ()),
    "live_learners": ("gauge", "Learners the synchronizer counts as live", (), ()),
    "contributions_rejected": (
        "counter",
        "Contributions rejected (stale, non-finite, norm guard, ...)",
        ("learner", "reason"),
        (),
    ),
    "learner_up": (
        "gauge",
        "1 while a learner is up (compiling, training, waiting for fragments), else 0",
        ("learner",),
        (),
    ),
    "goodput": ("gauge", "Productive learner time over allocated learner time so far", (), ()),
    "uptime": ("gauge", "Fraction of the run in which the global model advanced", (), ()),
    "learner_restarts": (
        "counter",
        "Learner restarts by the failure that caused them",
        ("learner", "failure"),
        (),
    ),
    "detection_seconds": (
        "histogram",
        "Seconds from a learner failure to its detection",
        ("failure",),
        _SECONDS,
    ),
    "recovery_seconds": (
        "histogram",
        "Seconds from a failure's detection until the restarted learner contributed again",
        ("failure",),
        _SECONDS,
    ),
}


def _ray_ready() -> bool:
    # Ray can only be initialised in this process if it was imported already; checking
    # sys.modules keeps `import ray` out of unit tests and algorithm code.
    ray = sys.modules.get("ray")
    return bool(ray is not None and ray.is_initialized())


class Metrics:
    """Records the run's metrics; every method is a no-op when disabled."""

    def __init__(self, objects: dict[str, Any] | None = None) -> None:
        self._m = objects or {}
        self._failing: dict[str, str] = {}  # learner -> failure kind it is recovering from

    @classmethod
    def create(cls, enabled: bool, run: str) -> Metrics:
        """A live recorder tagged `run=<run>` when `enabled` and Ray is initialised here, else
        a no-op one."""
        if not enabled or not _ray_ready():
            return cls()
        from ray.util import metrics as rm

        objects: dict[str, Any] = {}
        for short, (kind, desc, tags, bounds) in SPECS.items():
            name, keys = PREFIX + short, (RUN_TAG, *tags)
            metric: Any
            if kind == "counter":
                metric = rm.Counter(name, description=desc, tag_keys=keys)
            elif kind == "gauge":
                metric = rm.Gauge(name, description=desc, tag_keys=keys)
            else:
                metric = rm.Histogram(
                    name, description=desc, boundaries=list(bounds), tag_keys=keys
                )
            objects[short] = metric.set_default_tags({RUN_TAG: run})
        return cls(objects)

    @property
    def enabled(self) -> bool:
        return bool(self._m)

    def _do(self, short: str, method: str, value: float, tags: dict[str, str] | None) -> None:
        metric = self._m.get(short)
        if metric is None or (method == "inc" and value <= 0):  # Ray counters reject <= 0
            return
        getattr(metric, method)(float(value), tags=tags)  # float(): numpy scalars are refused

    # -- learners -----------------------------------------------------------------------------

    def tokens(self, learner: str, n: int) -> None:
        self._do("tokens", "inc", n, {"learner": learner})

    def step_time(self, learner: str, seconds: float) -> None:
        self._do("inner_step_seconds", "observe", seconds, {"learner": learner})

    def training_loss(self, learner: str, loss: float) -> None:
        self._do("training_loss", "set", loss, {"learner": learner})

    # -- the synchronizer ---------------------------------------------------------------------

    def outer_round(self) -> None:
        self._do("outer_rounds", "inc", 1, None)

    def contributors(self, n: int) -> None:
        self._do("contributors_per_round", "observe", n, None)

    def grace_window(self, seconds: float) -> None:
        self._do("grace_window_seconds", "observe", seconds, None)

    def staleness(self, versions: int) -> None:
        self._do("staleness_versions", "observe", versions, None)

    def merge_time(self, seconds: float) -> None:
        self._do("merge_seconds", "observe", seconds, None)

    def synchronizer_memory(self, nbytes: int) -> None:
        self._do("synchronizer_memory_bytes", "set", nbytes, None)

    def link_bytes(
        self, learner: str, region: str, direction: Literal["up", "down"], n: int
    ) -> None:
        tags = {"learner": learner, "region": region, "direction": direction}
        self._do("link_bytes", "inc", n, tags)

    def merged_share(self, learner: str, shard: int, share: float) -> None:
        self._do("merged_share", "set", share, {"learner": learner, "shard": str(shard)})

    def heldout_loss(self, loss: float) -> None:
        self._do("heldout_loss", "set", loss, None)

    def global_version(self, version: int) -> None:
        self._do("global_version", "set", version, None)

    def live_learners(self, n: int) -> None:
        self._do("live_learners", "set", n, None)

    def contribution_rejected(self, learner: str, reason: str) -> None:
        self._do("contributions_rejected", "inc", 1, {"learner": learner, "reason": reason})

    # -- the supervisor -----------------------------------------------------------------------

    def learner_up(self, learner: str, up: bool) -> None:
        self._do("learner_up", "set", 1.0 if up else 0.0, {"learner": learner})

    def goodput(self, goodput: float, uptime: float | None) -> None:
        self._do("goodput", "set", goodput, None)
        if uptime is not None:  # None until the first round: no sample beats a false 0
            self._do("uptime", "set", uptime, None)

    def observe_event(self, event: Event) -> None:
        """Restarts, detection and recovery seconds by failure kind, from a tape event (the
        kind a restart or rejoin belongs to is that of the learner's last detected failure,
        as `control.goodput` attributes recovery times)."""
        if isinstance(event, FailureDetected):
            kind = FailureKind(event.failure).value
            self._failing[event.learner] = kind
            self._do("detection_seconds", "observe", event.detection_s, {"failure": kind})
        elif isinstance(event, LearnerRestarted):
            kind = self._failing.get(event.learner, "unknown")
            self._do("learner_restarts", "inc", 1, {"learner": event.learner, "failure": kind})
        elif isinstance(event, LearnerRejoined) and event.learner in self._failing:
            kind = self._failing.pop(event.learner)
            self._do("recovery_seconds", "observe", event.recovered_in_s, {"failure": kind})
