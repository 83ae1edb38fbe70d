"""Quality at a horizon DiLoCo is meant for: over 100 outer steps per
fragment, 3 seeds per variant (mean and spread), M = 2, 4 and 8, and short outer- and
inner-optimizer sweeps, on the in-process reference run (deterministic for a seed).

The setting is `jobs/reference.yaml` (P = H = 24, tau = 2, heterogeneous learners) with a
smaller model and batch, so that a run has about 104 outer steps per fragment on 2 cores: a
3-layer, 64-wide model on sequences of 32 bytes, a global batch of 32 sequences split over the
M learners (8 each for M = 4; every other learner 18% slower, all with 10% jitter), 2.56M
tokens (2,500 inner steps per learner for M = 4). Data-parallel takes the same global batch.
The `global batch 128`, `256` and `512` rows take 4x, 8x and 16x the batch and the tokens,
at the same steps; they are plotted apart (`quality_horizon-batch.png`), and the gap to
data-parallel against the batch and against M in `quality_horizon-scaling.png`.

    python benchmarks/quality_horizon.py --jobs 2   # every variant, seeds, sweep (~13 h)
    python benchmarks/quality_horizon.py --quick    # tiny model, smoke check
"""

from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from ray_diloco.config import RunConfig, build_config, load_config
from ray_diloco.tasks.byte_lm import ByteLMArgs

from common import (
    AS_WRITTEN,
    DEFAULT,
    DEFAULT_K2,
    DEFAULT_ROW,
    FRACTION_STEP,
    K2,
    MIX,
    NO_GRACE,
    PULLED,
    QUICK_MODEL,
    REFERENCE,
    both_ways,
    cache_compilations,
    parser,
    plot_loss_curves,
    write_results,
)

