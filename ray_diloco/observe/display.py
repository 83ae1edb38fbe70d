"""Layer: observe. The CLI's progress display of a Ray run (no Ray, no JAX).

On a terminal, a live `rich` view redrawn at every progress point (`observe/progress.py`): a bar
over the token budget with the percentage, ETA, tokens/s, held-out loss, rounds and goodput, and a
row per learner (region, state and since when, steps/s, contributions merged, the last one,
restarts); "(slow)" marks a learner slower than its configured speed by `SLOW_MARGIN` for
`SLOW_FOR_S` (`observe/progress.py`). While the learners boot it says so instead of showing
rows of zeros. Anywhere else (CI, `ray job logs`, a pipe) it prints one plain line every
`every_s` seconds, and at once when a learner goes down or the run leaves its boot. The
library itself prints nothing: the CLI (or `Trainer.fit(progress=True)`) opens a display and
passes it to the driver as its callback.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import IO, Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from ray_diloco.config import RunConfig
from ray_diloco.observe.progress import booting
from ray_diloco.observe.report import duration, human, learner_states, progress_line, state_word

Point = Mapping[str, Any]
Display = Callable[[Point], None]

STATE_STYLES = {
    "starting": "dim",
    "compiling": "yellow",
    "training": "green",
    "blocked": "cyan",
    "dead": "bold red",
    "restarting": "magenta",
    "gave_up": "bold red",
    "finished": "dim",
    "left": "dim",
}
DOWN_STATES = frozenset({"dead", "restarting", "gave_up"})


def run_title(cfg: RunConfig) -> str:
    # "at start": learners may join and leave the running job (the table shows who is in it)
    return (
        f"ray_diloco · run {cfg.name} · {cfg.diloco.mode} · {cfg.num_learners} learners at "
        f"start · {human(cfg.token_budget)} tokens"
    )


def render(point: Point, title: str) -> Group:
    """The live view of one progress point."""
    t, budget = point.get("t", 0.0), point.get("budget", 0)
    header = Text(title, style="bold")
    if point.get("dashboard_url"):
        header.append(f"  ·  Ray dashboard {point['dashboard_url']}", style="dim")
    if booting(point):
        status = Text(f"starting learners (compiling)  run time {duration(t)}", style="yellow")
        return Group(header, status, _learner_table(point))
    tokens = point["tokens"]
    bar = Table.grid(padding=(0, 1))
    bar.add_row(
        ProgressBar(total=max(budget, 1), completed=min(tokens, budget), width=40),
        Text(f"{min(100, 100 * tokens / max(budget, 1)):3.0f}%", style="bold"),
        Text(f"{human(tokens)}/{human(budget)} tokens"),
        Text(f"{human(point.get('tokens_per_s') or 0)} tok/s"),
        Text("ETA " + (duration(point["eta_s"]) if point.get("eta_s") is not None else "–")),
        Text(f"run time {duration(t)}", style="dim"),
    )
    return Group(header, bar, Text(_figures(point)), _learner_table(point))


def _figures(point: Point) -> str:
    loss = point.get("heldout_loss")
    parts = [f"held-out loss {loss:.4f}" if loss is not None else "held-out loss –"]
    parts.append(f"rounds {point.get('rounds', 0)}")
    if point.get("contributors"):
        parts.append(f"{point['contributors']:.2f} contributors/round")
    for key in ("goodput", "uptime"):
        if point.get(key) is not None:
            parts.append(f"{key} {point[key]:.3f}")
    return "  ·  ".join(parts)


def _learner_table(point: Point) -> Table:
    table = Table(box=None, padding=(0, 2), header_style="bold dim")
    for column in ("learner", "region", "state", "since", "steps/s", "merged", "last merge"):
        table.add_column(column, justify="left" if column in ("learner", "region") else "right")
    table.add_column("restarts", justify="right")
    t = point.get("t", 0.0)
    for name, ls in sorted((point.get("learners") or {}).items()):
        state = ls["state"]
        word = state_word(state) + (" (slow)" if ls.get("slow") else "")
        rate = ls.get("steps_per_s")
        last = ls.get("last_merge_t")
        table.add_row(
            name,
            ls.get("region", ""),
            Text(word, style=STATE_STYLES.get(state, "")),
            duration(t - ls.get("since", t)),
            f"{rate:.1f}" if rate is not None and state in ("training", "blocked") else "–",
            _merged(ls),
            f"{t - last:.0f} s ago" if last is not None else "–",
            str(ls.get("restarts", 0)),
        )
    return table


def _merged(ls: Mapping[str, Any]) -> str:
    """Contributions merged and the share of the learner's trained tokens they carried."""
    if not ls.get("merged"):
        return "–"
    share = ls.get("merged_share")
    return f"{ls['merged']} · {share:.0%}" if share is not None else str(ls["merged"])


