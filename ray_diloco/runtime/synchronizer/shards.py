"""Layer: runtime (Ray shell). The synchronizer's shards, seen as one synchronizer.

A run's synchronizer is `synchronizer.num_shards` named, detached actors: shard 0 keeps the
configured name (a one-shard run is exactly the single synchronizer it always was), shard s
is `<name>-shard<s>`. Each owns a disjoint set of fragments (`algorithm/shards.py`): their
global values, outer state, versions, round books and checkpoints. Shard 0 also owns the data
pool (the leases it hands out) and the held-out evaluation, which reads the other shards'
fragments. Every shard receives every progress report, so each knows who is live and where
each learner's cursor is (the token budget is read from them, the same in every shard).

`ShardSet` is what the driver holds: every shard's handle, one combined `status` (rounds
summed, versions, per-learner counters and rejections added up, ledger violations of all,
learners and evaluations from shard 0: `combine_status`), and the calls that go to all.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import ray

from ray_diloco.config import RunConfig
from ray_diloco.control.protocol import ShardSummary, SynchronizerStatus

logger = logging.getLogger(__name__)


def shard_name(cfg: RunConfig, shard: int) -> str:
    name = cfg.synchronizer.name
    return name if shard == 0 else f"{name}-shard{shard}"


def shard_handles(cfg: RunConfig) -> list[Any]:
    """Every shard's handle, looked up by name (the shards must exist)."""
    ns = cfg.synchronizer.namespace
    return [
        ray.get_actor(shard_name(cfg, s), namespace=ns) for s in range(cfg.synchronizer.num_shards)
    ]


def _add(into: dict[str, int], more: dict[str, int]) -> None:
    for k, v in more.items():
        into[k] = into.get(k, 0) + v


def combine_status(statuses: list[SynchronizerStatus | None]) -> SynchronizerStatus:
    """One synchronizer status from the shards' (`None` for a shard that has not answered:
    its rounds and counters are missing until it does). Shard 0's must be there."""
    first = statuses[0]
    assert first is not None, "shard 0 holds the learners, the data and the evaluations"
    answered = [st for st in statuses if st is not None]
    rounds = sum(st.rounds for st in answered)
    merged: dict[str, int] = {}
    tokens_merged: dict[str, int] = {}
    up: dict[str, int] = {}
    down: dict[str, int] = {}
    rejected: dict[str, int] = {}
    for st in answered:
        _add(merged, st.contributions_merged)
        _add(tokens_merged, st.tokens_merged)
        _add(up, st.bytes_up)
        _add(down, st.bytes_down)
        _add(rejected, st.rejected)
    errors = [(st.shard, st.merge_error) for st in answered if st.merge_error]
    # A learner's last merged contribution, whichever shard merged it.
    latest: dict[str, tuple[int, int]] = {}
    for st in answered:
        for name, step in st.merged_steps.items():
            if step >= latest.get(name, (-1, -1))[1]:
                latest[name] = (st.merged_incarnations[name], step)
    registered = dict(first.registered)
    for st in answered[1:]:
        for name, reg in st.registered.items():
            mine = registered.get(name)
            if mine is not None and mine.incarnation == reg.incarnation:
                versions = {**mine.versions, **reg.versions}
                registered[name] = dataclasses.replace(mine, versions=versions)
    return dataclasses.replace(
        first,
        rounds=rounds,
        versions={p: v for st in answered for p, v in st.versions.items()},
        contributions_merged=merged,
        tokens_merged=tokens_merged,
        bytes_up=up,
        bytes_down=down,
        rejected=rejected,
        mean_contributors=sum(merged.values()) / rounds if rounds else 0.0,
        ledger_violations=[
            f"shard {st.shard}: {v}" if st.shard else v
            for st in answered
            for v in st.ledger_violations
        ],
        merge_error=next((f"shard {s}: {e}" if s else e for s, e in errors), None),
        merged_incarnations={n: inc for n, (inc, _) in latest.items()},
        merged_steps={n: step for n, (_, step) in latest.items()},
        registered=registered,
        shards=[
            None if st is None else ShardSummary(st.shard, st.rounds, st.restored, st.rss_mb)
            for st in statuses
        ],
    )


class ShardSet:
    """The driver's handle on every shard."""

    def __init__(self, cfg: RunConfig, handles: list[Any]) -> None:
        self.cfg, self.handles = cfg, handles

    @property
    def first(self) -> Any:
        return self.handles[0]

    def status(self, since_event: int, timeout_s: float) -> SynchronizerStatus:
        """The combined status, waiting for every shard (one being restored answers late)."""
        refs = [h.status.remote(since_event) for h in self.handles]
        return combine_status(ray.get(refs, timeout=timeout_s))

    def evaluate(self, timeout_s: float) -> float:
        """Held-out loss of the global parameters (shard 0 gathers every shard's)."""
        return float(ray.get(self.first.evaluate.remote(), timeout=timeout_s))

    def final_rounds(self, timeout_s: float) -> int:
        """Every shard merges the learners' last work (the run's end); the rounds merged."""
        refs = [h.final_rounds.remote(timeout_s) for h in self.handles]
        return sum(ray.get(refs, timeout=timeout_s + 30))

    def checkpoint(self, timeout_s: float) -> None:
        ray.get([h.checkpoint.remote() for h in self.handles], timeout=timeout_s)

    def shutdown(self, timeout_s: float) -> None:
        """Stop every shard's rounds and write its last checkpoint."""
        ray.get([h.shutdown.remote() for h in self.handles], timeout=timeout_s)

    def kill(self) -> None:
        for h in self.handles:
            ray.kill(h, no_restart=True)

    def names(self) -> list[str]:
        return [shard_name(self.cfg, s) for s in range(len(self.handles))]
