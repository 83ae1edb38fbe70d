"""Top level: the run's Prometheus metrics, a thin registry over `ray.util.metrics`.

Every name is prefixed `diloco_`; Ray exports them as `ray_diloco_*` (counters with a `_total`
suffix) on each node's metrics export port, so the Ray dashboard's Grafana and any Prometheus
scraping the cluster see them. Tags are few and of low cardinality (learner names, a direction,
a reason, a failure kind); round, fragment and version numbers are never tags.

`Metrics.create(enabled)` returns a recorder whose methods are no-ops when metrics are disabled
or Ray is not initialised in this process, so algorithm-level callers and unit tests need no Ray.
Importing this module never imports ray; Ray metric objects are made per process (each actor
calls `Metrics.create` itself).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Literal

logger = logging.getLogger(__name__)

PREFIX = "diloco_"

# name -> (kind, description, tag keys, histogram boundaries)
_SPECS: dict[str, tuple[str, str, tuple[str, ...], tuple[float, ...]]] = {
    "tokens": ("counter", "Training tokens consumed by a learner", ("learner",), ()),
    "inner_step_seconds": (
        "histogram",
        "Wall time of one inner step",
        ("learner",),
        (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
    ),
    "outer_rounds": ("counter", "Closed outer rounds (all fragments)", (), ()),
    "contributors_per_round": (
        "histogram",
        "Contributions merged in one round",
        (),
        (1, 2, 3, 4, 6, 8, 12, 16, 32),
    ),
    "grace_window_seconds": (
        "histogram",
        "Time a round waited after reaching quorum",
        (),
        (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0),
    ),
    "staleness_versions": (
        "histogram",
        "Versions between a contribution's base and the global version",
        (),
        (1, 2, 3, 4, 6, 8, 16),
    ),
    "link_bytes": (
        "counter",
        "Bytes moved between a learner and the synchronizer",
        ("learner", "direction"),
        (),
    ),
    "heldout_loss": ("gauge", "Held-out loss of the global model", (), ()),
    "global_version": ("gauge", "Highest global version published", (), ()),
    "live_learners": ("gauge", "Learners currently contributing", (), ()),
    "contributions_rejected": (
        "counter",
        "Contributions rejected (stale, non-finite, norm guard, ...)",
        ("reason",),
        (),
    ),
    "learner_restarts": (
        "counter",
        "Learner restarts by failure kind",
        ("learner", "failure"),
        (),
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

    @classmethod
    def create(cls, enabled: bool) -> Metrics:
        """A live recorder when `enabled` and Ray is initialised here, else a no-op one."""
        if not enabled or not _ray_ready():
            return cls()
        from ray.util import metrics as rm

        objects: dict[str, Any] = {}
        for short, (kind, desc, tags, bounds) in _SPECS.items():
            name = PREFIX + short
            if kind == "counter":
                objects[short] = rm.Counter(name, description=desc, tag_keys=tags)
            elif kind == "gauge":
                objects[short] = rm.Gauge(name, description=desc, tag_keys=tags)
            else:
                objects[short] = rm.Histogram(
                    name, description=desc, boundaries=list(bounds), tag_keys=tags
                )
        return cls(objects)

    @property
    def enabled(self) -> bool:
        return bool(self._m)

    def _do(self, short: str, method: str, value: float, tags: dict[str, str] | None) -> None:
        metric = self._m.get(short)
        if metric is None or (method == "inc" and value <= 0):  # Ray counters reject <= 0
            return
        getattr(metric, method)(float(value), tags=tags)  # float(): numpy scalars are refused

    def tokens(self, learner: str, n: int) -> None:
        self._do("tokens", "inc", n, {"learner": learner})

    def step_time(self, learner: str, seconds: float) -> None:
        self._do("inner_step_seconds", "observe", seconds, {"learner": learner})

    def outer_round(self) -> None:
        self._do("outer_rounds", "inc", 1, None)

    def contributors(self, n: int) -> None:
        self._do("contributors_per_round", "observe", n, None)

    def grace_window(self, seconds: float) -> None:
        self._do("grace_window_seconds", "observe", seconds, None)

    def staleness(self, versions: int) -> None:
        self._do("staleness_versions", "observe", versions, None)

    def link_bytes(self, learner: str, direction: Literal["up", "down"], n: int) -> None:
        self._do("link_bytes", "inc", n, {"learner": learner, "direction": direction})

    def heldout_loss(self, loss: float) -> None:
        self._do("heldout_loss", "set", loss, None)

    def global_version(self, version: int) -> None:
        self._do("global_version", "set", version, None)

    def live_learners(self, n: int) -> None:
        self._do("live_learners", "set", n, None)

    def contribution_rejected(self, reason: str) -> None:
        self._do("contributions_rejected", "inc", 1, {"reason": reason})

    def learner_restart(self, learner: str, failure: str) -> None:
        self._do("learner_restarts", "inc", 1, {"learner": learner, "failure": failure})
