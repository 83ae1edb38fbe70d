"""`ray-diloco plan` against the cluster it describes: each job file that names cluster files is
planned, the cluster those files make is emulated on local Ray (one node per TPU host, with the
files' pod types, chips per host and regions), and every learner group is reserved there the
way a run reserves it. The plan must see no problem, and each group must land where the plan
said: the pool's region, its slice, its hosts and chips per host. The two jobs cover both v6e
2x4 shapes (two 4-chip hosts on GKE, one 8-chip TPU VM with `ray up`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ray_diloco.cluster.files import read_cluster_files
from ray_diloco.cluster.plan import make_plan
from ray_diloco.config import load_config
from tests.cluster_helpers import start_cluster_from_files

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
JOBS = {"cluster-gke.yaml": (2, 4), "cluster-v5p-v6e.yaml": (1, 8)}  # v6e: hosts, chips per host


@pytest.mark.timeout(180)
@pytest.mark.parametrize("job", sorted(JOBS))
def test_learners_land_where_the_plan_says(job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # cluster.files are relative to the working directory
    # The command itself, in a process of its own: the run's fragment plan starts JAX, which
    # must not be running in this process when Ray forks the emulated nodes.
    command = [sys.executable, "-m", "ray_diloco.cli", "plan", "--config", f"jobs/{job}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0 and "problems: none" in done.stdout, done.stdout + done.stderr
    cfg = load_config(ROOT / "jobs" / job)
    spec = read_cluster_files(cfg.cluster.files)
    cpus = max(round(lg.cpus_per_host) for lg in cfg.learners)
    cluster = start_cluster_from_files(spec, "diloco-plan-test", cpus_per_host=cpus)
    try:
        # Where learners go does not depend on fragment sizes: the same plan, JAX-free.
        plan = make_plan(cfg, spec, fragment_sizes=[1])
        assert plan.problems == []
        shapes = {site.learner.name: site.learner.slice_shape for site in plan.sites}
        v6e = shapes["v6e-0"]
        assert v6e is not None and (v6e.num_hosts, v6e.chips_per_host) == JOBS[job]
        for site in plan.sites:
            assert site.pool is not None
            _check_reservation(site.learner, site.pool, spec)
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()


def _check_reservation(lg: Any, pool: Any, spec: Any) -> None:
    import ray

    from ray_diloco.runtime.resources import (
        REGION_LABEL,
        SLICE_LABEL,
        WORKER_ID_LABEL,
        release,
        reserve_learner_group,
    )
    from ray_diloco.runtime.resources import placement_state as state

    placement = reserve_learner_group(lg, name_prefix="plan", timeout_s=30, emulated=True)
    try:
        assert state(placement) == "CREATED"
        shape = pool.shape
        assert placement.num_hosts == shape.num_hosts
        assert placement.bundle_resources == {"CPU": lg.cpus_per_host, "TPU": shape.chips_per_host}
        table = ray.util.placement_group_table(placement.placement_group)
        nodes = {n["NodeID"]: n for n in ray.nodes()}
        hosts = [nodes[table["bundles_to_node_id"][i]] for i in range(shape.num_hosts)]
        index = spec.pools.index(pool)
        for i, node in enumerate(hosts):
            labels = node["Labels"]
            assert labels[REGION_LABEL] == pool.region
            assert labels[SLICE_LABEL].startswith(f"pool{index}-slice")
            assert labels[WORKER_ID_LABEL] == str(i)
            assert node["Resources"]["TPU"] == shape.chips_per_host
        assert len({node["Labels"][SLICE_LABEL] for node in hosts}) == 1  # one whole slice
    finally:
        release(placement)
