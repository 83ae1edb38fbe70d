"""Layer: runtime (Ray shell). `LearnerGroup`: the driver-side handle of one learner's hosts.

A plain Python object (not an actor) used by the driver and, later, the supervisor: it reserves
the learner's placement group (`resources.reserve_learner_group`: a bundle per CPU host, or a
whole TPU slice), starts one `LearnerHost` actor per host on its bundle, and for learners with
several hosts wires them into one `jax.distributed` job (host 0's address and a free port as
the coordinator) before their loops start. It only carries out what it is told: start, status,
stop, kill, release.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray

from ray_diloco.config import ConfigError, LearnerGroupConfig, RunConfig
from ray_diloco.control.events import LOOP_ENDED, StopReason
from ray_diloco.control.protocol import HostStatus
from ray_diloco.runtime import resources
from ray_diloco.runtime.errors import classify_ray_error
from ray_diloco.runtime.learner.host import LearnerHost

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 30.0


class LearnerGroup:
    def __init__(
        self,
        cfg: RunConfig,
        lg: LearnerGroupConfig,
        index: int,
        *,
        incarnation: int = 0,
        log_level: str = "WARNING",
        name_prefix: str = "",
        pin_region: bool = True,
    ) -> None:
        self.cfg, self.index, self.incarnation = cfg, index, incarnation
        self.lg = lg
        self.pin_region = pin_region
        self.name = self.lg.name
        self.log_level = log_level
        self.name_prefix = name_prefix or cfg.name
        self.placement: resources.LearnerPlacement | None = None
        self.hosts: list[Any] = []

    def create(
        self,
        placement_timeout_s: float = 120.0,
        placement: resources.LearnerPlacement | None = None,
    ) -> None:
        """Reserve the hosts (or reuse `placement`, a previous incarnation's) and create one
        actor per host (their processes boot in the background, so a driver creates every
        group before it starts any)."""
        # Without region labels in the cluster the region only selects the emulated link.
        where = self.lg if self.pin_region else self.lg.model_copy(update={"region": "local"})
        self.placement = placement or resources.reserve_learner_group(
            where, name_prefix=self.name_prefix, timeout_s=placement_timeout_s
        )
        n = self.placement.num_hosts
        if n != self.lg.num_hosts:
            raise ConfigError(
                f"learner {self.name!r}: topology {self.lg.topology} has {n} hosts but "
                f"its num_hosts={self.lg.num_hosts}; set num_hosts={n}"
            )
        self.hosts = [
            LearnerHost.options(  # type: ignore[attr-defined]
                **resources.host_options(self.placement, i),
                name=f"{self.name_prefix}-{self.name}-{self.incarnation}-host{i}",
                namespace=self.cfg.synchronizer.namespace,
            ).remote(self.cfg, self.lg, self.index, self.incarnation, i, n, self.log_level)
            for i in range(n)
        ]

    def start(self) -> None:
        """Start the hosts' loops; returns once every host acknowledged (training goes on in
        the actors' threads). Multi-host learners first join one jax.distributed job."""
        coordinator = None
        if len(self.hosts) > 1:  # one jax.distributed job; host 0 serves as coordinator
            coordinator = ray.get(self.hosts[0].coordinator_address.remote(), timeout=300)
            logger.info("learner %s: jax.distributed coordinator %s", self.name, coordinator)
        logger.info("starting learner %s on %d host(s)", self.name, len(self.hosts))
        starts = [h.start.remote(coordinator) for h in self.hosts]
        ray.get(starts, timeout=CALL_TIMEOUT_S * 10)

    def status(self) -> HostStatus | None:
        """Host 0's status (it speaks for the learner); None when it does not answer."""
        try:
            st: HostStatus = ray.get(self.hosts[0].status.remote(), timeout=CALL_TIMEOUT_S)
        except Exception as err:
            kind = classify_ray_error(err)
            logger.warning("learner %s: status failed (%s): %s", self.name, kind, err)
            return None
        return st

    def stop(self, timeout_s: float = 30.0, at_budget: bool = False) -> None:
        """Ask every host to finish its step and stop; wait (logged) until their loops end.
        `at_budget`: the run's budget is spent, so the hosts hand in their unsent work first,
        as at the synchronizer's own stop (it may not have reached them yet)."""
        for h in self.hosts:
            if at_budget:
                h.stop.remote(StopReason.BUDGET, "token budget reached")
            else:
                h.stop.remote()
        deadline = time.monotonic() + timeout_s
        pending = list(range(len(self.hosts)))
        while pending and time.monotonic() < deadline:
            still = []
            for i in pending:
                try:
                    st = ray.get(self.hosts[i].ping.remote(), timeout=CALL_TIMEOUT_S)
                except Exception:  # a dead host has stopped, too
                    continue
                if st.state not in LOOP_ENDED:  # (a host that left has stopped too)
                    still.append(i)
            pending = still
            if pending:
                logger.info("waiting for learner %s hosts %s to stop", self.name, pending)
                time.sleep(0.2)
        if pending:
            logger.warning(
                "learner %s hosts %s did not stop in %.0f s", self.name, pending, timeout_s
            )

    def kill(self) -> None:
        for h in self.hosts:
            try:
                ray.kill(h, no_restart=True)
            except Exception:
                logger.debug("killing a host of learner %s", self.name, exc_info=True)

    def release(self) -> None:
        if self.placement is not None:
            resources.release(self.placement)


def regions_are_labelled() -> bool:
    """True when some alive node carries a region label: learner regions are then placement
    constraints. On a cluster without (a laptop, one `ray start --head`) they only select
    the emulated WAN link of each learner."""
    return any(
        resources.REGION_LABEL in (node.get("Labels") or {})
        for node in ray.nodes()
        if node.get("Alive")
    )