HORIZON = [
    "task_args.model.d_model=64",
    "task_args.model.num_layers=3",
    "task_args.model.d_ff=256",
    "task_args.model.seq_len=32",
    "token_budget=2560000",
]
QUICK = [*QUICK_MODEL, "token_budget=30000"]
GLOBAL_BATCH = 32
SEEDS = (0, 1, 2)
# As in quality.py: every variant names what it changes from AS_WRITTEN (common.py).
AS_WRITTEN_K1 = "decoupled K=1 grace"
SQRT = ["diloco.round_step=sqrt"]
FRACTION = ["diloco.round_step=fraction"]
BEST_2M = "decoupled K=1 grace, contributors, share step"
# name -> (overrides, learners, seeds)
VARIANTS: dict[str, tuple[list[str], int, tuple[int, ...]]] = {
    "data_parallel": (["diloco.mode=data_parallel"], 4, SEEDS),
    PULLED: ([], 4, SEEDS),  # the config's defaults, nothing of AS_WRITTEN
    # ... whose rounds of one learner take a share of a step each (one step a window in all),
    # or wait for two answers
    f"{PULLED}, fraction step": (["diloco.round_step=fraction"], 4, SEEDS),
    f"{PULLED}, K=2": (["diloco.quorum_min=2"], 4, SEEDS),
    "synchronous": (["diloco.mode=synchronous"], 4, SEEDS),
    "decoupled K=M": (["diloco.quorum_min=4"], 4, SEEDS),
    "decoupled K=1 no grace": (["diloco.grace_fraction=0"], 4, SEEDS),
    AS_WRITTEN_K1: ([], 4, SEEDS),
    BEST_2M: (["diloco.publish_to=contributors", "diloco.round_step=share"], 4, SEEDS),
    # A round as a fraction of an outer step, momentum included (round_step: fraction).
    FRACTION_STEP: (FRACTION, 4, SEEDS),
    "decoupled K=1 no grace, fraction step": (["diloco.grace_fraction=0", *FRACTION], 4, SEEDS),
    "decoupled K=1 grace, contributors, fraction step": (
        ["diloco.publish_to=contributors", "diloco.round_step=fraction"],
        4,
        SEEDS,
    ),
    "decoupled K=1 no grace, contributors, fraction step": (
        ["diloco.grace_fraction=0", "diloco.publish_to=contributors", "diloco.round_step=fraction"],
        4,
        (0,),
    ),
    "decoupled K=1 grace, contributors, base anchor, fraction step": (
        [
            "diloco.publish_to=contributors",
            "diloco.outer_anchor=base",
            "diloco.round_step=fraction",
        ],
        4,
        (0,),
    ),
    # A learner's unsent work carried onto a new version instead of overwritten.
    "synchronous, keep unsent work": (
        ["diloco.mode=synchronous", "diloco.keep_unsent_work=true"],
        4,
        (0,),
    ),
    "decoupled K=1 grace, keep unsent work, fraction step": (
        ["diloco.keep_unsent_work=true", *FRACTION],
        4,
        SEEDS,
    ),
    "decoupled K=1 grace, keep unsent work, base anchor, fraction step": (
        ["diloco.keep_unsent_work=true", "diloco.outer_anchor=base", "diloco.round_step=fraction"],
        4,
        (0,),
    ),
    "decoupled K=1 grace, contributors, keep unsent work, fraction step": (
        [
            "diloco.publish_to=contributors",
            "diloco.keep_unsent_work=true",
            "diloco.round_step=fraction",
        ],
        4,
        (0,),
    ),
    "decoupled K=1 grace, mean merge": (["diloco.merge=mean"], 4, (0,)),
    f"{FRACTION_STEP}, mean merge": ([*FRACTION, "diloco.merge=mean"], 4, (0,)),
    "decoupled, M=1": ([], 1, (0,)),  # DiLoCo itself, without several learners
    "decoupled K=1 grace, M=2": ([], 2, (0,)),
    "decoupled K=1 grace, M=8": ([], 8, (0,)),
    f"{FRACTION_STEP}, M=2": (FRACTION, 2, (0,)),
    f"{FRACTION_STEP}, M=8": (FRACTION, 8, (0,)),
    # A round as sqrt(share) of an outer step (the default): one learner of 4 takes half a step.
    DEFAULT: (SQRT, 4, SEEDS),
    "decoupled K=1 no grace, sqrt step": (["diloco.grace_fraction=0", *SQRT], 4, SEEDS),
    f"{DEFAULT}, mean merge": ([*SQRT, "diloco.merge=mean"], 4, (0,)),
    f"{DEFAULT}, M=2": (SQRT, 2, (0,)),
    f"{DEFAULT}, M=8": (SQRT, 8, (0,)),
    # The sqrt step with what helped the fraction step here (keep unsent work, contributors)
    # and with the momentum that helped the full step (0.5).
    f"{DEFAULT}, keep unsent work": ([*SQRT, "diloco.keep_unsent_work=true"], 4, SEEDS),
    f"{DEFAULT}, contributors": ([*SQRT, "diloco.publish_to=contributors"], 4, SEEDS),
    f"{DEFAULT}, outer momentum 0.5": ([*SQRT, "outer.momentum=0.5"], 4, SEEDS),
    # Each learner of a round 1/sqrt(M) of a step: the grace window's grouping no longer
    # shortens the window's steps (the question: is grace better than no grace?).
    "decoupled K=1 grace, sqrt step per learner": (["diloco.round_step=sqrt_each"], 4, SEEDS),
}
# The outer optimizer around the paper's (lr 0.7, Nesterov 0.9), M = 4: as written, and with
# the fraction step (the default before the sqrt step).
SWEEP: dict[str, list[str]] = {
    f"{name}, outer lr {lr}, momentum {m}": [*base, f"outer.lr={lr}", f"outer.momentum={m}"]
    for name, base in ((AS_WRITTEN_K1, []), (FRACTION_STEP, FRACTION))
    for lr, m in ((1.0, 0.9), (1.4, 0.9), (2.0, 0.9), (0.5, 0.9), (0.7, 0.5), (1.0, 0.5))
}
# The inner learning rate (AdamW, 3e-3 as written) around it, seed 0: is the gap to
# data-parallel a matter of the inner step, when each of the 4 learners takes a quarter of
# data-parallel's batch?
INNER_SWEEP: dict[str, list[str]] = {
    f"{name}, inner lr {lr}": [*VARIANTS[name][0], f"inner.lr={lr}"]
    for name in ("data_parallel", "synchronous", DEFAULT)
    for lr in (1e-3, 1.5e-3, 6e-3)
}
# The outer lr around the sqrt step's (lr 0.7), seed 0: a round of two learners at a whole
# step (the sqrt step per learner) did far worse than at sqrt(2/4) of one (1.902 against 1.719
# over three seeds): do shorter steps do better still?
SQRT_SWEEP: dict[str, list[str]] = {
    f"{name}, outer lr {lr}": [*VARIANTS[name][0], f"outer.lr={lr}"]
    for name in (DEFAULT, "synchronous")
    for lr in (0.4, 0.5, 0.6)
} | {
    # Streaming DiLoCo's mixing: a learner keeps alpha of its own values when a new version
    # arrives (params = alpha params + (1 - alpha) G) instead of overwriting them.
    f"{DEFAULT}, mixing alpha {alpha}": [*SQRT, f"diloco.mixing_alpha={alpha}"]
    for alpha in (0.25, 0.5)
}
# The default's grace and merge alternatives with the mix.
DEFAULT_CHECKS: dict[str, tuple[list[str], int, tuple[int, ...]]] = {
    "decoupled K=1 no grace, sqrt step, mixing alpha 0.25": (
        ["diloco.grace_fraction=0", *MIX],
        4,
        SEEDS,
    ),
    f"{DEFAULT_ROW}, mean merge": ([*MIX, "diloco.merge=mean"], 4, (0,)),
    # M = 2 and M = 8 for the default, and scavenging's question: does the mix make more
    # learners at the same token budget cost less?
    f"{DEFAULT_ROW}, M=2": (MIX, 2, (0,)),
    f"{DEFAULT_ROW}, M=8": (MIX, 8, (0,)),
    # The mix with the outer lr that helped synchronous DiLoCo (0.5), and synchronous DiLoCo
    # with the mix (every learner gets the same version, so the mix keeps them apart).
    f"{DEFAULT_ROW}, outer lr 0.5": ([*MIX, "outer.lr=0.5"], 4, (0,)),
    # An outer lr warm-up (a decoupled fragment closes about 350 rounds):
    # seed 0 at 20 and 60 rounds, then every seed at the better (20: 1.667 against 1.687).
    **{
        f"{DEFAULT_ROW}, outer warm-up {n} rounds": (
            [*MIX, f"outer.warmup_rounds={n}"],
            4,
            SEEDS if n == 20 else (0,),
        )
        for n in (20, 60)
    },
    "synchronous, mixing alpha 0.25": (["diloco.mode=synchronous", *MIX], 4, SEEDS),
    # ... applying a new version one step after the offer instead of two (tau = 1): what a
    # decoupled learner in lock-step with the others does (tests/unit/test_simulate.py).
    "synchronous, mixing alpha 0.25, overlap 1": (
        ["diloco.mode=synchronous", *MIX, "diloco.overlap_steps=1"],
        4,
        SEEDS,
    ),
    "synchronous, outer lr 0.5, mixing alpha 0.25": (
        ["diloco.mode=synchronous", "outer.lr=0.5", *MIX],
        4,
        (0,),
    ),
    # The narrow wires both ways at this horizon (the bandwidth table runs 500k tokens, one
    # seed: int4 +0.0% and int2 +0.8% against the bfloat16 wire there).
    **{
        f"{DEFAULT_ROW}, {bits} both ways": ([*MIX, *both_ways(bits)], 4, SEEDS)
        for bits in ("int4", "int2")
    },
    # Fewer, larger rounds (each at least sqrt(2/4) = 0.71 of a step), and a longer grace
    # window (more learners a round), seed 0 (K = 2 then every seed: 1.673 against 1.676 on
    # seed 0; the longer window 1.683): does either close the gap to synchronous DiLoCo?
    f"{DEFAULT_ROW}, K=2": ([*MIX, "diloco.quorum_min=2"], 4, SEEDS),
    f"{DEFAULT_ROW}, grace fraction 0.9": ([*MIX, "diloco.grace_fraction=0.9"], 4, (0,)),
    # K = 2 on the default wire (4 bits both ways); without the grace window (below) the
    # default.
    DEFAULT_K2: (K2, 4, SEEDS),
    # Rounds of two learners are closer to synchronous DiLoCo's, which is best at outer lr 0.5
    # (1.605 against 1.673 at 0.7); K = 1 gained nothing from it (1.717 against 1.719).
    f"{DEFAULT_K2}, outer lr 0.5": ([*K2, "outer.lr=0.5"], 4, SEEDS),
    # The grace and merge alternatives for K = 2.
    f"{DEFAULT_K2}, no grace": ([*K2, *NO_GRACE], 4, SEEDS),
    f"{DEFAULT_K2}, mean merge": ([*K2, "diloco.merge=mean"], 4, (0,)),
    # ... and the merge target for the default itself (K = 2 without the window).
    f"{DEFAULT_K2}, no grace, mean merge": ([*K2, *NO_GRACE, "diloco.merge=mean"], 4, SEEDS),
    # A new version applied no earlier than tau steps after the learner's offer, as
    # synchronous DiLoCo does (tau = 1 cost it 4%), instead of on arrival.
    f"{DEFAULT_K2}, no grace, apply at overlap": (
        [*K2, *NO_GRACE, "diloco.apply_at=overlap"],
        4,
        SEEDS,
    ),
    # Stale contributions (based on an older version than the round makes) weighted down,
    # 1 / (1 + staleness): the slower learners' offers are the stale ones.
    f"{DEFAULT_K2}, no grace, staleness penalty 1": (
        [*K2, *NO_GRACE, "diloco.staleness_penalty=1"],
        4,
        SEEDS,
    ),
}
# The model's width (d_model; d_ff 4x), seed 0: is the gap to data-parallel, which M = 1 does
# not have (+0.4%), a cost of splitting the batch that shrinks as the model grows, as DiLoCo's
# scaling laws report? Each row is compared with data-parallel and synchronous DiLoCo of its
# own width.
WIDTHS = (32, 128)
WIDEN = (("d_model", 1), ("d_ff", 4))
SCALE: dict[str, tuple[list[str], int, tuple[int, ...]]] = {
    f"{name}, width {w}": (
        [
            *(VARIANTS | DEFAULT_CHECKS)[name][0],
            *[f"task_args.model.{k}={n * w}" for k, n in WIDEN],
        ],
        4,
        (0,),
    )
    for w in WIDTHS
    for name in ("data_parallel", "synchronous", DEFAULT_K2)
}
# At width 128 DiLoCo fell far behind (synchronous +29.8%, the default +16.7%) at the inner lr
# tuned for data-parallel at width 64: is that lr too large for a learner's quarter batch?
SCALE |= {
    f"{name}, inner lr 0.0015": ([*overrides, "inner.lr=0.0015"], 4, (0,))
    for name, (overrides, _, _) in SCALE.items()
    if name.endswith(", width 128")
}
# The global batch, 4x (a learner's 8 sequences become 32) with 4x the tokens (horizon_config),
# so that every run still takes 2,500 inner steps and about 104 outer steps a fragment: does
# the gap to data-parallel, which M = 1 does not have, shrink when a learner's share of the
# batch grows, as it is in the published runs (millions of tokens a learner step)?
# Data-parallel also at larger inner lrs, which a larger batch may want, and DiLoCo at the
# outer lr synchronous DiLoCo preferred at the smaller batch.
BIG_BATCH = 128
BATCH = f", global batch {BIG_BATCH}"
BATCHED = ("data_parallel", "synchronous", f"{DEFAULT_K2}, no grace")
# The default with rounds of every learner (K = M) instead of two.
K_M = f"{DEFAULT_ROW}, int4 both ways, K=M, no grace"
SCALE |= {f"{name}{BATCH}": ((VARIANTS | DEFAULT_CHECKS)[name][0], 4, SEEDS) for name in BATCHED}
SCALE |= (
    {
        # ... and both DiLoCos at data-parallel's best of these (6e-3: 1.341 against 1.359)
        f"{name}, inner lr {lr}{BATCH}": ([*SCALE[f"{name}{BATCH}"][0], f"inner.lr={lr}"], 4, (0,))
        for name, lrs in zip(BATCHED, ((0.006, 0.012), (0.006,), (0.006,)), strict=True)
        for lr in lrs
    }
    | {
        # synchronous DiLoCo's best outer lr at the smaller batch (1.605 against 1.673 at 0.7)
        f"{name}, outer lr 0.5{BATCH}": ([*SCALE[f"{name}{BATCH}"][0], "outer.lr=0.5"], 4, (0,))
        for name in BATCHED[1:]
    }
    | {
        # What of decoupling costs the default its 1.4% against synchronous DiLoCo at this batch:
        # rounds of every learner instead of two, and synchronous DiLoCo with the mix.
        f"{K_M}{BATCH}": (
            [*K2, *NO_GRACE, "diloco.quorum_min=4"],
            4,
            (0,),
        ),
        f"synchronous, mixing alpha 0.25{BATCH}": (["diloco.mode=synchronous", *MIX], 4, (0,)),
        # ... and the 4-bit wire: the default, and rounds of every learner, on bfloat16
        f"{DEFAULT_ROW}, K=2, no grace{BATCH}": ([*MIX, "diloco.quorum_min=2", *NO_GRACE], 4, (0,)),
        f"{DEFAULT_ROW}, K=M, no grace{BATCH}": ([*MIX, "diloco.quorum_min=4", *NO_GRACE], 4, (0,)),
    }
)
# ... and what is left of the asynchrony when no learner is slower than the others (the
# faster ones otherwise take more of the tokens): both with the mix on the bfloat16 wire.
SAME_SPEED = ", same speed"
SCALE |= {
    f"{name}{SAME_SPEED}{BATCH}": (SCALE[f"{name}{BATCH}"][0], 4, (0,))
    for name in (f"{DEFAULT_ROW}, K=M, no grace", "synchronous, mixing alpha 0.25")
}
# ... and synchronous DiLoCo with the mix at tau = 1, which a decoupled learner in lock-step
# with the others is (tests/unit/test_simulate.py): is that what the same-speed rows measure?
SCALE[f"synchronous, mixing alpha 0.25, overlap 1{BATCH}"] = (
    DEFAULT_CHECKS["synchronous, mixing alpha 0.25, overlap 1"][0],
    4,
    (0,),
)
SCALE |= {
    f"{name}, apply at overlap{BATCH}": (
        [*SCALE[f"{name}{BATCH}"][0], "diloco.apply_at=overlap"],
        4,
        (0,),
    )
    for name in (BATCHED[2], f"{DEFAULT_ROW}, K=M, no grace{SAME_SPEED}")
}
# The default's staleness penalty row at batch 128 (seed 0; at 512, three seeds, below).
STALENESS = f"{BATCHED[2]}, staleness penalty 1"
SCALE[f"{STALENESS}{BATCH}"] = (DEFAULT_CHECKS[STALENESS][0], 4, (0,))
# Global batch 256 (64 sequences a learner, 8x the tokens), three seeds: does the gap keep
# shrinking as a learner's share of the batch grows (+7.2% at 32, +4.3% at 128)?
BIGGER_BATCH = 256
BATCH_256 = f", global batch {BIGGER_BATCH}"
SCALE |= {f"{name}{BATCH_256}": (SCALE[f"{name}{BATCH}"][0], 4, SEEDS) for name in BATCHED}
# ... and each at the inner lr that was data-parallel's best at batch 128 (1.341 against 1.359)
SCALE |= {
    f"{name}, inner lr 0.006{BATCH_256}": ([*SCALE[f"{name}{BATCH}"][0], "inner.lr=0.006"], 4, (0,))
    for name in BATCHED
}
# M = 2 and 8 for the default (the global batch split over them, K = 2), seed 0, at batches 32
# and 256: does the cost of more learners at a fixed token budget, which keeps temporary
# learners from paying off (scavenging), shrink as a learner's share of the batch
# grows (4 sequences a learner at 32 with M = 8, 32 at 256)?
SCALE |= {
    f"{BATCHED[2]}, M={m}{batch}": (SCALE[f"{BATCHED[2]}{BATCH}"][0], m, (0,))
    for batch in ("", BATCH_256)
    for m in (2, 8)
} | {
    # ... and synchronous DiLoCo at M = 8: is the cost one of decoupling or of M itself?
    f"synchronous, M=8{batch}": (["diloco.mode=synchronous"], 8, (0,))
    for batch in ("", BATCH_256)
}
# Global batch 512 (128 sequences a learner, 16x the tokens, about half an hour a run here),
# three seeds: does the gap keep shrinking (+2.6% at 256, three seeds)?
BIGGEST_BATCH = 512
BATCH_512 = f", global batch {BIGGEST_BATCH}"
SCALE |= {f"{name}{BATCH_512}": (SCALE[f"{name}{BATCH}"][0], 4, SEEDS) for name in BATCHED}
# ... where the default fell 1.0% behind synchronous DiLoCo (level at 256): is it the rounds
# of two learners? The default with rounds of every learner (K = M), seed 0.
SCALE[f"{K_M}{BATCH_512}"] = (SCALE[f"{K_M}{BATCH}"][0], 4, (0,))
# ... or the slower learners (the default with every learner at the same speed), and is
# synchronous DiLoCo better with the mix there too, as at 128 (1.395 against 1.398)? Three
# seeds of the first, seed 0 of the second.
SCALE |= {
    f"{BATCHED[2]}{SAME_SPEED}{BATCH_512}": (SCALE[f"{BATCHED[2]}{BATCH}"][0], 4, SEEDS),
    f"synchronous, mixing alpha 0.25{BATCH_512}": (
        DEFAULT_CHECKS["synchronous, mixing alpha 0.25"][0],
        4,
        (0,),
    ),
    # ... and is it less with stale contributions (the slower learners') weighted down?
    f"{STALENESS}{BATCH_512}": (DEFAULT_CHECKS[STALENESS][0], 4, SEEDS),
}
# The curves of quality_horizon.png and their labels: the baselines, the method as written,
# and the default with its alternatives (the grace window, RDA against the mean).
PLOTTED = {
    "data_parallel": "data-parallel",
    "synchronous": "synchronous DiLoCo",
    "synchronous, mixing alpha 0.25": "synchronous DiLoCo, mixing alpha 0.25",
    "decoupled K=M": "decoupled as written, K = M",
    AS_WRITTEN_K1: "decoupled as written, K = 1 with grace",
    PULLED: "the default (pulled rounds, K = 1, unsent work kept)",
    f"{DEFAULT_K2}, no grace": "offers, K = 2 (sqrt step, mix, int4 both ways: the former default)",
    DEFAULT_K2: "the same with the grace window",
    f"{DEFAULT_K2}, no grace, mean merge": "the same with the plain mean, not RDA",
}
# Each row is compared with data-parallel and synchronous DiLoCo of its own width or batch.
BATCHES = {"": GLOBAL_BATCH, BATCH: BIG_BATCH, BATCH_256: BIGGER_BATCH, BATCH_512: BIGGEST_BATCH}
GROUPS = (*(f", width {w}" for w in WIDTHS), BATCH, BATCH_256, BATCH_512)
# The sweeps run seed 0; their best points run every seed: the fraction step's (outer lr 1.4:
# 1.727 against 1.755 at 0.7, 1.737 at 1.0 and 1.863 at 2.0), and the sqrt step's
# and synchronous DiLoCo's (lr 0.5: 1.685 and 1.611 against 1.723 at 0.4 and 0.6 for the sqrt
# step, 1.627 and 1.640 for synchronous) and its mixing alpha (0.25: 1.676 against
# 1.688 at 0.5).
CANDIDATES = (
    f"{FRACTION_STEP}, outer lr 1.4, momentum 0.9",
    f"{DEFAULT}, outer lr 0.5",
    "synchronous, outer lr 0.5",
    DEFAULT_ROW,
)


