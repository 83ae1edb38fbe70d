"""The method's section of the run config (`diloco:`): modes, the sync schedule, quorum and
grace, the merge, and the outer-step and publication options (docs/algorithm.md sections 3-7)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from ray_diloco.config.base import WireDtype, _Frozen

Mode = Literal["decoupled", "synchronous", "data_parallel"]


class DilocoConfig(_Frozen):
    """The method's knobs; names follow docs/algorithm.md. Each variant is a function of
    algorithm/variants.py; docs/decisions/020-variants-as-strategies.md has the measurements
    behind every default."""

    mode: Mode = "decoupled"
    sync_every: int = Field(24, ge=1, description="H: inner steps between two syncs of a fragment")
    num_fragments: int = Field(24, ge=1, description="P: fragments the parameters are cut into")
    overlap_steps: int = Field(2, ge=0, description="tau: steps a sync may take before it is due")
    schedule: Literal["offer", "pull"] = Field(
        "pull",
        description="who times a sync: each learner on its own step count, or the synchronizer "
        "pulling every live learner when the fragment falls due on the leading one's "
        "(the default in decoupled mode; the other modes offer)",
    )
    quorum_min: int = Field(1, ge=1, description="K: fewest learners a round merges")
    grace_fraction: float = Field(
        0.0, ge=0, lt=1, description="gamma: share of the slowest learner's slack the round waits"
    )
    grace_max_s: float = Field(5.0, ge=0, description="longest grace window, seconds")
    merge: Literal["rda", "mean"] = Field("rda", description="how a round's deltas combine")
    mixing_alpha: float = Field(
        0.25, ge=0, lt=1, description="share of its own values a learner keeps on a new version"
    )
    keep_unsent_work: bool = Field(
        True,
        description="carry unsent local work onto a new version instead of overwriting it "
        "(the default in decoupled mode; the other modes mix)",
    )
    apply_at: Literal["arrival", "overlap"] = Field(
        "arrival", description="when a new version is applied: on arrival or tau after the offer"
    )
    late_policy: Literal["next_round", "drop"] = Field(
        "next_round", description="what becomes of an offer that arrives while its round merges"
    )
    publish_to: Literal["all", "contributors"] = Field(
        "all", description="who receives a merged fragment: every live learner or its contributors"
    )
    outer_anchor: Literal["current", "base"] = Field(
        "current", description="outer gradient G - theta at the current G, or the own update"
    )
    round_step: Literal["full", "share", "fraction", "sqrt", "sqrt_each"] = Field(
        "sqrt", description="how much of an outer step a round of some of the learners takes"
    )
    accelerate: Literal["window", "all"] = Field(
        "window", description="outer-optimizer share: one sync window's worth of a round, or all"
    )
    staleness_penalty: float = Field(
        0.0, ge=0, description="merge weight / (1 + penalty x versions behind)"
    )
    max_staleness_versions: int = Field(8, ge=0, description="oldest base a round accepts")
    norm_guard: float = Field(
        10.0, gt=1, description="refuse an update per step this many times the recent median"
    )
    norm_guard_warmup_rounds: int = Field(5, ge=0, description="rounds before the norm guard arms")
    wire_dtype: WireDtype = Field("int4", description="encoding of offers up")
    publish_delta: Literal["none", "int8", "int4", "int2"] = Field(
        "int4", description="publications down: the value, or a quantized difference"
    )
    int4_block_size: int = Field(64, ge=2, description="elements per scale, int4 and int2")

    @property
    def final_rounds(self) -> bool:
        """A run on Ray ends with final rounds: at the budget every learner hands in its
        unsent work and each fragment merges it in one last round (docs/decisions/
        031-final-rounds.md). Decoupled mode only: a synchronous round is the barrier the
        in-process reference stops at, step for step, and a run reproduces it."""
        return self.mode == "decoupled"

    @model_validator(mode="before")
    @classmethod
    def _decoupled_defaults(cls, data: Any) -> Any:
        # A synchronous or data-parallel learner blocks on the fragments it offers on its own
        # count, and there a kept window of unsent work measured worse than the mix
        # (docs/decisions/022-pulled-rounds.md): those modes keep the earlier defaults for
        # what they were not given (asking for pull there is refused).
        if isinstance(data, dict) and data.get("mode", "decoupled") != "decoupled":
            return {**NOT_DECOUPLED, **data}
        return data


# The defaults of the modes other than decoupled, where they differ.
NOT_DECOUPLED = {"schedule": "offer", "keep_unsent_work": False}
