"""Layer: tasks (pure, no Ray). Pre-tokenized token files: flat binary arrays of uint16 or
uint32 token ids, the format nanoGPT users already have (`train.bin`, `val.bin`), read as
memory maps so a corpus larger than memory costs nothing until a window is read.

A directory written by `ray-diloco prepare-data` (tasks/prepare.py) also holds `meta.json`
(dtype, vocabulary size, end-of-text id, the tokenizer that wrote it) and `tokenizer.json`; a
nanoGPT directory has no `meta.json`, so its dtype and vocabulary size are given instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

META = "meta.json"
TRAIN, HELDOUT = "train.bin", "val.bin"
TokenDtype = Literal["uint16", "uint32"]


@dataclass(frozen=True)
class TokenFiles:
    """Where the token files are and how to read them."""

    directory: Path
    dtype: TokenDtype
    vocab_size: int
    meta: dict[str, Any]

    @classmethod
    def open(
        cls, directory: str, dtype: TokenDtype | None = None, vocab_size: int | None = None
    ) -> TokenFiles:
        """Read `directory`'s meta.json (if any); `dtype`/`vocab_size` fill or override it."""
        root = Path(directory).expanduser()
        if not root.is_dir():
            raise ValueError(
                f"data_dir={directory!r} is not a directory; write one with "
                "`ray-diloco prepare-data --input 'texts/**/*.txt' --out DIR`"
            )
        meta: dict[str, Any] = {}
        if (root / META).is_file():
            meta = json.loads((root / META).read_text())
        dtype = dtype or meta.get("dtype")
        vocab_size = vocab_size or meta.get("vocab_size")
        if dtype not in ("uint16", "uint32") or not vocab_size:
            raise ValueError(
                f"data_dir={directory!r} has no {META}: give task_args.dtype (uint16 or uint32) "
                "and task_args.vocab_size (nanoGPT's GPT-2 files: uint16, 50257)"
            )
        files = cls(root, dtype, int(vocab_size), meta)
        for name in (TRAIN, HELDOUT):
            if not (root / name).is_file():
                raise ValueError(f"data_dir={directory!r} lacks {name}")
            files.check(name)
        return files

    def stream(self, name: str) -> np.ndarray:
        """The token ids of `name` as a read-only memory map."""
        return np.memmap(self.directory / name, dtype=self.dtype, mode="r")

    def check(self, name: str, sample: int = 10_000_000) -> None:
        """Refuse files whose ids do not fit the vocabulary (a dtype or vocab_size mistake),
        judged on their first `sample` tokens, so opening a huge corpus stays cheap."""
        tokens = self.stream(name)
        if tokens.size == 0:
            raise ValueError(f"{self.directory / name} is empty")
        top = int(tokens[:sample].max())
        if top >= self.vocab_size:
            raise ValueError(
                f"{self.directory / name}: token id {top} >= vocab_size {self.vocab_size}; "
                "the files, their dtype and the vocabulary size disagree"
            )

    def streams(self) -> tuple[np.ndarray, np.ndarray]:
        return self.stream(TRAIN), self.stream(HELDOUT)