def group(variant: str) -> str:
    """The width or batch a SCALE row names ("" for the rest): its runs take that setting, and
    it is compared with data-parallel and synchronous DiLoCo of the same."""
    return next((g for g in GROUPS if g in variant), "")


def global_batch(variant: str) -> int:
    return BATCHES.get(group(variant), GLOBAL_BATCH)


def learners(num: int, batch: int, same_speed: bool = False) -> list[dict[str, Any]]:
    """M learners sharing the global `batch`; every other one 18% slower (unless
    `same_speed`), all with jitter."""
    return [
        {
            "name": f"learner-{i}",
            "batch_size": batch // num,
            "jitter": 0.1,
            **({"speed": 0.82} if i % 2 and not same_speed else {}),
        }
        for i in range(num)
    ]


def horizon_config(
    overrides: list[str],
    num: int,
    seed: int,
    quick: bool,
    batch: int = GLOBAL_BATCH,
    same_speed: bool = False,
    as_written: bool = True,
) -> RunConfig:
    """`overrides` on top of AS_WRITTEN, or (not `as_written`) of the config's defaults."""
    base = [*(QUICK if quick else HORIZON), *(AS_WRITTEN if as_written else [])]
    named = "-".join(overrides) or "default"
    even = "-same" if same_speed else ""
    run_dir = f"run_dir=/tmp/quality_horizon/{num}x{batch // num}{even}-{seed}-{named}"
    cfg = load_config(REFERENCE, [*base, *overrides, f"seed={seed}", run_dir])
    tree = cfg.model_dump(mode="json")
    tree["learners"] = learners(num, batch, same_speed)
    tree["token_budget"] = cfg.token_budget * batch // GLOBAL_BATCH  # the same steps
    return build_config(tree, f"{REFERENCE.name} with {num} learners")


