"""The method's section of the run config (`diloco:`): modes, the sync schedule, quorum and
grace, the merge, and the outer-step and publication options (docs/algorithm.md sections 3-7)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ray_diloco.config.base import WireDtype, _Frozen

Mode = Literal["decoupled", "synchronous", "data_parallel"]


class DilocoConfig(_Frozen):
    """The method's knobs; names follow docs/algorithm.md."""

    mode: Mode = "decoupled"
    sync_every: int = Field(24, ge=1, description="H: inner steps between two syncs of a fragment")
    num_fragments: int = Field(24, ge=1, description="P")
    overlap_steps: int = Field(2, ge=0, description="tau")
    # K. 1 here, valid for any number of learners; the 4-learner job files take 2 (half the
    # learners) without the grace window, which beat K = 1 at the quality horizon and under
    # failures (docs/decisions/002-quorum-of-two-without-grace.md). K = 2 of 2 would be a barrier.
    quorum_min: int = Field(1, ge=1, description="K")
    grace_fraction: float = Field(0.5, ge=0, lt=1, description="gamma")
    grace_max_s: float = Field(5.0, ge=0)
    merge: Literal["rda", "mean"] = "rda"
    # When a new version of a fragment arrives, a learner keeps this share of its own values:
    # params = alpha params + (1 - alpha) G (Streaming DiLoCo's mixing; docs/algorithm.md section 4
    # overwrites, alpha 0). 0.25 beat overwriting at every horizon measured, on every seed
    # (docs/decisions/004-mix-new-versions.md).
    mixing_alpha: float = Field(0.25, ge=0, lt=1)
    # What a learner does with its unsent work on a fragment (the steps since it last offered
    # it) when a new version arrives. False: the new version overwrites it (docs/algorithm.md
    # section 4). True: it is carried onto the new version, params = G + (params - theta at
    # the last offer), and counted in the next offer; with K = 1 and publish_to all, the
    # overwrite discarded half of all learner steps (benchmarks/quality_horizon.py).
    keep_unsent_work: bool = False
    # When a decoupled learner applies a new version of a fragment it offered. "arrival": at
    # the first step boundary after it arrives (docs/algorithm.md section 4). "overlap": no earlier
    # than overlap_steps after its offer, as synchronous mode does (Streaming DiLoCo), but
    # without waiting for it. A learner in lock-step with the others applies one step after
    # its offer on arrival, which is synchronous DiLoCo with tau = 1, and that cost it 4%
    # against tau = 2 at the quality horizon's batch 32 (0.5% at 128); holding did not help
    # the default there (docs/decisions/019-apply-on-arrival-no-staleness-penalty.md).
    apply_at: Literal["arrival", "overlap"] = "arrival"
    late_policy: Literal["next_round", "drop"] = "next_round"
    # Who receives a merged fragment. "all": every live learner (docs/algorithm.md section 5).
    # "contributors": only the learners whose contributions the round merged (one version back
    # per contribution, as in Streaming DiLoCo), so no learner's local progress on a fragment
    # is overwritten by rounds it took no part in, and fewer bytes move down; a learner whose
    # contribution is refused gets the newest version at once. With full-size one-learner
    # rounds its stale bases pulled G back (K = 1 without grace diverged); with the share step
    # it measured the best K = 1 variant in-process, but Ray runs did not track it
    # (docs/decisions/016-publish-to-all.md).
    publish_to: Literal["all", "contributors"] = "all"
    # Where a contribution's outer gradient is anchored. "current": G - theta, at the
    # synchronizer's current value (docs/algorithm.md section 6); a stale learner's theta then pulls
    # G back toward its old base. "base": base - theta, the learner's own update (Streaming
    # DiLoCo), whatever happened to G since.
    outer_anchor: Literal["current", "base"] = "current"
    # How far one round steps. "full": the outer step of the merged gradient, however few
    # learners it merged (docs/algorithm.md section 6). "share": scaled by the share of the live
    # learners it merged, so that M one-learner rounds step about as far as one round of all M
    # (not M times as far). "fraction": the round is that share of an outer step, momentum
    # included: the momentum also decays by momentum^share, so M one-learner rounds decay it
    # as one round of all M does (with "share" it decays M times per window); it beat "full"
    # in every setting measured. "sqrt", the default: the round is sqrt(share) of an outer
    # step, as "fraction" otherwise: a round of every learner is still one whole step, a
    # one-learner round of 4 half of one. It beat "fraction" at both quality horizons, where
    # "fraction" wanted twice the outer lr for its partial rounds but not for whole ones
    # (docs/decisions/005-sqrt-round-step.md). "sqrt_each": each learner a round merged is
    # 1/sqrt(learners) of a step, the round at most one: a one-learner round steps as with
    # "sqrt", but the step of a window no longer depends on how the grace window grouped its
    # contributions into rounds (with "sqrt", two learners of 4 in one round take 0.71 of a
    # step, in two rounds 2 x 0.5).
    round_step: Literal["full", "share", "fraction", "sqrt", "sqrt_each"] = "sqrt"
    # How much of a round's merged outer gradient the outer optimizer (lr, momentum) takes.
    # "all": the whole of it (docs/algorithm.md section 6). "window": one sync window's worth: a
    # round whose contributions cover m > 1 windows of H inner steps (weighted as the merge
    # weighs them) gives the optimizer 1/m of it and moves G by the rest as it is (lr 1, no
    # momentum): the work learners did through a synchronizer outage is taken, not amplified.
    # Rounds of at most one window (every round of a fault-free run) are the same either way.
    accelerate: Literal["window", "all"] = "window"
    # A contribution's merge weight is divided by 1 + penalty x staleness (versions its base is
    # behind the round's). 1 measured no better than 0 beyond the seeds' spread at global
    # batches 32, 128 and 512 (docs/decisions/019-apply-on-arrival-no-staleness-penalty.md).
    staleness_penalty: float = Field(0.0, ge=0)
    max_staleness_versions: int = Field(4, ge=0)
    # The norm guard (docs/algorithm.md section 7) refuses a contribution whose own update (its
    # delta to its base) per inner step is more than `norm_guard` times the median of the fragment's
    # last 32 accepted ones; it judges updates taken after the inner warm-up (`inner.
    # warmup_steps`) once the fragment closed `norm_guard_warmup_rounds` rounds.
    norm_guard: float = Field(10.0, gt=1)
    norm_guard_warmup_rounds: int = Field(5, ge=0)
    # 4 bits both ways by default: never measurably worse than the bfloat16 wire at any
    # horizon measured (docs/decisions/007-four-bits-both-ways.md), at a quarter of the bytes.
    wire_dtype: WireDtype = "int4"
    # How a publication goes down. "none": the new value itself, in bfloat16 (float32 when
    # `wire_dtype` is float32). int8/int4/int2: the quantized difference to the version the
    # learner holds, with the synchronizer carrying the quantization error into the next one
    # (algorithm/downstream.py); a learner holding no known version gets the full value.
    publish_delta: Literal["none", "int8", "int4", "int2"] = "int4"
    int4_block_size: int = Field(64, ge=2, description="elements per scale, int4 and int2")
