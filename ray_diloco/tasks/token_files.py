"""Layer: tasks (pure, no Ray). Pre-tokenized token files: flat binary arrays of uint16 or
uint32 token ids, the format nanoGPT users already have (`train.bin`, `val.bin`), read as
memory maps so a corpus larger than memory costs nothing until a window is read.

A directory written by `ray-diloco prepare-data` (tasks/prepare.py) also holds `meta.json`
(dtype, vocabulary size, end-of-text id, the tokenizer that wrote it) and `tokenizer.json`; a
nanoGPT directory has no `meta.json`, so its dtype and vocabulary size are given instead.

The directory is a local path or an fsspec URL (gs://bucket/tokens, s3://..., file://...,
memory://...; tasks/storage.py). A memory map needs a file of this machine, so the token files
of a remote directory are copied once into a local cache (fsspec's `filecache`, which fetches
again when the remote file changes) and read from there; meta.json is read in place.
"""

from __future__ import annotations

import json
import os
import posixpath
from dataclasses import dataclass
from typing import Any, Literal

import fsspec
import numpy as np

from ray_diloco.tasks import storage

META = "meta.json"
TRAIN, HELDOUT = "train.bin", "val.bin"
TokenDtype = Literal["uint16", "uint32"]
CACHE_DIR = "~/.cache/ray_diloco/token_files"


@dataclass(frozen=True)
class TokenFiles:
    """Where the token files are and how to read them."""

    directory: str  # as given: a path or an fsspec URL
    local: dict[str, str]  # file name -> the file of this machine its memory map reads
    dtype: TokenDtype
    vocab_size: int
    meta: dict[str, Any]

    @classmethod
    def open(
        cls,
        directory: str,
        dtype: TokenDtype | None = None,
        vocab_size: int | None = None,
        cache_dir: str = CACHE_DIR,
    ) -> TokenFiles:
        """Read `directory`'s meta.json (if any); `dtype`/`vocab_size` fill or override it.
        A remote directory's token files are fetched into `cache_dir` first."""
        location = directory if storage.is_url(directory) else os.path.expanduser(directory)
        fs, root = storage.filesystem(location, "data_dir")
        meta_path = posixpath.join(root, META)
        try:
            if not fs.isdir(root):
                raise ValueError(
                    f"data_dir={directory!r} is not a directory; write one with "
                    "`ray-diloco prepare-data --input 'texts/**/*.txt' --out DIR`"
                )
            meta: dict[str, Any] = (
                json.loads(fs.cat_file(meta_path)) if fs.isfile(meta_path) else {}
            )
            missing = [n for n in (TRAIN, HELDOUT) if not fs.isfile(posixpath.join(root, n))]
        except OSError as err:
            raise ValueError(f"data_dir={directory!r}: cannot read it ({err})") from None
        dtype = dtype or meta.get("dtype")
        vocab_size = vocab_size or meta.get("vocab_size")
        if dtype not in ("uint16", "uint32") or not vocab_size:
            raise ValueError(
                f"data_dir={directory!r} has no {META}: give task_args.dtype (uint16 or uint32) "
                "and task_args.vocab_size (nanoGPT's GPT-2 files: uint16, 50257)"
            )
        if missing:
            raise ValueError(f"data_dir={directory!r} lacks {missing[0]}")
        local = {n: _local_file(fs, posixpath.join(root, n), cache_dir) for n in (TRAIN, HELDOUT)}
        files = cls(directory, local, dtype, int(vocab_size), meta)
        for name in (TRAIN, HELDOUT):
            files.check(name)
        return files

    def stream(self, name: str) -> np.ndarray:
        """The token ids of `name` as a read-only memory map."""
        return np.memmap(self.local[name], dtype=self.dtype, mode="r")

    def check(self, name: str, sample: int = 10_000_000) -> None:
        """Refuse files whose ids do not fit the vocabulary (a dtype or vocab_size mistake),
        judged on their first `sample` tokens, so opening a huge corpus stays cheap."""
        tokens = self.stream(name)
        if tokens.size == 0:
            raise ValueError(f"{posixpath.join(self.directory, name)} is empty")
        top = int(tokens[:sample].max())
        if top >= self.vocab_size:
            raise ValueError(
                f"{posixpath.join(self.directory, name)}: token id {top} >= vocab_size "
                f"{self.vocab_size}; the files, their dtype and the vocabulary size disagree"
            )

    def streams(self) -> tuple[np.ndarray, np.ndarray]:
        return self.stream(TRAIN), self.stream(HELDOUT)


def _local_file(fs: Any, path: str, cache_dir: str) -> str:
    """`path` on `fs` as a file of this machine: itself, or its copy in `cache_dir`."""
    if storage.is_local(fs):
        return str(path)
    url = fs.unstrip_protocol(path)
    cache = {"cache_storage": os.path.expanduser(cache_dir), "check_files": True}
    try:
        return str(fsspec.open_local(f"filecache::{url}", filecache=cache))
    except OSError as err:
        raise ValueError(f"data_dir: cannot fetch {url} into {cache_dir} ({err})") from None
