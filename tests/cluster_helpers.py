"""Helpers for Ray test fixtures: a clean Ray environment, free ports, emulated TPU/CPU hosts.

TPU hosts are emulated the way ray-notes §1.5 measured: a `ray.cluster_utils.Cluster` node with
`resources={"TPU": chips}` plus the GKE env vars (`TPU_ACCELERATOR_TYPE`, `TPU_NAME`,
`TPU_WORKER_ID`, `TPU_TOPOLOGY`) and `RAY_NODE_REGION`, set only while `add_node` runs: Ray
resolves resources and labels in the calling process and the raylet inherits the env, so the
node gets `accelerator_type:TPU-V5P`, the slice resource, `TPU-<pod>-head` on worker 0 and the
`ray.io/tpu-*` / `ray.io/availability-region` labels, and `ray.util.tpu` works unmodified.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

RAY_CURRENT_CLUSTER = Path("/tmp/ray/ray_current_cluster")
HOST_OBJECT_STORE_BYTES = 80 * 2**20
# The emulated slices of tests/chaos: kind -> (slice name, pod type, topology, region).
SLICES = {
    "v5p": ("slice-v5p", "v5p-16", "2x2x2", "us-east5"),
    "v6e": ("slice-v6e", "v6e-8", "2x4", "europe-west4"),
}
# Ray waits a hard-coded 30 s for a new raylet to register with the GCS, and `Cluster` 30 s for
# it to show up; on a busy machine (load 20 on 2 cores, measured) that is not enough.
NODE_START_TIMEOUT_S = 180.0
# The agents' ports a raylet takes on its command line; at 0 it waits 15 s for each one's file
# instead (it always waits so for the dashboard agent's HTTP listen port: Ray 2.60 passes it none).
AGENT_PORTS = ("metrics_agent_port", "metrics_export_port", "runtime_env_agent_port")


# A killed host is declared dead in 1-1.5 s (ray-notes §3.3) instead of ~16 s: its raylet's
# port refuses the check at once, so three failed checks take three periods. A live raylet gets
# 10 s to answer each check: with 1 s, one starved for 3 s on a busy machine would be declared
# dead (measured: a SIGKILLed raylet is declared dead after 1.1 s with a 1 s and 1.05 s with a
# 10 s check timeout).
FAST_HEALTH_CHECKS = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 10_000,
    "health_check_failure_threshold": 3,
}


class NodeDied(RuntimeError):
    """A node of a test cluster died before it was up; `node_ids` are the dead ones."""

    def __init__(self, message: str, node_ids: frozenset[str]) -> None:
        super().__init__(message)
        self.node_ids = node_ids


def wait_until_live(cluster: Any, timeout_s: float = NODE_START_TIMEOUT_S) -> None:
    """`cluster.wait_for_nodes`, except that a node that died on the way raises `NodeDied` at
    once, with Ray's reason, instead of a `TimeoutError` minutes later that says nothing."""
    deadline = time.monotonic() + timeout_s
    while True:
        ours = {node.node_id for node in cluster.list_all_nodes()}
        rows = [row for row in cluster.global_state.node_table() if row["NodeID"] in ours]
        dead = [row for row in rows if not row["Alive"]]
        if dead:
            reasons = "; ".join(f"{r['NodeID'][:8]}: {r['DeathReasonMessage']!r}" for r in dead)
            dead_ids = frozenset(row["NodeID"] for row in dead)
            raise NodeDied(f"node died while the cluster started ({reasons})", dead_ids)
        if len(rows) == len(ours):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(ours) - len(rows)} node(s) not registered in {timeout_s} s")
        time.sleep(0.1)


def _add_node(
    cluster: Any, env: dict[str, str], wait: bool, retries: int = 1, **node_args: Any
) -> Any:
    """Add a node with `env` set while Ray starts it; with `wait`, wait until it is up, and
    start it again (up to `retries` times) if it died on the way: a node starved of CPU at
    startup can be declared dead, and the tests need a cluster, not that node. Another node
    that died meanwhile is not this one's to replace: that `NodeDied` is raised at once."""
    with _env(env), patient_node_start():
        node = cluster.add_node(
            object_store_memory=HOST_OBJECT_STORE_BYTES, wait=False, **node_args
        )
    if not wait:
        return node
    try:
        wait_until_live(cluster)
    except NodeDied as died:
        if not retries or node.node_id not in died.node_ids:
            raise
        print(f"tests: {died}; starting it again", file=sys.stderr)
        cluster.remove_node(node, allow_graceful=False)
        return _add_node(cluster, env, wait, retries - 1, **node_args)
    return node


