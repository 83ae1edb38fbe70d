"""Detection time and time to contributing again, per fault kind, on a local emulated cluster.

For each fault kind one training run (the chaos suite's tiny config: a two-host v5p learner in
us-east5 and a CPU learner in europe-west4, K = 1) injects the fault `--repeats` times,
`--gap` seconds apart, then stops once every injection was detected and recovered from (or
`--limit` seconds passed). From the event tape (`control.recovery.fault_outcomes`):
detection = first sign the system noticed (FailureDetected, a numerical rejection,
LearnerDegraded, SynchronizerLost) minus the injection time; recovery = the learner contributes
again (LearnerRejoined, LearnerRecovered) or, for the synchronizer, the first round after its
restore, minus the injection time. Prints the medians per kind; writes recovery.json and
recovery-<date>.md. Targets (issue 4): detection <= 2 s and contributing again <= 10 s after a
host kill.

  python benchmarks/recovery.py [--quick] [--kinds kill_host,hang_host] [--repeats 3]
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the emulated cluster lives with the tests

from ray_diloco.config import build_config  # noqa: E402
from ray_diloco.control.recovery import fault_outcomes  # noqa: E402
from ray_diloco.control.tape import read_tape  # noqa: E402
from tests.chaos.chaos_helpers import REGIONS, NodeReplacer, chaos_tree  # noqa: E402
from tests.cluster_helpers import FAST_HEALTH_CHECKS, SLICES, TpuCluster, prepare_ray_env  # noqa: E402

from common import parser, write_results  # noqa: E402

KINDS = {
    "kill_host": "v5p",
    "kill_group": "eu",
    "remove_node": "v5p",
    "hang_host": "v5p",
    "straggler": "eu",
    "cut_link": REGIONS["eu"],
    "slow_link": REGIONS["eu"],
    "corrupt_nan": "eu",
    "corrupt_norm": "v5p",
    "kill_synchronizer": None,
}
QUICK = ("kill_host", "hang_host", "corrupt_nan", "kill_synchronizer")


def start_cluster() -> tuple[Any, TpuCluster]:
    prepare_ray_env()
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "include_dashboard": False,
            "object_store_memory": 100 * 2**20,
            "_system_config": FAST_HEALTH_CHECKS,
        },
    )
    tpu = TpuCluster(cluster, {})
    for kind in SLICES:
        for worker_id in range(2):
            tpu.add_slice_host(kind, worker_id)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="diloco-recovery")
    return cluster, tpu


def run_kind(kind: str, repeats: int, gap_s: float, limit_s: float, tmp: Path) -> dict[str, Any]:
    from ray_diloco.driver import run_training

    target = KINDS[kind]
    duration = 6.0 if kind in ("hang_host", "straggler", "cut_link", "slow_link") else 0.0
    factor = 10.0 if kind == "slow_link" else 4.0
    faults = [
        {"at_s": 2.0 + i * gap_s, "kind": kind, "target": target, "duration_s": duration}
        | ({"factor": factor} if kind in ("straggler", "slow_link") else {})
        for i in range(repeats)
    ]
    tree = chaos_tree(10**10, faults)  # stopped below, not by the budget
    tree.update(run_dir=str(tmp / kind))
    tree["synchronizer"]["name"] = f"sync-recovery-{kind}"
    cfg = build_config(tree, f"recovery benchmark {kind}")
    deadline = time.monotonic() + limit_s

    def stop(status: dict[str, Any]) -> str | None:
        faults_seen = status.get("faults", [])
        settled = [f for f in faults_seen if f["recovered_t"] is not None]
        if len(settled) >= repeats:
            return "every fault recovered"
        return "time limit" if time.monotonic() > deadline else None

    started = time.monotonic()
    run_training(cfg, progress=lambda line: None, stop_when=stop)
    events = read_tape(Path(cfg.run_dir) / "events.jsonl")
    outcomes = fault_outcomes(events, REGIONS)
    det = [o.detection_s for o in outcomes if o.detection_s is not None]
    rec = [o.recovery_s for o in outcomes if o.recovery_s is not None]
    return {
        "fault": kind,
        "injected": len(outcomes),
        "detected": len(det),
        "recovered": len(rec),
        "detection_s_median": statistics.median(det) if det else None,
        "recovery_s_median": statistics.median(rec) if rec else None,
        "detection_s": det,
        "recovery_s": rec,
        "run_wall_s": time.monotonic() - started,
    }


def main() -> int:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--kinds", default=None, help="comma-separated fault kinds (default: all)")
    p.add_argument("--repeats", type=int, default=3, help="injections per kind")
    p.add_argument("--gap", type=float, default=14.0, help="seconds between injections")
    p.add_argument("--limit", type=float, default=150.0, help="seconds per kind at most")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    kinds = args.kinds.split(",") if args.kinds else list(QUICK if args.quick else KINDS)
    repeats = 1 if args.quick else args.repeats
    cluster, tpu = start_cluster()
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp, NodeReplacer(tpu):
            for kind in kinds:
                rows.append(run_kind(kind, repeats, args.gap, args.limit, Path(tmp)))
                logging.warning("%s: %s", kind, rows[-1])
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()
    columns = ["fault", "injected", "detected", "recovered"]
    columns += ["detection_s_median", "recovery_s_median", "run_wall_s"]
    write_results(
        args.out,
        "recovery",
        rows,
        columns,
        {"repeats": repeats, "gap_s": args.gap, "cpus": os.cpu_count()},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
