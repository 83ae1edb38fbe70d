"""A synchronizer sharded over two actors on a local Ray: a shard killed mid-run stalls only its
own fragments: the other shard's rounds go on, the dead one is restored and the run reaches its
budget. (A synchronous two-shard run reproduces the one-synchronizer reference run:
tests/ray/test_train.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ray_diloco.config import RunConfig, load_config
from tests.stop_helpers import stop_after

pytestmark = pytest.mark.ray

RESTORED = "shard restored and trained on"
TINY = Path(__file__).resolve().parents[1] / "fixtures" / "tiny_train.yaml"


def tiny(tmp_path: Path, name: str, *overrides: str) -> RunConfig:
    return load_config(
        TINY,
        [
            f"run_dir={tmp_path / name}",
            f"synchronizer.name=sync-{name}",
            "synchronizer.num_shards=2",
            *overrides,
        ],
    )


@pytest.mark.timeout(300)
def test_a_killed_shard_stalls_only_its_fragments(ray_local: Any, tmp_path: Path) -> None:
    from ray_diloco.control.events import (
        FaultInjected,
        RoundClosed,
        SynchronizerRestored,
    )
    from ray_diloco.control.tape import read_tape
    from ray_diloco.runtime.driver import run_training

    # About 12 s of paced training: the kill comes at 2 s, and the run goes on past the budget
    # until the shard is back.
    budget = 60_000
    cfg = tiny(
        tmp_path,
        "kill-shard",
        "diloco.mode=decoupled",
        # A ceiling: the run stops once the budget is spent, the shard was restored and a
        # quarter of the budget more was trained (its fragments' rounds go on after the
        # restore). The restore itself waits for a live learner's report after the shard's
        # restart, which took longer than a whole 120k-token run on a loaded CI machine.
        f"token_budget={8 * budget}",
        f"inner.decay_tokens={budget}",
        "pace=step_time",
        "step_time_s=0.05",
        "synchronizer.heartbeat_timeout_s=5",
        "chaos.enabled=true",
        'chaos.schedule=[{"at_s": 2, "kind": "kill_synchronizer", "target": "1"}]',
    )
    stop = stop_after(lambda sup: sup.synchronizer.restores > 0, budget, RESTORED)
    summary = run_training(cfg, progress=lambda line: None, stop_when=stop)
    assert summary["stop_reason"] == RESTORED, summary["stop_reason"]
    assert summary["tokens"] >= budget
    assert summary["synchronizer_restores"] == 1 and summary["ledger_violations"] == []
    events = read_tape(Path(cfg.run_dir) / "events.jsonl")
    (kill,) = [e for e in events if isinstance(e, FaultInjected)]
    (restored,) = [e for e in events if isinstance(e, SynchronizerRestored)]
    assert restored.shard == 1 and kill.t < restored.t
    rounds = [e for e in events if isinstance(e, RoundClosed)]
    outage = [e for e in rounds if kill.t < e.t < restored.t]
    assert outage and {e.shard for e in outage} == {0}, outage  # shard 0 went on alone
    assert any(e.shard == 1 and e.t > restored.t for e in rounds)  # and shard 1 came back
    last: dict[int, int] = {}
    for e in rounds:  # versions never go backwards, per fragment
        assert e.version > last.get(e.fragment, 0), (e, last)
        last[e.fragment] = e.version
