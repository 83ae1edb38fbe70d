"""Layer: observe. What a watcher of a Ray run sees, as data (no Ray, no JAX).

`ProgressTracker.point` turns one poll of the synchronizer's and the supervisor's status into a
progress point: a JSON-ready dict that the driver appends to `run_dir/metrics.jsonl` and hands to
its progress callback (the CLI's live display, `observe/display.py`), and that the run report plots
(`observe/run_report.py`). Rates are measured between polls: tokens/s over the last `RATE_WINDOW_S`
(not since the start, which boot and compile time would drag down for minutes; of the boot, with no
token yet, only its last poll counts), steps/s per learner since the previous poll. Per learner it
also remembers since when the learner is in its state and when the synchronizer last merged one of
its contributions. A learner that joins the running job is shown from the first poll whose
supervisor status names it.

Point keys: `t` (run clock, s), `tokens`, `budget`, `tokens_per_s`, `eta_s`, `heldout_loss`,
`rounds`, `contributors` (mean per round), `live`, `goodput`, `uptime`, `restarts` and
`recovery` (median seconds per fault kind), `bytes_up`/`bytes_down` (per learner link),
`learners` (per learner: region, state, since, incarnation, restarts, degraded, steps_per_s,
merged (contributions), merged_share (of its trained tokens, docs/rounds.md), last_merge_t,
`slow` (see SLOW_MARGIN), and its training curve: `step` (inner steps), `tokens` (its data
cursor), `loss` (the training loss of its last reported step) and `lr` (the inner learning
rate at that step)) and `dashboard_url` (the Ray dashboard, when there is one).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ray_diloco.control.protocol import SupervisorStatus, SynchronizerStatus

RATE_WINDOW_S = 10.0
# A learner is shown slow when its steps per second over the last SLOW_FOR_S of training,
# divided by its configured `speed`, are below (1 - SLOW_MARGIN) of the median of the training
# learners' (each divided by its own speed): a learner emulated 18% slower is as configured,
# not slow, and one slow poll on a busy machine flags nothing.
SLOW_MARGIN = 0.3
SLOW_FOR_S = 20.0
BOOT_STATES = frozenset({"starting", "compiling"})


@dataclass
class _Learner:
    state: str = ""
    since: float = 0.0
    step: int | None = None
    step_t: float = 0.0
    merged: int | None = None
    merged_t: float | None = None
    steps: collections.deque[tuple[float, int]] = field(default_factory=collections.deque)


class ProgressTracker:
    def __init__(
        self,
        budget: int,
        regions: Mapping[str, str],
        dashboard_url: str | None = None,
        lr_at: Callable[[int], float] | None = None,
        speeds: Mapping[str, float] | None = None,
    ) -> None:
        """`lr_at(step)`: the inner learning rate at a learner's step, where the run's
        schedule is known (None: the task brings its own optimizer); `speeds`: each learner's
        configured speed (default 1), the pace it is judged slow against."""
        self.budget, self.regions, self.dashboard_url = budget, dict(regions), dashboard_url
        self.lr_at = lr_at
        self.speeds = dict(speeds or {})
        self._tokens: collections.deque[tuple[float, int]] = collections.deque()
        self._learners = {name: _Learner() for name in regions}

    def point(self, t: float, st: SynchronizerStatus, sup: SupervisorStatus) -> dict[str, Any]:
        """The progress point at run time `t` from the synchronizer's status `st` and the
        supervisor's `sup`."""
        tokens = int(st.tokens)
        rate = self._token_rate(t, tokens)
        remaining = max(0, self.budget - tokens)
        shares = st.merged_shares()
        return {
            "t": t,
            "tokens": tokens,
            "budget": self.budget,
            "tokens_per_s": rate,
            "eta_s": remaining / rate if rate > 0 else None,
            "heldout_loss": st.heldout_loss,
            "rounds": st.rounds,
            "contributors": st.mean_contributors,
            "live": len(st.live),
            "goodput": sup.goodput,
            "uptime": sup.uptime,
            "restarts": {n: row.restarts for n, row in sup.learners.items()},
            "recovery": {kind: r["recovery_s_median"] for kind, r in sup.recovery.items()},
            "bytes_up": dict(st.bytes_up),
            "bytes_down": dict(st.bytes_down),
            "learners": self._slow(
                t, {name: self._learner(name, t, st, sup, shares) for name in self._follow(sup)}
            ),
            "dashboard_url": self.dashboard_url,
        }

    def _slow(self, t: float, learners: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Mark `slow` each learner whose pace for its configured speed over the last
        SLOW_FOR_S is SLOW_MARGIN below the median (see the constants)."""
        paces: dict[str, float] = {}
        for name, row in learners.items():
            seen = self._learners[name]
            if row["state"] != "training":
                seen.steps.clear()  # a pace is judged over training time only
                continue
            seen.steps.append((t, row["step"]))
            while len(seen.steps) > 2 and t - seen.steps[1][0] >= SLOW_FOR_S:
                seen.steps.popleft()
            t0, step0 = seen.steps[0]
            if t - t0 >= SLOW_FOR_S:
                paces[name] = (row["step"] - step0) / (t - t0) / self.speeds.get(name, 1.0)
        ranked = sorted(paces.values())
        median = ranked[len(ranked) // 2] if len(ranked) >= 2 else None
        for name, row in learners.items():
            pace = paces.get(name)
            row["slow"] = (
                median is not None and pace is not None and pace < (1 - SLOW_MARGIN) * median
            )
        return learners

    def _follow(self, sup: SupervisorStatus) -> list[str]:
        """The learners to show: the config's, and every learner that joined the running job
        since (the supervisor's status names it, with its region), in the order they came."""
        for name, row in sup.learners.items():
            if name not in self._learners:
                self._learners[name] = _Learner()
                self.regions[name] = row.region
        return list(self._learners)

    def _token_rate(self, t: float, tokens: int) -> float:
        self._tokens.append((t, tokens))
        # Samples of the last RATE_WINDOW_S, at least two, and of the boot only the last one:
        # seconds of compiling at 0 tokens in the window made the first ETA ten times too long.
        while len(self._tokens) > 2 and (
            t - self._tokens[0][0] > RATE_WINDOW_S or self._tokens[1][1] == 0
        ):
            self._tokens.popleft()
        t_old, tokens_old = self._tokens[0]
        return (tokens - tokens_old) / (t - t_old) if t > t_old else 0.0

    def _learner(
        self,
        name: str,
        t: float,
        st: SynchronizerStatus,
        sup: SupervisorStatus,
        shares: Mapping[str, float],
    ) -> dict[str, Any]:
        seen = self._learners[name]
        watched = sup.learners.get(name)
        state = watched.state.value if watched is not None else "starting"
        if state != seen.state:
            seen.state, seen.since = state, t
        # The synchronizer's step of the learner survives restarts (a new incarnation resumes
        # at its ledger cursor), so the rate never jumps back.
        progress = st.learners.get(name)
        step = progress.step if progress is not None else 0
        rate = None
        if seen.step is not None and t > seen.step_t:
            rate = max(0.0, (step - seen.step) / (t - seen.step_t))
        seen.step, seen.step_t = step, t
        merged = st.contributions_merged.get(name, 0)
        if seen.merged is not None and merged > seen.merged:
            seen.merged_t = t
        seen.merged = merged
        return {
            "region": self.regions[name],
            "state": state,
            "since": seen.since,
            "incarnation": watched.incarnation if watched is not None else 0,
            "restarts": watched.restarts if watched is not None else 0,
            "degraded": sorted(watched.degraded) if watched is not None else [],
            "steps_per_s": rate,
            "merged": merged,
            "merged_share": shares.get(name),
            "last_merge_t": seen.merged_t,
            "step": step,
            "tokens": progress.cursor if progress is not None else 0,
            "loss": progress.loss if progress is not None else None,
            "lr": self.lr_at(step) if self.lr_at is not None and progress is not None else None,
        }


def booting(point: Mapping[str, Any]) -> bool:
    """No token trained yet and every learner still starting or compiling: the run boots."""
    learners = point.get("learners") or {}
    states = {ls["state"] for ls in learners.values()}
    return point.get("tokens", 0) == 0 and bool(states) and states <= BOOT_STATES