def prepare_ray_env() -> None:
    """Env every Ray test process needs (ray-notes §4): no token auth, no usage stats, and no
    stale cluster address that would make `ray.init(num_cpus=...)` try to connect."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    remove_stale_cluster_address()


def remove_stale_cluster_address() -> None:
    """Delete /tmp/ray/ray_current_cluster unless its GCS still answers (another live test)."""
    try:
        address = RAY_CURRENT_CLUSTER.read_text().strip()
    except OSError:
        return
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=0.2):
            return
    except (OSError, ValueError):
        pass
    with contextlib.suppress(OSError):
        RAY_CURRENT_CLUSTER.unlink()


def free_port() -> int:
    """A port the OS says is free, never one of Ray's fixed defaults: a node takes those
    itself (its dashboard agent listens on 52365, inside Linux's ephemeral range), and Ray
    refuses to start a node that was handed one for another component (a clean-clone suite
    run: the chaos cluster's head got 52365 for its runtime-env agent)."""
    from ray._private import ray_constants

    taken = {
        ray_constants.DEFAULT_DASHBOARD_AGENT_LISTEN_PORT,
        ray_constants.DEFAULT_DASHBOARD_PORT,
        ray_constants.DEFAULT_PORT,
    }
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in taken:
            return port


@contextlib.contextmanager
def patient_node_start(
    timeout_s: float = NODE_START_TIMEOUT_S, minimal_agent: bool = True
) -> Iterator[None]:
    """Let a node started inside the block come up on a busy machine (tests only):

    - its registration may take up to `timeout_s`: Ray's own wait (`ray._private.node.Node`,
      30 s) polls `services.get_node`, which here retries until then instead of failing,
      unless the node's raylet has exited (it then never registers: Ray fails after its 30 s);
    - the agents' ports are chosen up front (`AGENT_PORTS`), so the raylet does not wait for
      their files: it waits 15 s (hard-coded in Ray 2.60) for each, then crashes (`ray.init`
      takes no such ports; measured: at load 40 on 2 cores the raylet crashed waiting for
      metrics_agent_port, at load 15 for metrics_export_port, and, beside two
      busy processes and a chaos test, for a minimal agent's metrics_agent_port);
    - its dashboard agent runs `--minimal` (no HTTP server, no dashboard modules, which the
      tests never use): the raylet also waits 15 s for the agent's HTTP listen port, written
      only once those modules loaded, and at load ~25 on 2 cores they took longer
      (measured). `minimal_agent=False` keeps the full agent (it serves the metrics export
      port that tests/ray scrapes); the raylet still waits for its listen port, and once
      crashed on it at load 15."""
    import ray._private.node
    import ray._private.utils
    from ray._private import services

    original, dependencies = services.get_node, ray._private.utils.get_dashboard_dependency_error

    starting: list[Any] = []  # the node being started, whose raylet `get_node` watches

    def get_node(gcs_address: str, node_id: str) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return original(gcs_address, node_id)
            except RuntimeError:
                # A raylet that crashed never registers: fail now, not at the deadline.
                if time.monotonic() > deadline or any(map(_raylet_exited, starting)):
                    raise
                time.sleep(0.5)

    node_init = ray._private.node.Node.__init__

    def init_with_agent_ports(self: Any, ray_params: Any, *args: Any, **kwargs: Any) -> None:
        for port in AGENT_PORTS:
            setattr(ray_params, port, getattr(ray_params, port) or free_port())
        starting.append(self)
        try:
            node_init(self, ray_params, *args, **kwargs)
        finally:
            starting.remove(self)

    services.get_node = get_node
    ray._private.node.Node.__init__ = init_with_agent_ports  # type: ignore[method-assign]
    if minimal_agent:
        ray._private.utils.get_dashboard_dependency_error = lambda: ImportError("tests: minimal")
    try:
        yield
    finally:
        services.get_node = original
        ray._private.utils.get_dashboard_dependency_error = dependencies
        ray._private.node.Node.__init__ = node_init  # type: ignore[method-assign]


def _raylet_exited(node: Any) -> bool:
    """Whether the raylet that `node` (a `ray._private.node.Node`) started has exited."""
    from ray._private import ray_constants

    infos = getattr(node, "all_processes", {}).get(ray_constants.PROCESS_TYPE_RAYLET, [])
    return any(info.process.poll() is not None for info in infos)


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def add_tpu_host(
    cluster: Any,
    slice_name: str,
    pod_type: str,
    topology: str,
    worker_id: int,
    region: str,
    *,
    chips: int = 4,
    num_cpus: int = 1,
    wait: bool = True,
) -> Any:
    """Add one emulated TPU host (a Ray node) of slice `slice_name` in `region`; `wait=False`
    returns once its processes are started (wait for them with `wait_until_live`)."""
    env = {
        "TPU_ACCELERATOR_TYPE": pod_type,
        "TPU_NAME": slice_name,
        "TPU_WORKER_ID": str(worker_id),
        "TPU_TOPOLOGY": topology,
        "RAY_NODE_REGION": region,
    }
    return _add_node(cluster, env, wait, num_cpus=num_cpus, resources={"TPU": chips})


def add_cpu_host(cluster: Any, region: str, num_cpus: int = 1) -> Any:
    """Add one CPU-only node labelled `ray.io/availability-region=region`."""
    return _add_node(cluster, {"RAY_NODE_REGION": region}, True, num_cpus=num_cpus)


def preempt_host(cluster: Any, node: Any, notice_s: float = 0.2) -> None:
    """Preempt `node` the way the autoscaler does for a spot/TPU reclaim: drain it with reason
    PREEMPTION and a deadline, then kill it once the notice ran out. The GCS infers
    `AUTOSCALER_DRAIN_PREEMPTED` only when the deadline has passed at death (measured: with a
    later deadline the death reads "health check failed"), and actors on the node then die with
    `ActorDiedError.preempted == True`. Uses the private GcsClient.drain_node, as `ray drain-node`
    and Ray's own chaos utilities do; tests only."""
    import ray
    from ray.core.generated import autoscaler_pb2

    gcs = ray._raylet.GcsClient(address=cluster.address)  # type: ignore[attr-defined]
    reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")  # type: ignore[attr-defined]
    deadline_ms = int((time.time() + notice_s) * 1000)
    accepted, why = gcs.drain_node(node.node_id, reason, "emulated preemption", deadline_ms)
    if not accepted:
        raise RuntimeError(f"drain of node {node.node_id} rejected: {why}")
    time.sleep(notice_s + 0.2)
    cluster.remove_node(node, allow_graceful=False)


class TpuCluster(NamedTuple):
    """What the `tpu_cluster` fixture yields."""

    cluster: Any  # ray.cluster_utils.Cluster
    hosts: dict[tuple[str, int], Any]  # ("v5p", worker_id) -> ray._private.node.Node

    def add_slice_host(self, kind: str, worker_id: int) -> Any:
        """(Re-)add host `worker_id` of slice `kind` with its identity, e.g. after a removal."""
        slice_name, pod_type, topology, region = SLICES[kind]
        node = add_tpu_host(self.cluster, slice_name, pod_type, topology, worker_id, region)
        self.hosts[(kind, worker_id)] = node
        return node


def _start_head(region: str | None = None, **head_args: Any) -> Any:
    """A local `Cluster` with only its CPU-only head (1 CPU, no TPU: a TPU resource there
    would trigger GCE metadata lookups), labelled with `region` when given. A Ray left
    initialised by a previous user is shut down first: it is never reused."""
    prepare_ray_env()
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    region_env = {"RAY_NODE_REGION": region} if region else {}
    with _env(region_env), patient_node_start():
        return Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 1,
                "include_dashboard": False,
                "object_store_memory": 100 * 2**20,
                **head_args,
            },
        )


