"""Layer: tasks (pure, no Ray). The byte-level corpus of the built-in `byte_lm` task.

Default corpus: the Python standard library source of the running interpreter, which exists on
every machine that can run this code, so a laptop run needs no download. The held-out split is by
FILE: a file goes to held-out when `zlib.crc32(relpath) % 10_000 < heldout_fraction * 10_000`,
a rule that depends only on the file's relative path, so every process (and every machine with
the same files) agrees on the split without coordination, and no held-out file ever leaks into
training through a neighbouring window. `tasks/windows.py` cuts the streams into batches.
"""

from __future__ import annotations

import functools
import glob
import logging
import os
import posixpath
import sysconfig
import zlib
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ray_diloco.tasks import storage

log = logging.getLogger(__name__)

# Joins documents. NUL never occurs in Python source or ordinary text, so the model can learn it
# as an unambiguous "document boundary" byte.
SEPARATOR = 0
_SPLIT_BUCKETS = 10_000
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_SYNTHETIC_BYTES = 200_000


class DataConfig(BaseModel):
    """The byte corpus (`task_args.data` of `byte_lm`). `paths` empty means: the Python
    stdlib source of the running interpreter."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: Literal["files", "synthetic"] = "files"
    paths: tuple[str, ...] = ()
    seed: int = Field(0, description="shapes the synthetic source only; never the file split")
    heldout_fraction: float = Field(0.02, gt=0.0, lt=0.5)
    max_corpus_bytes: int = Field(24_000_000, ge=10_000)
    eval_batches: int = Field(8, ge=1)
    eval_batch_size: int = Field(32, ge=1)


@dataclass(frozen=True)
class Corpus:
    """Train and held-out byte streams (read-only uint8 arrays) and a one-line description."""

    train: np.ndarray
    heldout: np.ndarray
    description: str


def is_heldout(relpath: str, heldout_fraction: float) -> bool:
    """The split rule: a stable hash of the relative path, never the file's position."""
    bucket = zlib.crc32(relpath.encode("utf-8")) % _SPLIT_BUCKETS
    return bucket < heldout_fraction * _SPLIT_BUCKETS


def _stdlib_files() -> list[tuple[str, str]]:
    """(relpath, abspath) of every *.py in the stdlib, sorted by relpath, without third-party
    packages (they differ between machines; the stdlib of one Python version does not)."""
    root = sysconfig.get_paths()["stdlib"]
    found: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                full = os.path.join(dirpath, name)
                found.append((os.path.relpath(full, root).replace(os.sep, "/"), full))
    return sorted(found)


def _pattern_base(pattern: str) -> str:
    """The leading directories of a pattern that contain no glob magic; relpaths are taken from
    there so the split does not depend on where the corpus is mounted or on the cwd."""
    parts = pattern.replace(os.sep, "/").split("/")
    fixed: list[str] = []
    for part in parts[:-1]:
        if glob.has_magic(part):
            break
        fixed.append(part)
    return "/".join(fixed) or "."


def expand_paths(paths: tuple[str, ...], field: str = "data.paths") -> list[tuple[str, str]]:
    """(relpath, location) of every file the glob patterns match, in order, without
    duplicates; relpaths are taken from each pattern's fixed leading directories. A pattern is
    a local path or an fsspec URL (`gs://bucket/texts/**/*.txt`); its files are named by URL.
    Errors name `field` (the config field or command-line option the patterns came from)."""
    files: list[tuple[str, str]] = []
    seen: set[str] = set()
    for pattern in paths:
        found = _expand_url(pattern, field) if storage.is_url(pattern) else _expand(pattern, field)
        for rel, full in found:
            if full not in seen:
                seen.add(full)
                files.append((rel, full))
    return files


def _expand(pattern: str, field: str) -> list[tuple[str, str]]:
    pattern = os.path.expanduser(pattern)
    if os.path.isdir(pattern):
        raise ValueError(
            f"{field}: {pattern!r} is a directory; give files or a glob pattern such as "
            f"'{pattern.rstrip('/')}/**/*.txt'"
        )
    matches = sorted(m for m in glob.glob(pattern, recursive=True) if not os.path.isdir(m))
    if not matches:
        raise ValueError(
            f"{field}: {pattern!r} matches no file (cwd {os.getcwd()}); fix the path or "
            "glob pattern (use '**' for recursion)"
        )
    base = _pattern_base(pattern)
    return [(os.path.relpath(m, base).replace(os.sep, "/"), os.path.abspath(m)) for m in matches]


