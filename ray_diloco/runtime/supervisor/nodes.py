"""Layer: runtime (Ray shell). Where learners can come from and why they must go: the
scavenger (a free node or slice that fits one of `elastic.templates` gets a learner), the
drain watch (learners on nodes Ray is draining, e.g. for a preemption, leave gracefully) and
the node check (a failed learner whose node Ray declared dead lost its node: no crash, no hang).

Both only observe the cluster and hand their findings to the supervisor, which carries the
joins and leaves out on its control loop.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from ray_diloco.config import LearnerGroupConfig, RunConfig
from ray_diloco.runtime import resources
from ray_diloco.runtime.errors import PlacementTimeoutError

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 1.0  # how long a template's placement may take to count as "free now"

Found = Callable[[LearnerGroupConfig, Any], bool]  # (learner, placement) -> accepted


def draining_nodes() -> set[str]:
    """Node ids Ray is draining (a preemption or a scale-down announced by the autoscaler,
    KubeRay or `ray drain-node`). Ray 2.60 exposes this only through its GCS state accessor
    (Ray Serve reads it the same way); an unreachable GCS reads as none."""
    import ray

    try:
        return set(ray._private.state.state.get_draining_nodes())
    except Exception as err:  # the GCS restarting: the next poll will know
        logger.debug("draining nodes unknown: %s", err)
        return set()


def lost_nodes(node_ids: Iterable[str]) -> set[str]:
    """Those of `node_ids` that the GCS reports dead or no longer knows; an unreachable GCS
    reads as none lost (the failure is then classified by what its caller saw)."""
    import ray

    wanted = set(node_ids)
    if not wanted:
        return set()
    try:
        alive = {str(n["NodeID"]) for n in ray.nodes() if n.get("Alive")}
    except Exception as err:
        logger.debug("node liveness unknown: %s", err)
        return set()
    return wanted - alive


class Scavenger:
    """Every `elastic.scavenge_interval_s`, tries to place each template (a placement group
    that must be ready within a second: only capacity that is free now counts) and hands every
    placement it gets to `found` with a fresh learner name, `<template>-<n>`."""

    def __init__(self, cfg: RunConfig, found: Found, taken: Callable[[str], bool]) -> None:
        self.cfg, self.found, self.taken = cfg, found, taken
        self._stop = threading.Event()
        self._numbers = {t.name: 0 for t in cfg.elastic.templates}  # the next to try
        self._thread = threading.Thread(target=self._run, name="scavenger", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop, and wait for a probe in flight: a placement group left pending by a probe
        would grab the next free node long after the run (it belongs to the job)."""
        self._stop.set()
        self._thread.join(timeout=10 * PROBE_TIMEOUT_S)

    def _name(self, template: LearnerGroupConfig) -> str:
        """The template's next free name; a number is used up only by a learner that joined."""
        while self.taken(name := f"{template.name}-{self._numbers[template.name]}"):
            self._numbers[template.name] += 1
        return name

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.elastic.scavenge_interval_s):
            for template in self.cfg.elastic.templates:
                try:
                    self._probe(template)
                except Exception:  # never let one bad probe end scavenging
                    logger.exception("scavenging for template %s", template.name)

    def _probe(self, template: LearnerGroupConfig) -> None:
        while not self._stop.is_set():
            lg = template.model_copy(update={"name": self._name(template)})
            try:
                placement = resources.reserve_learner_group(
                    lg, name_prefix=self.cfg.name, timeout_s=PROBE_TIMEOUT_S
                )
            except PlacementTimeoutError:
                return  # nothing free for this template now
            if not self.found(lg, placement):
                resources.release(placement)
                return
            logger.info("scavenged a placement for learner %s", lg.name)