def run_one(job: tuple[str, list[str], int, int, bool]) -> dict[str, Any]:
    from ray_diloco.sim.simulate import run_reference

    name, overrides, num, seed, quick = job
    cache_compilations()
    batch = global_batch(name)
    as_written = not name.startswith(PULLED)  # the default's rows start from the defaults
    cfg = horizon_config(overrides, num, seed, quick, batch, SAME_SPEED in name, as_written)
    t0 = time.perf_counter()
    s = run_reference(cfg)
    # Steps of the fastest learner (data-parallel: its one learner, the whole global batch).
    per_learner = s.get("learners", {}).values()
    seq_len = ByteLMArgs(**cfg.task_args).model.seq_len
    whole = s["tokens"] / (batch * seq_len)
    steps = max((r["inner_steps"] for r in per_learner), default=whole)
    d = cfg.diloco
    return {
        "variant": name,
        "seed": seed,
        "learners": num,
        "global_batch": batch,
        "heldout_loss": s["heldout_loss"],
        "tokens": s["tokens"],
        "inner_steps_per_learner": steps,
        "outer_steps_per_fragment": steps / d.sync_every,
        "rounds": s.get("rounds", 0),
        "mean_contributors": s.get("mean_contributors", 0.0),
        "refused": s.get("rejected", {}),
        "bytes_per_token": s["bytes_per_token"],
        # the lowest learner's share of its trained tokens that reached the global model
        "merged_share_min": min((r["merged_share"] for r in per_learner), default=None),
        "wall_s": time.perf_counter() - t0,
        "evals": s["evals"],
    }


