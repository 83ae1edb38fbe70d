"""Layer: sim (pure, no Ray). What a reference run reports: the summary of a DiLoCo
run (tokens, rounds, bytes, refusals, the ledger's accounts) and the measures shared with the
data-parallel run (goodput, work lost, the fields every summary has). `simulate.py` drives the
runs; this module only reads their cores."""

from __future__ import annotations

from typing import Any

import numpy as np

from ray_diloco.algorithm.learner_core import LearnerCore
from ray_diloco.algorithm.links import ring_allreduce_bytes
from ray_diloco.algorithm.setup import Setup
from ray_diloco.algorithm.sync_core import SynchronizerCore


def rounds_closed(sync: SynchronizerCore) -> int:
    return sum(sync.book.versions().values())


def lost_fraction(sync: SynchronizerCore) -> float:
    """Share of trained tokens whose contribution was fenced or dropped by a guard: work that
    never reaches the global model (docs/algorithm.md section 9, "work lost"). The tau overlap steps
    that an overwrite (mixing_alpha = 0) replaces are the merge rule, not lost time."""
    # A contribution carries the tokens of its steps on one fragment: the work lost is its
    # tokens over those trained on every fragment (equal-sized fragments, as `merged_share`).
    trained = sync.ledger.tokens_trained * len(sync.owned)
    return sync.rejected_tokens / trained if trained else 0.0


def goodput(busy: list[float], until: list[float]) -> float:
    """Fault-free goodput (docs/algorithm.md section 9): step seconds over allocated seconds, each
    learner's allocation ending with its last completed step (the step it is in when the budget
    is reached is cut off by stopping, not lost). What remains lost is time blocked on a
    barrier, waiting for the slowest host or for the all-reduce."""
    return sum(busy) / sum(until) if sum(until) else 1.0


def full_snapshot(setup: Setup) -> dict[int, tuple[int, dict[str, Any]]]:
    return {
        p: (0, {k: np.asarray(setup.init[k]) for k in paths})
        for p, paths in enumerate(setup.plan.fragments)
    }


def common_summary(setup: Setup, evals: list[dict[str, float]], now: float) -> dict[str, Any]:
    cfg = setup.cfg
    return {
        "mode": cfg.diloco.mode,
        "heldout_loss": evals[-1]["heldout_loss"],
        "virtual_time_s": now,
        "num_params": setup.num_params(),
        "evals": evals,
    }


def summarize_diloco(
    setup: Setup,
    sync: SynchronizerCore,
    learners: list[LearnerCore],
    evals: list[dict[str, float]],
    now: float,
) -> dict[str, Any]:
    cfg = setup.cfg
    tokens = sync.ledger.tokens_trained
    moved = sum(sync.bytes_up.values()) + sum(sync.bytes_down.values())
    tokens_per_dp_step = sum(lg.batch_size for lg in cfg.learners) * (
        setup.task.data.tokens_per_example
    )
    # What a data-parallel job of these hosts would move: a ring all-reduce every step.
    hosts = cfg.num_learners
    dp_bytes = tokens / tokens_per_dp_step * ring_allreduce_bytes(setup.param_bytes(), hosts)
    dp_bytes *= hosts
    shares = sync.merged_shares()
    merged = [a.contributions for a in sync.ledger.accounts.values()]
    rounds = rounds_closed(sync)
    return {
        **common_summary(setup, evals, now),
        "tokens": tokens,
        "rounds": rounds,
        "mean_contributors": sum(merged) / rounds if rounds else 0.0,
        "bytes_up": sum(sync.bytes_up.values()),
        "bytes_down": sum(sync.bytes_down.values()),
        "bytes_total": moved,
        "bytes_per_token": moved / max(1, tokens),
        "dp_bytes_per_token": dp_bytes / max(1, tokens),
        "rejected": dict(sync.rejected),
        # tokens that reached the global model, averaged over fragments
        "tokens_merged": sum(sync.ledger.tokens_merged(p) for p in range(setup.plan.num_fragments))
        / setup.plan.num_fragments,
        # the share of all trained tokens whose work reached the global model
        "merged_share": sum(sync.ledger.tokens_merged(p) for p in range(setup.plan.num_fragments))
        / (setup.plan.num_fragments * max(1, tokens)),
        "ledger_violations": sync.ledger.violations(),
        "learners": {
            core.name: {
                "inner_steps": core.step,
                "tokens": core.cursor,
                "contributions_merged": sync.ledger.account(core.name).contributions,
                "merged_share": shares.get(core.name, 0.0),
                # the share of its trained tokens a new version overwrote before it offered them
                "overwritten_share": core.overwritten_tokens
                / (setup.plan.num_fragments * max(1, core.cursor)),
            }
            for core in learners
        },
    }
