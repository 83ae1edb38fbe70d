"""The goodput simulator's 1.2M-chip column under the checks docs/goodput.md quotes: other
seeds (at the default restart cost, and each calibrated on its own trace), a longer run,
other slice sizes, the previous calibration, a learner that applies a new version's change
instead of replacing its fragment, and the quorum and grace-window settings whose effect the
page explains. One row per setting: every system's goodput on one trace.

    python benchmarks/goodput_sim_checks.py --out benchmarks/results   # ~35 s CPU
"""

from __future__ import annotations

import os
import time
from typing import Any

from ray_diloco.config import DilocoConfig, GoodputSimConfig
from ray_diloco.sim.goodput_sim import DecoupledSim, data_parallel, elastic_dp
from ray_diloco.sim.goodput_sweep import ANCHOR_CHIPS, PUBLISHED, calibrate
from ray_diloco.sim.goodput_trace import make_trace

from common import parser, write_results

LEARNERS = (2, 4, 8, 16)
SEEDS = range(6)

# (check, setting, goodput_sim fields, diloco fields, calibrate on the row's own trace)
Check = tuple[str, str, dict[str, Any], dict[str, Any], bool]
CHECKS: list[Check] = [
    *[("seed", f"seed {s}", {"seed": s}, {}, False) for s in SEEDS],
    *[("seed, calibrated", f"seed {s}", {"seed": s}, {}, True) for s in SEEDS],
    ("duration", "3 days", {"duration_days": 3.0}, {}, False),
    ("slice size", "64 chips", {"chips_per_slice": 64}, {}, False),
    ("slice size", "1,024 chips", {"chips_per_slice": 1024}, {}, False),
    ("restart", "46 s (the previous model's calibration)", {"restart_cost_s": 46.0}, {}, False),
    ("quorum", "K = M", {"quorum_min": 0}, {}, False),  # 0: each column's M
    (
        "adoption",
        "keep_unsent_work: the learner applies the change",
        {},
        {"keep_unsent_work": True},
        False,
    ),
    ("grace", "none (grace_fraction 0)", {}, {"grace_fraction": 0.0}, False),
    ("grace", "grace_fraction 0.9", {}, {"grace_fraction": 0.9}, False),
    (
        "grace",
        "30 s (tau 20, grace_fraction 0.9, grace_max_s 30)",
        {},
        {"grace_fraction": 0.9, "grace_max_s": 30.0, "overlap_steps": 20},
        False,
    ),
]


def column(check: Check) -> dict[str, Any]:
    name, setting, fields, diloco_fields, own = check
    quorum_is_m = fields.get("quorum_min") == 0
    fields = {k: v for k, v in fields.items() if k != "quorum_min"}
    cfg = GoodputSimConfig(chips=ANCHOR_CHIPS, **fields)
    t0 = time.process_time()
    trace = make_trace(cfg)
    if own:
        restart = calibrate(cfg, trace)
        assert restart is not None
        cfg = cfg.model_copy(update={"restart_cost_s": restart})
    diloco = DilocoConfig(**diloco_fields)
    row: dict[str, Any] = {
        "check": name,
        "setting": setting,
        "restart_cost_s": cfg.restart_cost_s,
        "failures": trace.num_failures,
        "data_parallel": round(100 * data_parallel(cfg, trace).goodput, 1),
        "elastic_dp": round(100 * elastic_dp(cfg, trace).goodput, 1),
    }
    for m in LEARNERS:
        c = cfg.model_copy(update={"num_learners": m, "quorum_min": m if quorum_is_m else 1})
        res = DecoupledSim(c, trace, diloco).run()
        row[f"M={m}"] = round(100 * res.goodput, 1)
        row[f"M={m} trained"] = round(100 * (res.trained or 0.0), 1)
    row["cpu_s"] = round(time.process_time() - t0, 2)
    return row


def main() -> None:
    # --quick (a common flag) changes nothing: the checks take about a minute
    args = parser(__doc__.splitlines()[0]).parse_args()
    t0 = time.process_time()
    rows = [column(c) for c in CHECKS]
    published = {
        "data_parallel": 100 * PUBLISHED[("data_parallel", 1)],
        "elastic_dp": 100 * PUBLISHED[("elastic_dp", 1)],
        **{f"M={m}": 100 * PUBLISHED[("decoupled", m)] for m in LEARNERS},
    }
    columns = ["check", "setting", "restart_cost_s", "failures", "data_parallel", "elastic_dp"]
    columns += [f"M={m}" for m in LEARNERS] + ["cpu_s"]
    meta = {
        "chips": ANCHOR_CHIPS,
        "published": published,
        "cpu_s": round(time.process_time() - t0, 1),
        "load_avg_1min": os.getloadavg()[0],
    }
    write_results(args.out, "goodput_sim_checks", rows, columns, meta)


if __name__ == "__main__":
    main()
