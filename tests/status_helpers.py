"""Actor statuses for unit tests: every field filled with a plain default, overridable."""

from __future__ import annotations

from typing import Any

from ray_diloco.control.protocol import SynchronizerStatus


def sync_status(**fields: Any) -> SynchronizerStatus:
    defaults: dict[str, Any] = dict(
        run="r",
        shard=0,
        fragments=[0],
        rss_mb=100.0,
        started_at=0.0,
        config_digest="d",
        num_params=10,
        tokens_per_example=8,
        tokens=0,
        rounds=0,
        versions={},
        live=[],
        mean_contributors=0.0,
        contributions_merged={},
        tokens_merged={},
        heldout_loss=None,
        evals=[],
        bytes_up={},
        bytes_down={},
        rejected={},
        ledger_violations=[],
        tokens_dropped=0,
        recovering=[],
        checkpoint_writing=False,
        learners={},
        finished=False,
        merge_error=None,
        restored=None,
        registered={},
        merged_incarnations={},
        merged_steps={},
        events=[],
        event_seq=0,
    )
    return SynchronizerStatus(**(defaults | fields))