def plot_batches(runs: list[dict[str, Any]], path: Path) -> bool:
    """Seed 0 of BATCHED at each global batch they all ran at, a panel each, zoomed on the
    last two thirds of the run (the batch rows' question). False, and no plot, while they
    have not run at the two smallest."""
    from matplotlib.figure import Figure

    from ray_diloco.sim.figures import save_figure

    first = {r["variant"]: r for r in runs if r["seed"] == 0}
    panels = [
        (batch, suffix)
        for suffix, batch in BATCHES.items()
        if all(name + suffix in first for name in BATCHED)
    ]
    if {GLOBAL_BATCH, BIG_BATCH} - {batch for batch, _ in panels}:
        return False
    labels = ("data-parallel", "synchronous DiLoCo", "decoupled (default: K=2, no grace)")
    fig = Figure(figsize=(6 * len(panels), 4.6))
    for ax, (batch, suffix) in zip(fig.subplots(1, len(panels)), panels, strict=True):
        ends = []
        for name, label in zip(BATCHED, labels, strict=True):
            run = first[name + suffix]
            tokens = [e["tokens"] / 1e6 for e in run["evals"]]
            losses = [e["heldout_loss"] for e in run["evals"]]
            ax.plot(tokens, losses, label=f"{label} (ends at {losses[-1]:.3f})", linewidth=1.4)
            ends.append(losses[-1])
        ax.set_xlim(tokens[-1] / 3, tokens[-1] * 1.01)
        ax.set_ylim(min(ends) - 0.05, max(ends) + 0.35)
        per = batch // run["learners"]
        ax.set_title(f"global batch {batch} ({per} sequences a learner), seed 0", fontsize=10)
        ax.set_xlabel("tokens (millions)")
        ax.set_ylabel("held-out loss (global parameters)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, path, dpi=110)
    return True


def gaps(runs: list[dict[str, Any]], variant: str, suffix: str) -> list[float]:
    """`variant` at the global batch `suffix` names against data-parallel at that batch, in %,
    one figure for each seed both ran."""
    dp = {r["seed"]: r["heldout_loss"] for r in runs if r["variant"] == f"data_parallel{suffix}"}
    return [
        100 * (r["heldout_loss"] / dp[r["seed"]] - 1)
        for r in runs
        if r["variant"] == variant + suffix and r["seed"] in dp
    ]


def plot_scaling(runs: list[dict[str, Any]], path: Path) -> bool:
    """Synchronous DiLoCo's and the default's gap to data-parallel of the same global batch:
    against the batch (M = 4; the mean over seeds, bars from the lowest to the highest seed),
    and against M at the smallest and at batch 256 (seed 0). False, and no plot, until every
    point up to batch 256 has run (larger batches join when they have)."""
    from matplotlib.figure import Figure

    from ray_diloco.sim.figures import save_figure

    systems = (("synchronous DiLoCo", BATCHED[1]), ("decoupled (default)", BATCHED[2]))
    by_batch = {
        label: {b: g for suffix, b in BATCHES.items() if (g := gaps(runs, name, suffix))}
        for label, name in systems
    }
    ends = {suffix: BATCHES[suffix] for suffix in ("", BATCH_256)}
    firsts = [r for r in runs if r["seed"] == 0]
    sizes = {label: (4, 8) if name == "synchronous" else (2, 4, 8) for label, name in systems}
    by_m = {
        (label, suffix): [
            gaps(firsts, name if m == 4 else f"{name}, M={m}", suffix) for m in sizes[label]
        ]
        for label, name in systems
        for suffix in ends
    }
    needed = {GLOBAL_BATCH, BIG_BATCH, BIGGER_BATCH}
    if any(needed - set(series) for series in by_batch.values()) or not all(
        g for series in by_m.values() for g in series
    ):
        return False
    fig = Figure(figsize=(12, 4.6))
    left, right = fig.subplots(1, 2)
    colors = dict(zip(by_batch, ("tab:blue", "tab:orange"), strict=True))
    # Each system's points a little apart, so that the seeds' bars do not hide each other.
    apart = dict(zip(by_batch, (0.97, 1.03), strict=True))
    for label, series in by_batch.items():
        means = [statistics.fmean(g) for g in series.values()]
        bars = [
            [m - min(g) for m, g in zip(means, series.values(), strict=True)],
            [max(g) - m for m, g in zip(means, series.values(), strict=True)],
        ]
        seeds = "/".join(str(len(g)) for g in series.values())
        left.errorbar(
            [b * apart[label] for b in series],
            means,
            color=colors[label],
            yerr=bars,
            marker="o",
            capsize=4,
            label=f"{label} (seeds {seeds})",
        )
    batches = sorted({b for series in by_batch.values() for b in series})
    left.set_xscale("log", base=2)
    left.set_xticks(batches, [str(b) for b in batches])
    left.set_xlabel("global batch (sequences a step; 4 learners share it)")
    left.set_title("gap to data-parallel against the batch, M = 4", fontsize=10)
    for (label, suffix), series in by_m.items():
        style = "-" if suffix else "--"
        right.plot(
            sizes[label],
            [g[0] for g in series],
            style,
            color=colors[label],
            marker="o",
            label=f"{label}, global batch {ends[suffix]}",
        )
    right.set_xscale("log", base=2)
    right.set_xticks([2, 4, 8], ["2", "4", "8"])
    right.set_xlabel("learners M (sharing the global batch)")
    right.set_title("gap to data-parallel against M, seed 0", fontsize=10)
    for ax in (left, right):
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_ylabel("held-out loss above data-parallel's (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, path, dpi=110)
    return True


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per variant: mean held-out loss over its seeds, spread (max - min), against
    data-parallel's and synchronous DiLoCo's means (of the same width or batch for SCALE's
    rows)."""
    rows = []
    for name in dict.fromkeys(r["variant"] for r in runs):
        mine = [r for r in runs if r["variant"] == name]
        losses = [r["heldout_loss"] for r in mine]
        refused: dict[str, int] = {}
        for r in mine:
            for reason, n in r["refused"].items():
                refused[reason] = refused.get(reason, 0) + n
        rows.append(
            {
                "variant": name,
                "learners": mine[0]["learners"],
                "seeds": len(mine),
                "heldout_loss": statistics.fmean(losses),
                "spread": max(losses) - min(losses),
                "losses": losses,
                "outer_steps_per_fragment": mine[0]["outer_steps_per_fragment"],
                "rounds": statistics.fmean(r["rounds"] for r in mine),
                "mean_contributors": statistics.fmean(r["mean_contributors"] for r in mine),
                "refused": refused,
                "bytes_per_token": statistics.fmean(r["bytes_per_token"] for r in mine),
                # runs recorded before merged shares were measured have none
                "merged_share_min": min(
                    (r["merged_share_min"] for r in mine if r.get("merged_share_min") is not None),
                    default=None,
                ),
                "wall_s": statistics.fmean(r["wall_s"] for r in mine),
            }
        )
    means = {r["variant"]: r["heldout_loss"] for r in rows}
    for r in rows:
        for ref, key in (("data_parallel", "vs_data_parallel"), ("synchronous", "vs_synchronous")):
            ref += group(r["variant"])
            r[key] = r["heldout_loss"] / means[ref] - 1 if ref in means else None
    return rows


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=1, help="runs side by side (processes)")
    p.add_argument("--only", nargs="*", help="subset of variants (sweep rows included)")
    p.add_argument(
        "--add",
        action="store_true",
        help="keep the runs already in the JSON and run only the (variant, seed) pairs missing",
    )
    p.add_argument("--seeds", type=int, help="at most this many seeds per variant (the first)")
    p.add_argument(
        "--merge",
        type=Path,
        nargs="*",
        default=[],
        help="results JSONs of other runs of this benchmark to take runs from, as with --add",
    )
    args = p.parse_args()
    chosen = {
        n: v
        for n, v in (VARIANTS | DEFAULT_CHECKS | SCALE).items()
        if not args.only or n in args.only
    }
    chosen |= {
        n: (o, 4, SEEDS if n in CANDIDATES else (0,))
        for n, o in (SWEEP | INNER_SWEEP | SQRT_SWEEP).items()
        if not args.only or n in args.only
    }
    name = "quality_horizon-quick" if args.quick else "quality_horizon"
    sources = [*args.merge, *([args.out / f"{name}.json"] if args.add else [])]
    kept: list[dict[str, Any]] = []
    for src in (s for s in sources if s.exists()):
        have = {(r["variant"], r["seed"]) for r in kept}
        runs = json.loads(src.read_text())["meta"]["runs"]
        kept += [r for r in runs if (r["variant"], r["seed"]) not in have]
    done = {(r["variant"], r["seed"]) for r in kept}
    limit = 1 if args.quick else args.seeds
    # Seed 0 of every variant first, so a run stopped early still compares them all.
    jobs = sorted(
        (
            (n, o, m, s, args.quick)
            for n, (o, m, ss) in chosen.items()
            for s in ss[:limit]
            if (n, s) not in done
        ),
        key=lambda j: j[3],
    )
    runs = []
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        for r in pool.map(run_one, jobs):
            runs.append(r)
            print(
                f"{r['variant']} (seed {r['seed']}): held-out {r['heldout_loss']:.4f}, "
                f"{r['outer_steps_per_fragment']:.0f} outer steps per fragment, refused "
                f"{sum(r['refused'].values())} ({r['wall_s']:.0f}s)",
                flush=True,
            )
    # The table in the order the variants are declared.
    order = [*VARIANTS, *SWEEP, *INNER_SWEEP, *SQRT_SWEEP, *DEFAULT_CHECKS, *SCALE]
    runs = sorted(
        kept + runs,
        key=lambda r: (
            order.index(r["variant"]) if r["variant"] in order else len(order),
            r["seed"],
        ),
    )
    rows = summarize(runs)
    args.out.mkdir(parents=True, exist_ok=True)
    # Seed 0 of the plotted variants (the rest only in the table: the 29 variants run
    # with every seed were more than a legend can tell apart), the last third zoomed.
    firsts = [next((r for r in runs if r["variant"] == n), None) for n in PLOTTED]
    curves = [(f"{PLOTTED[r['variant']]} (seed {r['seed']})", r["evals"]) for r in firsts if r]
    plot_loss_curves(curves, args.out / f"{name}.png", zoom_from=2 / 3)
    if not plot_batches(runs, args.out / f"{name}-batch.png"):
        print(f"no {name}-batch.png: it needs seed 0 of {', '.join(BATCHED)} at batches 32, 128")
    if not plot_scaling(runs, args.out / f"{name}-scaling.png"):
        print(f"no {name}-scaling.png: it needs the M = 2 and 8 rows at batches 32 and 256")
    columns = [
        "variant",
        "learners",
        "seeds",
        "heldout_loss",
        "spread",
        "vs_data_parallel",
        "vs_synchronous",
        "outer_steps_per_fragment",
        "mean_contributors",
        "bytes_per_token",
    ]
    write_results(
        args.out,
        name,
        rows,
        columns,
        {
            "config": REFERENCE.name,
            "setting": HORIZON,
            "global_batch": GLOBAL_BATCH,
            "quick": args.quick,
            "jobs": args.jobs,
            "runs": runs,
        },
    )


if __name__ == "__main__":
    main()
