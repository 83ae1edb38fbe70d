"""A synchronizer outage, in process (`diloco.accelerate`, docs/contracts.md): the chaos
suite's config (2 learners, P = 2, H = 6, 72k tokens planned, `tests/chaos/chaos_helpers.py`)
with the synchronizer refusing every offer for `length` virtual seconds from `start`. The
learners train through it; the first offers after it carry the whole outage's work. Each
outage runs with the outer optimizer taking one sync window's worth of such a round
("window", the default) and the whole of it ("all", docs/algorithm.md section 6). As the chaos
suite does, a run trains past the outage: to its planned budget, or the outage's tokens and a
quarter budget more.

    python benchmarks/outage.py --jobs 2   # 3 starts x 3 lengths, one early long, 2 rules (~5 min)
"""

from __future__ import annotations

import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from common import parser, write_results

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.chaos.chaos_helpers import chaos_tree

BUDGET = 72000
# 2 learners at 1/0.04 steps per virtual second (speeds 1 and 0.9) of 8 x 16 tokens
TOKENS_PER_S = 2 * 24 * 128
STARTS, LENGTHS = (1.0, 5.0, 10.0), (3.0, 8.0, 18.0)
# and one before any round merged, as long as a restart at load 26 took on Ray
EARLY = (0.3, 34.0)


def run(start: float, length: float, accelerate: str) -> dict[str, Any]:
    from ray_diloco.config import build_config
    from ray_diloco.sim.simulate import run_reference

    tree = chaos_tree(BUDGET, [])
    tree["token_budget"] = int(max(BUDGET, TOKENS_PER_S * (start + length) + BUDGET // 4))
    tree["diloco"]["accelerate"] = accelerate
    outage = (start, start + length) if length else None
    s = run_reference(build_config(tree), outage=outage)
    return {
        "start_s": start,
        "length_s": length,
        "accelerate": accelerate,
        "tokens": s["tokens"],
        "refused": s["outage_refusals"],
        "heldout_loss": s["heldout_loss"],
    }


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=1, help="runs side by side (processes)")
    args = p.parse_args()
    outages = [(s, n) for s in STARTS for n in LENGTHS] + [EARLY]
    grid = [(0.0, 0.0, "window")] + [(s, n, a) for s, n in outages for a in ("window", "all")]
    if args.quick:
        grid = [(0.0, 0.0, "window"), (5.0, 8.0, "window"), (5.0, 8.0, "all")]
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        rows = list(pool.map(run, *zip(*grid, strict=True)))
    columns = ["start_s", "length_s", "accelerate", "tokens", "refused", "heldout_loss"]
    name = "outage-quick" if args.quick else "outage"
    write_results(args.out, name, rows, columns, {"budget": BUDGET, "jobs": args.jobs})


if __name__ == "__main__":
    main()