# Whole-cluster starts a fixture makes before it gives up: a node already up can be declared
# dead while a later one starts (CI, at the suite's start beside the other worker's
# imports: a host died of missed health checks while the next host started, so starting that
# next host again could not help).
CLUSTER_START_ATTEMPTS = 3


def start_cluster(namespace: str, add_hosts: Callable[[Any], None], **head_args: Any) -> Any:
    """A head (`_start_head(**head_args)`) and the hosts `add_hosts(cluster)` adds, every node
    up, connected to. A node that died on the way shuts the whole cluster down and starts it
    again, up to CLUSTER_START_ATTEMPTS times; any other failure shuts it down and raises, so
    no test leaks raylets."""
    import ray

    attempt = 1
    while True:
        cluster = _start_head(**head_args)
        try:
            add_hosts(cluster)
            wait_until_live(cluster)
            ray.init(address=cluster.address, namespace=namespace)
            return cluster
        except NodeDied as died:
            cluster.shutdown()
            if attempt == CLUSTER_START_ATTEMPTS:
                raise
            print(f"tests: {died}; starting the whole cluster again", file=sys.stderr)
            attempt += 1
        except BaseException:
            cluster.shutdown()
            raise


def start_tpu_cluster(namespace: str) -> TpuCluster:
    """The emulated two-region cluster of tests/chaos (ray-notes §1.5, §4), connected to: a
    CPU-only head with health checks tuned so a killed host is declared dead in about 1.5 s,
    and both hosts of every slice in SLICES. Shut down with
    `ray.shutdown(); tpu.cluster.shutdown()`."""
    hosts: dict[tuple[str, int], Any] = {}

    def add_hosts(cluster: Any) -> None:
        hosts.clear()
        tpu = TpuCluster(cluster, hosts)
        for kind in SLICES:
            for worker_id in range(2):
                tpu.add_slice_host(kind, worker_id)

    cluster = start_cluster(namespace, add_hosts, _system_config=FAST_HEALTH_CHECKS)
    return TpuCluster(cluster, hosts)


