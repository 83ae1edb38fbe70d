"""The supervisor's watch on a synchronizer shard (`runtime/synchronizer/watch.py`) times its
answers out as a learner host's are: a shard that answers slowly but steadily (a busy machine)
is not lost; one that stops answering is, within the ceiling."""

from __future__ import annotations

import time
from typing import Any

import pytest
import ray

from ray_diloco.config import SupervisorConfig
from ray_diloco.control.events import SynchronizerLost
from ray_diloco.control.supervision import heartbeat_cadence
from ray_diloco.runtime.synchronizer.watch import SyncWatch
from tests.status_helpers import sync_status

pytestmark = pytest.mark.ray


# Decorated in place, so Ray pickles the class by value (workers cannot import test modules).
@ray.remote(num_cpus=0, max_concurrency=2)
class _Shard:
    def __init__(self, status: Any) -> None:
        self.status_answer, self.delay_s = status, 0.0

    def slow_down(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def status(self, since_event: int) -> Any:
        time.sleep(self.delay_s)
        return self.status_answer


Shard: Any = _Shard


def _watch_for(watch: SyncWatch, seconds: float) -> list[Any]:
    events: list[Any] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        events += watch.poll()[0]
        time.sleep(0.05)
    return events


@pytest.mark.timeout(90)
def test_a_slow_steady_shard_is_not_lost_and_a_silent_one_is(ray_local: Any) -> None:
    cfg = SupervisorConfig(heartbeat_timeout_s=2.0, heartbeat_timeout_factor=4.0)
    shard = Shard.remote(sync_status())
    watch = SyncWatch(shard, 0.0, heartbeat_cadence(cfg), time.monotonic, startup_timeout_s=30)
    try:
        ray.get(shard.slow_down.remote(1.0))  # answers a second apart, as on a loaded machine
        # Under the 2 s floor, long enough to learn the gaps (the cadence's minimum number).
        assert _watch_for(watch, 14.0) == []
        # Answers 2.4 s apart, past the floor (a fixed 2 s timeout loses the shard) but
        # within 4x the gaps learned.
        ray.get(shard.slow_down.remote(2.4))
        assert _watch_for(watch, 8.0) == []
        ray.get(shard.slow_down.remote(60.0))  # it hangs
        lost = [e for e in _watch_for(watch, 16.0) if isinstance(e, SynchronizerLost)]
        # Found once silent for 4x the longest gaps learned (2.4 s and a poll), well before
        # the 30 s ceiling.
        assert len(lost) == 1 and lost[0].detection_s <= 4 * 2.6, lost
    finally:
        ray.kill(shard)
