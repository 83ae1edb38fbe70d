"""Layer: algorithm (pure, no Ray). Checkpoints of the synchronizer's state with Orbax.

A checkpoint is a nested dict of NumPy arrays (global fragments, outer optimizer state, the
published values learners' deltas refer to) plus JSON-able metadata (round book, token ledger,
byte counters, the digest of the config that shaped the state). `Checkpointer` writes one
numbered step per save through an Orbax `CheckpointManager`, which writes into a temporary
directory and renames it when complete, so a crash mid-save never leaves a half checkpoint that
`restore` could pick up; it keeps the newest `keep` steps. `sync_state_to_tree` and
`sync_state_from_tree` convert `SynchronizerCore.state_dict()` to and from that split form
(docs/algorithm.md section 7: a restarted synchronizer keeps fragments, versions and the ledger).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ray_diloco.config import RunConfig

logger = logging.getLogger(__name__)

ARRAYS, META = "arrays", "meta"


def state_digest(cfg: RunConfig) -> str:
    """Digest of what shapes the synchronizer's state (task, seed, fragments, outer
    optimizer, shards): a checkpoint is restored only into a run with the same digest."""
    shape = {
        "seed": cfg.seed,
        "task": cfg.task,
        "task_args": cfg.task_args,
        "outer": cfg.outer.model_dump(mode="json"),
        "num_fragments": cfg.diloco.num_fragments,
    }
    if cfg.synchronizer.num_shards > 1:  # (absent for one: older checkpoints still restore)
        shape["num_shards"] = cfg.synchronizer.num_shards
    return hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:16]


class Checkpointer:
    """Numbered, atomic checkpoints in `directory`, the newest `keep` kept."""

    def __init__(self, directory: str | Path, keep: int) -> None:
        import orbax.checkpoint as ocp  # slow import (~2 s): only where checkpoints are used

        self._ocp = ocp
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=False
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=(ARRAYS, META)
        )

    def latest_step(self) -> int | None:
        self._manager.reload()  # another process (a previous incarnation) may have written
        step = self._manager.latest_step()
        return None if step is None else int(step)

    def save(self, step: int, arrays: Mapping[str, Any], metadata: Mapping[str, Any]) -> Path:
        ocp = self._ocp
        self._manager.save(
            step,
            args=ocp.args.Composite(
                **{ARRAYS: ocp.args.StandardSave(dict(arrays)), META: ocp.args.JsonSave(metadata)}
            ),
            force=True,
        )
        self._manager.wait_until_finished()
        return self.directory / str(step)

    def restore(self, step: int | None = None) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """(arrays, metadata) of `step` (default: the newest), or None when there is none."""
        step = self.latest_step() if step is None else step
        if step is None:
            return None
        ocp = self._ocp
        out = self._manager.restore(
            step,
            args=ocp.args.Composite(
                **{ARRAYS: ocp.args.StandardRestore(), META: ocp.args.JsonRestore()}
            ),
        )
        arrays = jax.tree.map(np.asarray, dict(out[ARRAYS]))
        return arrays, dict(out[META])

    def close(self) -> None:
        self._manager.close()


def global_values(arrays: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The global parameters (every fragment's value, a flat dict) in a checkpoint's arrays."""
    out: dict[str, np.ndarray] = {}
    for values in arrays["values"].values():
        out.update({k: np.asarray(v) for k, v in values.items()})
    return out


def sync_state_to_tree(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split `SynchronizerCore.state_dict()` into arrays (string keys only, as Orbax wants)
    and JSON metadata. Outer optimizer states are stored as their flat leaf lists."""
    arrays = {
        "values": {str(p): dict(v) for p, v in state["values"].items()},
        "outer": {
            str(p): {str(i): np.asarray(leaf) for i, leaf in enumerate(jax.tree.leaves(s))}
            for p, s in state["outer_states"].items()
        },
        "published": {
            str(p): {str(v): dict(vals) for v, vals in hist.items()}
            for p, hist in state["published"].items()
        },
    }
    meta = {
        "book": _jsonable(state["book"]),
        "ledger": _jsonable(state["ledger"]),
        "bytes_up": dict(state["bytes_up"]),
        "bytes_down": dict(state["bytes_down"]),
    }
    return arrays, meta


def sync_state_from_tree(
    arrays: Mapping[str, Any], meta: Mapping[str, Any], outer_templates: Mapping[int, Any]
) -> dict[str, Any]:
    """Inverse of `sync_state_to_tree`; `outer_templates` (a fresh core's `outer_states`, one
    per fragment it owns) give the optimizer states' structure back."""
    outer = {}
    for p, template in outer_templates.items():
        leaves = arrays["outer"][str(p)]
        flat = [np.asarray(leaves[str(i)]) for i in range(len(leaves))]
        outer[p] = jax.tree.unflatten(jax.tree.structure(template), flat)
    return {
        "values": {p: dict(arrays["values"][str(p)]) for p in outer_templates},
        "outer_states": outer,
        "published": {
            p: {int(v): dict(vals) for v, vals in arrays["published"][str(p)].items()}
            for p in outer_templates
        },
        "book": meta["book"],
        "ledger": meta["ledger"],
        "bytes_up": meta["bytes_up"],
        "bytes_down": meta["bytes_down"],
    }


def _jsonable(obj: Any) -> Any:
    """JSON round trip: int dict keys become strings (the loaders convert them back)."""
    return json.loads(json.dumps(obj, default=float))
