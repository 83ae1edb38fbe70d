"""Layer: control (pure Python; no Ray, no JAX). The event tape: the run's durable record.

One JSON object per line (`Event.to_dict()`), append-only. `EventTape.append` returns only
after the line is flushed and fsync'ed, so an event that was appended survives a crash of the
writer or its node; an event is on the tape exactly when its line ends with a newline. A crash
in the middle of a write leaves a torn last line: loaders skip it with a warning, and a tape
reopened for appending cuts it off first so the next event does not get glued onto the
fragment. A bad line anywhere else cannot come from a crash and raises `TapeError`. Reopening
an existing tape resumes it (`.events` holds what is already there). One writer per tape;
appends from several threads of that writer are serialized by a lock.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from types import TracebackType

from ray_diloco.control.events import Event, event_from_dict

log = logging.getLogger(__name__)


class TapeError(ValueError):
    """A tape line other than the last one is not a valid event."""


def _load(path: Path) -> tuple[list[Event], int]:
    """Events on the tape and the byte length of the good prefix (everything but a torn tail)."""
    data = path.read_bytes()
    lines = data.split(b"\n")
    # split() leaves the bytes after the last newline as the final element: b"" for a clean
    # tape, the torn fragment otherwise.
    tail = lines.pop()
    events: list[Event] = []
    offset = 0  # bytes of the good prefix so far
    last_nonempty = max((i for i, ln in enumerate(lines) if ln.strip()), default=-1)
    for i, raw in enumerate(lines):
        if raw.strip():
            try:
                obj = json.loads(raw)
                if not isinstance(obj, dict):
                    raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
                events.append(event_from_dict(obj))
            except (ValueError, UnicodeDecodeError) as err:
                if i == last_nonempty and not tail.strip():
                    # A complete but garbled last line (e.g. zeros after a power loss on a
                    # file system that persisted the size before the data): treat as torn.
                    log.warning("%s: ignoring garbled last line %d (%s)", path, i + 1, err)
                    return events, offset
                raise TapeError(f"{path}:{i + 1}: not a valid event: {err}") from None
        offset += len(raw) + 1
    if tail.strip():
        log.warning(
            "%s: ignoring a torn last line of %d bytes (the writer crashed mid-append)",
            path,
            len(tail),
        )
    return events, offset


def read_tape(path: str | Path) -> list[Event]:
    """All complete events of a tape, in order; a torn last line is skipped with a warning."""
    return _load(Path(path))[0]


class EventTape:
    """Append-only, crash-safe JSONL record of events; reopening resumes it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        created = not self.path.exists()
        events, good = ([], 0) if created else _load(self.path)
        self._events: list[Event] = events
        self._file = open(self.path, "ab")  # noqa: SIM115 - held open for the tape's life
        if not created and self._file.tell() > good:
            self._file.truncate(good)
            self._file.flush()
            os.fsync(self._file.fileno())
        if created:
            _fsync_dir(self.path.parent)
        else:
            log.info("resuming event tape %s with %d events", self.path, len(events))

    @property
    def events(self) -> list[Event]:
        """Every event on the tape: those loaded at open plus those appended since (a copy)."""
        with self._lock:
            return list(self._events)

    def append(self, event: Event) -> None:
        """Write one line and make it durable before returning."""
        line = json.dumps(event.to_dict(), separators=(",", ":")).encode("utf-8") + b"\n"
        with self._lock:
            if self._file.closed:
                raise ValueError(f"event tape {self.path} is closed")
            # One write() per line: with O_APPEND the line lands at the end in one piece.
            self._file.write(line)
            self._file.flush()
            os.fsync(self._file.fileno())
            self._events.append(event)

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()

    def __enter__(self) -> EventTape:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _fsync_dir(directory: Path) -> None:
    # A new file's directory entry is durable only once the directory itself is synced.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
