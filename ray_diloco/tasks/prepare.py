"""Layer: tasks (pure, no Ray). What `ray-diloco prepare-data` does (its parser:
cli/prepare_data.py): text files to the token files of `token_lm` (tasks/token_files.py), with
a real tokenizer.

The tokenizer library is Hugging Face `tokenizers`: it runs offline (a byte-level BPE is
trained on the training files in seconds, or a `tokenizer.json` the user already has is
loaded), it is fast (Rust, batched), and its `tokenizer.json` is what most open models ship.
(`tiktoken` only has OpenAI's fixed vocabularies, which it downloads on first use.)

Files are split into train and held-out by a stable hash of their relative path (the byte
corpus's rule, `byte_corpus.is_heldout`), documents are joined with an end-of-text token, and
ids are stored as uint16 when the vocabulary fits, else uint32.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ray_diloco.tasks.byte_corpus import expand_paths, is_heldout, read_documents
from ray_diloco.tasks.token_files import HELDOUT, META, TRAIN

EOT = "<|endoftext|>"
FORMAT = "ray_diloco.tokens/1"
_ENCODE_BATCH = 256


def _train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _encode(tok: Any, texts: list[str], eot: int, dtype: str) -> np.ndarray:
    ids: list[int] = []
    for i in range(0, len(texts), _ENCODE_BATCH):
        for enc in tok.encode_batch(texts[i : i + _ENCODE_BATCH]):
            ids.extend(enc.ids)
            ids.append(eot)
    return np.asarray(ids, dtype=dtype)


def prepare(
    inputs: list[str],
    out: str,
    tokenizer: str | None = None,
    vocab_size: int = 8192,
    heldout_fraction: float = 0.02,
    max_bytes: int = 1 << 40,
) -> dict[str, Any]:
    """Tokenize the files matching `inputs` into `out/{train,val}.bin` + meta.json (+ the
    tokenizer.json used). Raises ValueError naming the option and the fix."""
    from tokenizers import Tokenizer

    docs = read_documents(expand_paths(tuple(inputs), "--input"), max_bytes, "--input")
    texts = {rel: body.decode("utf-8", errors="replace") for rel, body in docs}
    heldout = [t for rel, t in texts.items() if is_heldout(rel, heldout_fraction)]
    train = [t for rel, t in texts.items() if not is_heldout(rel, heldout_fraction)]
    if not heldout or not train:
        if len(texts) < 2:
            raise ValueError(f"--input matches {len(texts)} file(s); the split needs 2 or more")
        # Too few files for the hash to pick both sides: the last file is held out.
        train, heldout = list(texts.values())[:-1], list(texts.values())[-1:]
    if tokenizer:
        try:
            tok = Tokenizer.from_file(tokenizer)
        except Exception as err:
            raise ValueError(f"--tokenizer {tokenizer}: cannot load it ({err})") from None
    else:
        tok = _train_tokenizer(train, vocab_size)
    if tok.token_to_id(EOT) is None:  # a loaded tokenizer without our separator: add it
        tok.add_special_tokens([EOT])
    eot = tok.token_to_id(EOT)
    assert eot is not None  # added just above
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = "uint16" if vocab <= 1 << 16 else "uint32"
    root = Path(out)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--out {out}: cannot create it ({err.strerror})") from None
    train_ids = _encode(tok, train, eot, dtype)
    heldout_ids = _encode(tok, heldout, eot, dtype)
    train_ids.tofile(root / TRAIN)
    heldout_ids.tofile(root / HELDOUT)
    tok.save(str(root / "tokenizer.json"))
    meta = {
        "format": FORMAT,
        "dtype": dtype,
        "vocab_size": vocab,
        "eot_id": eot,
        "tokenizer": "tokenizer.json",
        "train_tokens": int(train_ids.size),
        "heldout_tokens": int(heldout_ids.size),
        "train_documents": len(train),
        "heldout_documents": len(heldout),
        "inputs": inputs,
    }
    (root / META).write_text(json.dumps(meta, indent=2) + "\n")
    return meta
