"""Layer: runtime (Ray shell). What a Ray run's `summary.json` holds: the keys of the reference
run's summary that apply (`sim/run_summary.py`), from the synchronizer's combined status and
the supervisor's, plus the wall-clock measures of the run."""

from __future__ import annotations

import time
from typing import Any

from ray_diloco.algorithm.links import ring_allreduce_bytes
from ray_diloco.config import RunConfig
from ray_diloco.control.protocol import SupervisorStatus, SynchronizerStatus


def run_summary(
    cfg: RunConfig,
    st: SynchronizerStatus,
    sup: SupervisorStatus,
    loss: float,
    t0: float,
) -> dict[str, Any]:
    """The keys of `run_summary.summarize_diloco` that apply, wall-clock measures, and what the
    supervisor measured from the event tape: goodput, uptime, restarts, faults and recovery."""
    tokens, wall_s = st.tokens, time.time() - t0
    up, down = sum(st.bytes_up.values()), sum(st.bytes_down.values())
    tokens_per_dp_step = sum(lg.batch_size for lg in cfg.learners) * st.tokens_per_example
    allreduce = ring_allreduce_bytes(4 * st.num_params, cfg.num_learners)
    dp_per_token = allreduce * cfg.num_learners / tokens_per_dp_step
    final, watched = sup.final, sup.learners
    names = [lg.name for lg in cfg.learners] + [
        n for n in watched if n not in {lg.name for lg in cfg.learners}
    ]  # and every learner that joined
    shares = st.merged_shares()
    trained = {n: sup.learner_seconds.get(n, {}).get("training", 0.0) for n in names}
    busy = sum(trained.values())
    return {
        "mode": cfg.diloco.mode,
        "heldout_loss": loss,
        "num_params": st.num_params,
        "evals": [{**e, "t": e["time"] - t0} for e in st.evals],
        "tokens": tokens,
        "token_budget": cfg.token_budget,
        "rounds": st.rounds,
        "mean_contributors": st.mean_contributors,
        "bytes_up": up,
        "bytes_down": down,
        "bytes_total": up + down,
        "bytes_per_token": (up + down) / max(1, tokens),
        "dp_bytes_per_token": dp_per_token,
        "bytes_per_link": {
            n: {"up": st.bytes_up.get(n, 0), "down": st.bytes_down.get(n, 0)} for n in names
        },
        "rejected": st.rejected,
        "ledger_violations": st.ledger_violations,
        "tokens_dropped": st.tokens_dropped,
        "wall_time_s": wall_s,
        "tokens_per_s": tokens / max(wall_s, 1e-9),
        "goodput": sup.goodput,
        # Only the training time whose work reached the global model counts as productive.
        "goodput_merged": sup.goodput
        * (sum(trained[n] * shares.get(n, 0.0) for n in names) / busy if busy else 0.0),
        "merged_share": st.merged_share(),
        "uptime": sup.uptime,
        "uptime_window_s": sup.uptime_window_s,
        "num_failures": sup.num_failures,
        "recovery": sup.recovery,
        "faults": sup.faults,
        "synchronizer_restores": sup.synchronizer.restores,
        "learners": {
            n: {
                "inner_steps": (  # its own final status, else its last progress report
                    final[n].step
                    if n in final
                    else (st.learners[n].step if n in st.learners else None)
                ),
                "tokens": st.learners[n].cursor if n in st.learners else 0,  # the ledger's
                "final_cursor": final[n].cursor if n in final else None,  # the learner's own
                "contributions_merged": st.contributions_merged.get(n, 0),
                "merged_share": shares.get(n, 0.0),
                "state": watched[n].state.value if n in watched else None,
                "incarnation": watched[n].incarnation if n in watched else 0,
                "restarts": watched[n].restarts if n in watched else 0,
                "seconds": sup.learner_seconds.get(n, {}),
                "layout": final[n].layout if n in final else None,  # mesh and bytes per device
            }
            for n in names
        },
    }