def _expand_url(url: str, field: str) -> list[tuple[str, str]]:
    fs, pattern = storage.filesystem(url, field)
    try:
        if not glob.has_magic(pattern) and fs.isdir(pattern):
            raise ValueError(
                f"{field}: {url!r} is a directory; give files or a glob pattern such as "
                f"'{url.rstrip('/')}/**/*.txt'"
            )
        found = fs.glob(pattern, detail=True)
    except OSError as err:
        raise ValueError(f"{field}: cannot list {url!r} ({err})") from None
    matches = sorted(path for path, info in found.items() if info.get("type") != "directory")
    if not matches:
        raise ValueError(f"{field}: {url!r} matches no file; fix the URL or glob pattern")
    base = _pattern_base(pattern)
    return [(posixpath.relpath(m, base), fs.unstrip_protocol(m)) for m in matches]


def read_documents(
    files: list[tuple[str, str]], max_bytes: int, field: str = "data.paths"
) -> list[tuple[str, bytes]]:
    """Read files (paths or URLs) in order until `max_bytes` (separators included) are
    collected."""
    docs: list[tuple[str, bytes]] = []
    total = 0
    for rel, full in files:
        room = max_bytes - total - 1  # leave room for this document's separator
        if room <= 0:
            break
        fs, path = storage.filesystem(full, field)
        try:
            with fs.open(path, "rb") as fh:
                data = fh.read(min(room, fs.size(path)))
        except OSError as err:
            raise ValueError(
                f"{field}: cannot read {full!r} ({err.strerror or err}); fix its permissions "
                f"or remove it from {field}"
            ) from err
        docs.append((rel, data))
        total += len(data) + 1
    return docs


def _synthetic_documents(seed: int, max_bytes: int) -> list[tuple[str, bytes]]:
    """A seeded word-level Markov text: 48 made-up words, each followed by one of 3 successors.
    Local structure (spelling) is learnt in a few dozen steps, longer structure more slowly, so
    loss curves are informative in unit tests."""
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
    words = [bytes(rng.choice(letters, size=rng.integers(2, 7))) for _ in range(48)]
    successors = rng.integers(0, len(words), size=(len(words), 3))
    docs: list[tuple[str, bytes]] = []
    total, w = 0, 0
    limit = min(_SYNTHETIC_BYTES, max_bytes)
    while total < limit - 1:
        out: list[bytes] = []
        for _ in range(int(rng.integers(100, 300))):
            out.append(words[w])
            w = int(successors[w, rng.integers(0, 3)])
            out.append(b".\n" if rng.random() < 0.1 else b" ")
        text = b"".join(out)[: limit - total - 1]
        docs.append((f"synthetic/{len(docs):05d}", text))
        total += len(text) + 1
    return docs


def _join(docs: list[tuple[str, bytes]]) -> np.ndarray:
    if not docs:
        return np.zeros(0, dtype=np.uint8)
    sep = bytes([SEPARATOR])
    arr = np.frombuffer(sep.join(d for _, d in docs) + sep, dtype=np.uint8).copy()
    arr.setflags(write=False)  # cached and shared: nobody may modify it in place
    return arr


@functools.lru_cache(maxsize=4)
def load_corpus(cfg: DataConfig) -> Corpus:
    """Load the corpus described by `cfg` (read once per process, then cached).

    `cfg.seed` only shapes the synthetic source; the file split never depends on it, so every
    run evaluates on the same held-out files."""
    if cfg.source == "synthetic":
        docs = _synthetic_documents(cfg.seed, cfg.max_corpus_bytes)
        what = f"synthetic Markov text (seed {cfg.seed})"
    else:
        files = expand_paths(cfg.paths) if cfg.paths else _stdlib_files()
        where = ", ".join(cfg.paths) if cfg.paths else sysconfig.get_paths()["stdlib"]
        docs = read_documents(files, cfg.max_corpus_bytes)
        what = f"files from {where}"
    if len(docs) < 2:
        raise ValueError(
            f"data: {what} gives {len(docs)} document(s); the train/held-out split is by file "
            "and needs at least 2; add files to data.paths or raise data.max_corpus_bytes"
        )
    train = [d for d in docs if not is_heldout(d[0], cfg.heldout_fraction)]
    heldout = [d for d in docs if is_heldout(d[0], cfg.heldout_fraction)]
    if not heldout:  # too few files for the hash to pick one: take the last, deterministically
        heldout, train = [train[-1]], train[:-1]
    if not train:
        train, heldout = [heldout[0]], heldout[1:]
    train_bytes, heldout_bytes = _join(train), _join(heldout)
    description = (
        f"{what}: {len(train)} train docs ({train_bytes.size:,} bytes), "
        f"{len(heldout)} held-out docs ({heldout_bytes.size:,} bytes)"
    )
    log.info("corpus: %s", description)
    return Corpus(train_bytes, heldout_bytes, description)