def plain_boot_line(point: Point) -> str:
    states = learner_states(point.get("learners") or {})
    return f"t={duration(point.get('t', 0.0))}  starting learners (compiling): {states}"


class PlainDisplay:
    """One line every `every_s` seconds of run time, and at once when a learner goes down,
    comes back, or the run leaves its boot; `close()` prints the last point if it was not."""

    def __init__(self, every_s: float, out: Callable[[str], None]) -> None:
        self.every_s, self.out = every_s, out
        self._printed_t: float | None = None
        self._last: Point | None = None
        self._key: tuple[Any, ...] | None = None

    def __call__(self, point: Point) -> None:
        self._last = point
        key = self._key_of(point)
        due = self._printed_t is None or point.get("t", 0.0) - self._printed_t >= self.every_s
        if due or key != self._key:
            self._print(point)
        self._key = key

    def _key_of(self, point: Point) -> tuple[Any, ...]:
        learners = point.get("learners") or {}
        down = sorted(n for n, ls in learners.items() if ls["state"] in DOWN_STATES)
        return booting(point), tuple(down)

    def _print(self, point: Point) -> None:
        self._printed_t = point.get("t", 0.0)
        line = plain_boot_line(point) if booting(point) else progress_line(point, point["budget"])
        self.out(line)

    def close(self) -> None:
        if self._last is not None and self._printed_t != self._last.get("t", 0.0):
            self._print(self._last)


class LiveDisplay:
    """The live view on `console`, redrawn at every point; log records and Ray's worker
    output go above it (rich redirects stdout and stderr while it runs)."""

    def __init__(self, title: str, console: Console) -> None:
        self.title, self.console = title, console
        self.live = Live(
            _Starting(title),
            console=console,
            refresh_per_second=1,  # the elapsed time while nothing else moves
            redirect_stdout=True,
            redirect_stderr=True,
        )
        self._restore: list[tuple[logging.StreamHandler[Any], IO[str]]] = []

    def __call__(self, point: Point) -> None:
        self.live.update(render(point, self.title), refresh=True)

    def start(self) -> None:
        original = (sys.stdout, sys.stderr)
        self.live.start()
        # Handlers made before the display (logging.basicConfig) hold the real stream: point
        # them at rich's redirect while it runs so a log record does not tear the view.
        for handler in _stream_handlers():
            if handler.stream in original:
                target = sys.stdout if handler.stream is original[0] else sys.stderr
                self._restore.append((handler, handler.stream))
                handler.setStream(target)

    def close(self) -> None:
        for handler, stream in self._restore:
            handler.setStream(stream)
        self.live.stop()


class _Starting:
    """What the live view shows before the first progress point: Ray, the task check and
    the synchronizer are starting."""

    def __init__(self, title: str) -> None:
        self.title, self.started = title, time.monotonic()

    def __rich__(self) -> Group:
        elapsed = duration(time.monotonic() - self.started)
        return Group(
            Text(self.title, style="bold"),
            Text(f"starting Ray, the task check, the synchronizer  {elapsed}", style="yellow"),
        )


def _stream_handlers() -> Iterator[logging.StreamHandler[Any]]:
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for lg in loggers:
        for handler in getattr(lg, "handlers", []):
            if isinstance(handler, logging.StreamHandler) and not isinstance(
                handler,
                logging.FileHandler,  # a file stays a file
            ):
                yield handler


@contextlib.contextmanager
def progress_display(
    title: str, every_s: float = 10.0, file: IO[str] | None = None
) -> Iterator[Display]:
    """The live view when `file` (default stdout) is a terminal, plain lines otherwise."""
    console = Console(file=file or sys.stdout)
    display: LiveDisplay | PlainDisplay
    if console.is_terminal and not console.is_dumb_terminal:
        display = LiveDisplay(title, console)
        display.start()
    else:
        display = PlainDisplay(every_s, lambda line: print(line, file=console.file, flush=True))
    try:
        yield display
    finally:
        display.close()
