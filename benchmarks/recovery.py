"""Detection time and time to contributing again, per fault kind, on a local emulated cluster.

For each fault kind one training run (the chaos suite's tiny config: one-host learners in
us-east5 and europe-west4 on the emulated v5p/v6e hosts, K = 1; for `kill_host_multi` the
us-east5 learner is the two-host v5p slice) injects the fault `--repeats` times, `--gap` seconds
apart (more for the two-host restart, `GAP_AT_LEAST`), then stops once every injection was
detected and recovered from (or `--limit` seconds passed). From the event tape
(`control.recovery.fault_outcomes`): detection = first sign the system noticed (FailureDetected,
a numerical rejection, LearnerDegraded, SynchronizerLost) minus the injection time; recovery =
the learner contributes again (LearnerRejoined, LearnerRecovered) or, for the synchronizer, the
first round after its restore, minus the injection time. Prints the medians per kind; writes
recovery.json and recovery.md. Targets: detection <= 2 s and contributing again
<= 10 s after a host kill.

`--cpu-load N` runs everything beside N busy processes (tests/cpu_load.py), as on a shared
machine, and writes recovery_load.json instead; the machine's load average before
and after each kind is recorded either way (other jobs may load it too).

  python benchmarks/recovery.py [--quick] [--kinds kill_host,hang_host] [--repeats 3]
  python benchmarks/recovery.py --cpu-load 2
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

from ray_diloco.control.events import SynchronizerRestored  # noqa: E402
from ray_diloco.control.protocol import SupervisorStatus  # noqa: E402
from ray_diloco.control.recovery import fault_outcomes  # noqa: E402
from ray_diloco.control.tape import read_tape  # noqa: E402
from tests.chaos.chaos_helpers import (  # noqa: E402
    REGIONS,
    NodeReplacer,
    chaos_config,
)
from tests.cluster_helpers import start_tpu_cluster  # noqa: E402
from tests.cpu_load import CpuLoad  # noqa: E402

from common import parser, write_results  # noqa: E402

# row name -> (fault kind, target, multi-host learner)
KINDS: dict[str, tuple[str, str | None, bool]] = {
    "kill_host": ("kill_host", "us", False),
    "kill_host_multi": ("kill_host", "v5p", True),
    "kill_group": ("kill_group", "eu", False),
    "remove_node": ("remove_node", "us", False),
    "hang_host": ("hang_host", "us", False),
    "straggler": ("straggler", "eu", False),
    "cut_link": ("cut_link", REGIONS["eu"], False),
    "slow_link": ("slow_link", REGIONS["eu"], False),
    "corrupt_nan": ("corrupt_nan", "eu", False),
    "corrupt_norm": ("corrupt_norm", "us", False),
    "kill_synchronizer": ("kill_synchronizer", None, False),
}
QUICK = ("kill_host", "hang_host", "corrupt_nan", "kill_synchronizer")
TIMED = {"hang_host": 5.0, "straggler": 4.0, "cut_link": 4.0, "slow_link": 4.0}
FACTOR = {"straggler": 5.0, "slow_link": 100.0}
# The two-host restart is the slow one (boot and jax.distributed about 8 s, compile 6 s beside
# 2 busy processes): at the default gap the next kill landed before the restarted group
# contributed (17.1 s), which then measured no recovery at all. Spaced so each one is measured.
GAP_AT_LEAST = {"kill_host_multi": 28.0}


def run_kind(
    row: str, repeats: int, gap_s: float, limit_s: float, tmp: Path, replacer: NodeReplacer
) -> dict[str, Any]:
    from ray_diloco.runtime.driver import run_training

    kind, target, multi_host = KINDS[row]
    gap_s = max(gap_s, GAP_AT_LEAST.get(row, 0.0))
    extra = {"duration_s": TIMED.get(kind, 0.0), "factor": FACTOR.get(kind, 1.0)}
    faults = [
        {"at_s": 2.0 + i * gap_s, "kind": kind, "target": target, **extra} for i in range(repeats)
    ]
    # A budget never reached: the run is stopped once its faults played out (below).
    cfg = chaos_config(tmp, row, 10**10, faults, multi_host, jax_cache=tmp / "jax_cache")
    deadline = time.monotonic() + limit_s

    def stop(status: SupervisorStatus) -> str | None:
        replacer.replace_dead()  # a removed node comes back, as the cloud would replace it
        settled = [f for f in status.faults if f["recovered_t"] is not None]
        if len(settled) >= repeats:
            return "every fault recovered"
        return "time limit" if time.monotonic() > deadline else None

    started, load_before = time.monotonic(), os.getloadavg()[0]
    run_training(cfg, progress=lambda line: None, stop_when=stop)
    replacer.replace_dead()
    events = read_tape(Path(cfg.run_dir) / "events.jsonl")
    outcomes = fault_outcomes(events, REGIONS)
    det = [o.detection_s for o in outcomes if o.detection_s is not None]
    rec = [o.recovery_s for o in outcomes if o.recovery_s is not None]
    return {
        "fault": row,
        "injected": len(outcomes),
        "detected": len(det),
        "recovered": len(rec),
        # taken down again by the next injection before it was over: not a failed recovery
        "superseded": sum(o.superseded for o in outcomes),
        "gap_s": gap_s,
        "detection_s_median": statistics.median(det) if det else None,
        "recovery_s_median": statistics.median(rec) if rec else None,
        "detection_s": det,
        "recovery_s": rec,
        # a synchronizer restored from its checkpoint loses the rounds closed since it
        "rounds_lost": [e.rounds_lost for e in events if isinstance(e, SynchronizerRestored)],
        "run_wall_s": time.monotonic() - started,
        "load_avg_1min": [load_before, os.getloadavg()[0]],  # before and after the run
    }


def main() -> int:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--kinds", default=None, help="comma-separated fault kinds (default: all)")
    p.add_argument("--repeats", type=int, default=3, help="injections per kind")
    p.add_argument("--gap", type=float, default=14.0, help="seconds between injections")
    p.add_argument("--limit", type=float, default=150.0, help="seconds per kind at most")
    p.add_argument("--cpu-load", type=int, default=0, help="busy processes beside the runs")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    kinds = args.kinds.split(",") if args.kinds else list(QUICK if args.quick else KINDS)
    repeats = 1 if args.quick else args.repeats
    tpu = start_tpu_cluster("diloco-recovery")
    rows = []
    try:
        with (
            CpuLoad(args.cpu_load),
            tempfile.TemporaryDirectory() as tmp,
            NodeReplacer(tpu) as replacer,
        ):
            (Path(tmp) / "jax_cache").mkdir()  # shared: the runs compile the same programs
            for row in kinds:
                rows.append(run_kind(row, repeats, args.gap, args.limit, Path(tmp), replacer))
                logging.warning("%s: %s", row, rows[-1])
    finally:
        import ray

        ray.shutdown()
        tpu.cluster.shutdown()
    columns = ["fault", "injected", "detected", "recovered"]
    columns += ["detection_s_median", "recovery_s_median", "run_wall_s"]
    name = "recovery_load" if args.cpu_load else "recovery"
    name = f"{name}-quick" if args.quick else name
    meta = {
        # (write_results names the script after the results, here recovery_load)
        "command": " ".join(["python benchmarks/recovery.py", *sys.argv[1:]]),
        "repeats": repeats,
        "gap_s": args.gap,
        "quick": args.quick,
        "cpus": os.cpu_count(),
        "cpu_load": args.cpu_load,
    }
    write_results(args.out, name, rows, columns, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
