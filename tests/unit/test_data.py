"""Byte corpus split by file (tasks/byte_corpus.py), parts and resumable batches
(tasks/windows.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from ray_diloco.tasks import byte_corpus as data
from ray_diloco.tasks import windows
from ray_diloco.tasks.byte_corpus import DataConfig

SYNTH = DataConfig(source="synthetic", eval_batches=3, eval_batch_size=4)


def _make_files(root: Path, n: int = 40) -> dict[str, bytes]:
    """n small files under root/sub*/; each body names its file so we can find it in a stream."""
    bodies = {}
    for i in range(n):
        rel = f"sub{i % 3}/doc{i:03d}.txt"
        body = f"<<{rel}>> ".encode() * 20
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(body)
        bodies[rel] = body
    return bodies


def test_synthetic_is_deterministic_and_seeded() -> None:
    a = data.load_corpus(SYNTH)
    data.load_corpus.cache_clear()
    b = data.load_corpus(SYNTH)
    c = data.load_corpus(SYNTH.model_copy(update={"seed": 1}))
    assert a is not b and np.array_equal(a.train, b.train) and np.array_equal(a.heldout, b.heldout)
    assert not np.array_equal(a.train[:1000], c.train[:1000])
    assert a.train.dtype == np.uint8 and a.heldout.size > 0
    assert 150_000 < a.train.size + a.heldout.size <= 200_000
    assert not a.train.flags.writeable  # the cached arrays are shared


def test_default_corpus_is_stdlib_without_site_packages() -> None:
    files = data._stdlib_files()
    rels = [rel for rel, _ in files]
    assert rels == sorted(rels)
    assert "os.py" in rels and "json/__init__.py" in rels
    assert not any("site-packages" in r or "dist-packages" in r for r in rels)
    corpus = data.load_corpus(DataConfig(max_corpus_bytes=20_000))
    assert corpus.train.size + corpus.heldout.size <= 20_000
    assert corpus.heldout.size > 0 and "python" in corpus.description.lower()
    first = Path(files[0][1]).read_bytes()[:100]
    assert bytes(np.concatenate([corpus.train, corpus.heldout])).find(first) >= 0


def test_split_is_by_file_disjoint_and_mount_independent(tmp_path: Path) -> None:
    bodies = _make_files(tmp_path / "a")
    cfg = DataConfig(paths=(str(tmp_path / "a" / "**" / "*.txt"),), heldout_fraction=0.3)
    corpus = data.load_corpus(cfg)
    train, held = bytes(corpus.train), bytes(corpus.heldout)
    in_held = {rel for rel in bodies if data.is_heldout(rel, 0.3)}
    assert 0 < len(in_held) < len(bodies)
    for rel, body in bodies.items():
        # Every file lies whole in exactly one stream, and the rule alone decides which.
        assert (body in held) == (rel in in_held)
        assert (body in train) == (rel not in in_held)
    assert train.count(bytes([data.SEPARATOR])) == len(bodies) - len(in_held)
    # The same files mounted elsewhere split the same way (relpaths from the pattern's base).
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    moved = data.load_corpus(cfg.model_copy(update={"paths": (str(tmp_path / "b/**/*.txt"),)}))
    assert np.array_equal(moved.heldout, corpus.heldout)


def test_heldout_never_empty(tmp_path: Path) -> None:
    (tmp_path / "x.txt").write_bytes(b"x" * 100)
    (tmp_path / "y.txt").write_bytes(b"y" * 100)
    assert not data.is_heldout("x.txt", 0.0001) and not data.is_heldout("y.txt", 0.0001)
    cfg = DataConfig(
        paths=(str(tmp_path / "x.txt"), str(tmp_path / "y.txt")), heldout_fraction=1e-4
    )
    corpus = data.load_corpus(cfg)
    assert bytes(corpus.heldout) == b"y" * 100 + b"\0"
    assert bytes(corpus.train) == b"x" * 100 + b"\0"


def test_max_corpus_bytes_truncates(tmp_path: Path) -> None:
    _make_files(tmp_path)
    corpus = data.load_corpus(DataConfig(paths=(f"{tmp_path}/**/*.txt",), max_corpus_bytes=10_000))
    assert corpus.train.size + corpus.heldout.size == 10_000


def test_bad_paths_name_the_path_and_the_fix(tmp_path: Path) -> None:
    missing = str(tmp_path / "nothing" / "*.txt")
    with pytest.raises(ValueError, match=r"data\.paths: .*matches no file") as err:
        data.load_corpus(DataConfig(paths=(missing,)))
    assert missing in str(err.value)
    os.symlink(tmp_path / "gone.txt", tmp_path / "dangling.txt")
    (tmp_path / "ok.txt").write_bytes(b"fine")
    with pytest.raises(ValueError, match=r"cannot read .*dangling\.txt.*remove it"):
        data.load_corpus(DataConfig(paths=(str(tmp_path / "*.txt"),)))
    with pytest.raises(ValueError, match=r"is a directory.*\*\*"):
        data.load_corpus(DataConfig(paths=(str(tmp_path),)))


def test_shards_are_disjoint_and_one_epoch_visits_every_window_once() -> None:
    num_tokens, seq_len, shards = 1001, 8, 4  # 125 windows
    starts = [windows.window_starts(num_tokens, (i, shards), 0, 31, seq_len) for i in range(shards)]
    every = np.concatenate(
        [*starts, windows.window_starts(num_tokens, (0, shards), 31, 1, seq_len)]
    )
    assert sorted(every.tolist()) == list(range(0, 1000, 8))  # a permutation of all windows
    # neighbouring windows of a shard are scattered, not consecutive text
    assert np.abs(np.diff(starts[0])).min() > seq_len
    # the next epoch replays the same order
    again = windows.window_starts(num_tokens, (2, shards), 125, 3, seq_len)
    np.testing.assert_array_equal(
        again, windows.window_starts(num_tokens, (2, shards), 0, 3, seq_len)
    )
    with pytest.raises(ValueError, match="shard index"):
        windows.window_starts(num_tokens, (4, 4), 0, 1, seq_len)
    with pytest.raises(ValueError, match="bigger corpus"):
        windows.window_starts(20, (0, 4), 0, 1, seq_len)


def test_batch_at_returns_shifted_windows_and_advances_the_cursor() -> None:
    train = (np.arange(1001) % 251).astype(np.uint8)
    x, y, nxt = windows.batch_at(train, (1, 2), 0, batch_size=3, seq_len=8)
    assert x.shape == y.shape == (3, 8) and x.dtype == np.int32 and nxt == 24
    starts = windows.window_starts(train.size, (1, 2), 0, 3, 8)
    np.testing.assert_array_equal(x[1], train[starts[1] : starts[1] + 8])
    np.testing.assert_array_equal(y[:, :-1], x[:, 1:])
    x2, _, nxt2 = windows.batch_at(train, (1, 2), 8, batch_size=2, seq_len=8)
    np.testing.assert_array_equal(x2, x[1:])  # a cursor inside the stream starts mid-batch
    assert nxt2 == 24


def test_resume_from_cursor_reproduces_the_stream() -> None:
    corpus = data.load_corpus(SYNTH)
    shard = (1, 3)

    def run(cursor: int, steps: int) -> tuple[list[np.ndarray], int]:
        out = []
        for _ in range(steps):
            x, y, cursor = windows.batch_at(corpus.train, shard, cursor, 8, 16)
            out.append(np.stack([x, y]))
        return out, cursor

    straight, end = run(0, 10)
    first, saved = run(0, 4)
    data.load_corpus.cache_clear()  # as after a restart: the corpus is rebuilt from scratch
    corpus = data.load_corpus(SYNTH)
    rest, end2 = run(saved, 6)
    assert end == end2 == 10 * 8 * 16
    for a, b in zip(straight, first + rest, strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(straight[0], straight[1])


def test_heldout_batches_fixed_and_in_bounds() -> None:
    corpus = data.load_corpus(SYNTH)
    batches = windows.heldout_batches(corpus.heldout, SYNTH.eval_batches, SYNTH.eval_batch_size, 16)
    assert len(batches) == SYNTH.eval_batches
    assert all(x.shape == y.shape == (SYNTH.eval_batch_size, 16) for x, y in batches)
    again = windows.heldout_batches(corpus.heldout, SYNTH.eval_batches, SYNTH.eval_batch_size, 16)
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(batches, again, strict=True))
    # Window k starts at k * (M - T) // count: evenly spread, the last one ending inside.
    count, m = SYNTH.eval_batches * SYNTH.eval_batch_size, corpus.heldout.size
    x, y = batches[-1]
    last = (count - 1) * (m - 16) // count
    assert m // 2 < last and last + 17 <= m
    np.testing.assert_array_equal(x[-1], corpus.heldout[last : last + 16])
    np.testing.assert_array_equal(y[-1], corpus.heldout[last + 1 : last + 17])
    np.testing.assert_array_equal(batches[0][0][0], corpus.heldout[:16])
