"""Event tape: durable appends, resume, torn last lines, concurrent writers."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ray_diloco.control import tape as tape_mod
from ray_diloco.control.events import (
    LearnerState,
    LearnerStateChanged,
    RoundClosed,
    RunStarted,
    WorkLost,
)
from ray_diloco.control.tape import EventTape, TapeError, read_tape

ROOT = Path(__file__).resolve().parents[2]


def sample(i: int) -> RoundClosed:
    return RoundClosed(float(i), fragment=i % 3, version=i, num_contributors=2, tokens=100 * i)


def test_append_then_read(tmp_path):
    path = tmp_path / "sub" / "tape.jsonl"
    evs = [RunStarted(0.0, "d"), LearnerStateChanged(1.0, "a", 0, LearnerState.TRAINING)]
    with EventTape(path) as tape:
        for e in evs:
            tape.append(e)
        assert tape.events == evs
    assert read_tape(path) == evs
    assert len(path.read_text().splitlines()) == 2


def test_each_append_is_fsynced(tmp_path, monkeypatch):
    calls: list[int] = []
    real = tape_mod.os.fsync

    def counting_fsync(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(tape_mod.os, "fsync", counting_fsync)
    with EventTape(tmp_path / "t.jsonl") as tape:
        before = len(calls)
        tape.append(sample(1))
        tape.append(sample(2))
        assert len(calls) - before == 2


def test_reopen_resumes(tmp_path):
    path = tmp_path / "t.jsonl"
    with EventTape(path) as tape:
        tape.append(sample(1))
    with EventTape(path) as tape:
        assert tape.events == [sample(1)]
        tape.append(sample(2))
        assert tape.events == [sample(1), sample(2)]
    assert read_tape(path) == [sample(1), sample(2)]


@pytest.mark.parametrize(
    "torn",
    [b'{"kind":"round_closed","t":3.0,"frag', b'{"kind":"work_lost"}', b"\x00\x00\x00\x00"],
    ids=["half-json", "no-newline", "zeros"],
)
def test_torn_last_line_is_ignored_and_cut_on_resume(tmp_path, caplog, torn):
    path = tmp_path / "t.jsonl"
    with EventTape(path) as tape:
        tape.append(sample(1))
        tape.append(sample(2))
    with path.open("ab") as f:
        f.write(torn)
    with caplog.at_level(logging.WARNING, logger="ray_diloco.control.tape"):
        assert read_tape(path) == [sample(1), sample(2)]
    assert "torn" in caplog.text
    with EventTape(path) as tape:
        assert tape.events == [sample(1), sample(2)]
        tape.append(sample(3))
    # The fragment was cut off, so the new line is not glued onto it.
    assert read_tape(path) == [sample(1), sample(2), sample(3)]
    assert len(path.read_bytes().splitlines()) == 3


def test_garbled_complete_last_line_is_ignored(tmp_path, caplog):
    path = tmp_path / "t.jsonl"
    with EventTape(path) as tape:
        tape.append(sample(1))
    with path.open("ab") as f:
        f.write(b"\x00\x00\x00\n")
    with caplog.at_level(logging.WARNING):
        assert read_tape(path) == [sample(1)]
    assert "garbled" in caplog.text


def test_bad_line_in_the_middle_raises(tmp_path):
    path = tmp_path / "t.jsonl"
    good = b'{"kind":"run_started","t":0,"config_digest":"d"}\n'
    path.write_bytes(good + b"not json\n" + good)
    # A crash cannot leave a bad line before a good one: refuse rather than guess.
    with pytest.raises(TapeError, match=":2:"):
        read_tape(path)
    with pytest.raises(TapeError):
        EventTape(path)


def test_empty_tape_and_blank_lines(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"")
    assert read_tape(path) == []
    path.write_bytes(b'\n{"kind":"run_started","t":0,"config_digest":"d"}\n\n')
    assert read_tape(path) == [RunStarted(0.0, "d")]


def test_concurrent_appends_do_not_interleave(tmp_path):
    path = tmp_path / "t.jsonl"
    tape = EventTape(path)

    def writer(w: int) -> None:
        for i in range(100):
            tape.append(WorkLost(float(i), f"learner-{w}", steps=i, seconds=0.1 * i))

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    tape.close()
    back = read_tape(path)
    assert len(back) == 800
    assert sorted(back, key=lambda e: (e.learner, e.t)) == sorted(  # type: ignore[attr-defined]
        tape.events,
        key=lambda e: (e.learner, e.t),  # type: ignore[attr-defined]
    )
    for w in range(8):
        mine = [e.t for e in back if e.learner == f"learner-{w}"]  # type: ignore[attr-defined]
        assert mine == [float(i) for i in range(100)]  # per-writer order preserved


def test_append_after_close_raises(tmp_path):
    tape = EventTape(tmp_path / "t.jsonl")
    tape.close()
    with pytest.raises(ValueError, match="closed"):
        tape.append(sample(1))


_CHILD = """
import os, sys
from ray_diloco.control.events import RoundClosed
from ray_diloco.control.tape import EventTape
tape = EventTape(sys.argv[1])
for i in range(5):
    tape.append(RoundClosed(float(i), 0, i, 1, 10))
os._exit(0)  # no close, no interpreter shutdown: only what append() made durable survives
"""


def test_appended_events_survive_abrupt_exit(tmp_path):
    path = tmp_path / "t.jsonl"
    res = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert [e.t for e in read_tape(path)] == [0.0, 1.0, 2.0, 3.0, 4.0]