def first_error(call: Callable[[], Any], timeout_s: float) -> BaseException:
    """Repeat `call` (a blocking Ray call) until it raises a Ray error; return that error.

    An actor's worker can answer for up to ~1 s after its raylet or placement group is gone.
    """
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            call()
        except ray.exceptions.RayError as err:
            return err
        time.sleep(0.2)
    raise AssertionError(f"call still succeeds after {timeout_s} s")


def node_labels(node_id: str) -> dict[str, str]:
    """Labels of the (alive or dead) node `node_id` as the GCS reports them."""
    import ray

    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return dict(node.get("Labels") or {})
    raise KeyError(f"node {node_id} not in ray.nodes()")


def start_cluster_from_files(spec: Any, namespace: str, cpus_per_host: int = 1) -> Any:
    """A local cluster emulating the Ray cluster of `spec` (a `ClusterSpec` read from cluster
    files by `ray_diloco.cluster.files`): a CPU-only head labelled with the head's region, and
    every host of every slice the files allow (`max_slices` of each pool), each an emulated TPU
    host with the pool's pod type, topology, chips per host and region. Slice k of pool i is
    named `pool{i}-slice{k}`. Connected to; shut down with `ray.shutdown(); cluster.shutdown()`."""
    (head,) = spec.heads

    def add_hosts(cluster: Any) -> None:
        for i, pool in enumerate(spec.pools):
            shape = pool.shape
            for k in range(pool.max_slices):
                for worker_id in range(shape.num_hosts):
                    add_tpu_host(
                        cluster,
                        f"pool{i}-slice{k}",
                        shape.pod_type,
                        shape.topology,
                        worker_id,
                        pool.region,
                        chips=shape.chips_per_host,
                        num_cpus=cpus_per_host,
                        wait=False,  # the hosts start side by side
                    )

    return start_cluster(namespace, add_hosts, region=head.region)


def scrape_metrics(port: int, wanted: Callable[[str], bool], timeout_s: float = 45.0) -> str:
    """The local node's Prometheus text once `wanted(text)` holds (metrics arrive every
    report interval); the last text read if it never does. Each read gets 10 s: the shared
    test Ray's text grows to ~800 KB over a suite run, and a loaded agent took over 2 s to
    serve it (a clean-clone run: 2 reads of 20 s answered, the test failed)."""
    url, text = f"http://127.0.0.1:{port}/metrics", ""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                text = resp.read().decode()
        except OSError:
            text = ""
        if wanted(text):
            break
        time.sleep(0.5)
    return text
