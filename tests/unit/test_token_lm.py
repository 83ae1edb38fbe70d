"""Pre-tokenized token files: `ray-diloco prepare-data` writes them with a real tokenizer
(tasks/prepare.py), and the `token_lm` task trains from them (tasks/token_lm.py)."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import fsspec
import numpy as np
import pytest

from ray_diloco.config import ConfigError, load_config
from ray_diloco.task import load_task
from ray_diloco.tasks.prepare import prepare
from ray_diloco.tasks.token_files import TokenFiles

ROOT = Path(__file__).resolve().parents[2]
WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "while",
    "dogs",
    "ran",
    "far",
    "away",
    "and",
    "then",
    "slept",
    "until",
    "morning",
]
TINY_MODEL = {"d_model": 32, "num_layers": 2, "num_heads": 2, "d_ff": 64, "seq_len": 16}


@pytest.fixture(scope="module")
def texts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("texts")
    rng = random.Random(0)
    for i in range(24):
        sub = root / f"part{i % 3}"
        sub.mkdir(exist_ok=True)
        # a little grammar: "word word." sentences, enough structure to learn quickly
        words = [rng.choice(WORDS) + ("." if rng.random() < 0.1 else "") for _ in range(800)]
        (sub / f"doc{i:02d}.txt").write_text(" ".join(words))
    return root


@pytest.fixture(scope="module")
def prepared(texts: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tokens")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "ray_diloco.cli",
            "prepare-data",
            "--input",
            f"{texts}/**/*.txt",
            "--out",
            str(out),
            "--vocab-size",
            "400",
            "--heldout-fraction",
            "0.1",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "held-out tokens (uint16" in run.stdout
    return out


def test_prepare_data_writes_token_files_that_decode_back(prepared: Path, texts: Path) -> None:
    from tokenizers import Tokenizer

    meta = json.loads((prepared / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and 260 <= meta["vocab_size"] <= 400
    train = np.fromfile(prepared / "train.bin", dtype=np.uint16)
    held = np.fromfile(prepared / "val.bin", dtype=np.uint16)
    assert train.size == meta["train_tokens"] and held.size == meta["heldout_tokens"] > 0
    assert meta["train_documents"] + meta["heldout_documents"] == 24
    # documents are separated by the end-of-text token and decode back to their text
    tok = Tokenizer.from_file(str(prepared / "tokenizer.json"))
    first_doc = train[: int(np.argmax(train == meta["eot_id"]))]
    decoded = tok.decode(first_doc.tolist())
    bodies = {p.read_text() for p in texts.rglob("*.txt")}
    assert decoded in bodies
    assert np.count_nonzero(train == meta["eot_id"]) == meta["train_documents"]


def test_prepare_data_with_an_existing_tokenizer_reuses_its_vocabulary(
    prepared: Path, texts: Path, tmp_path: Path
) -> None:
    meta = prepare([f"{texts}/part0/*.txt"], str(tmp_path), str(prepared / "tokenizer.json"))
    assert meta["vocab_size"] == json.loads((prepared / "meta.json").read_text())["vocab_size"]


def test_token_lm_trains_from_the_prepared_files(prepared: Path, tmp_path: Path) -> None:
    from ray_diloco.sim.simulate import run_reference

    args = {"data_dir": str(prepared), "model": TINY_MODEL, "eval_batches": 2, "eval_batch_size": 8}
    cfg = load_config(
        ROOT / "tests" / "fixtures" / "tiny_train.yaml",
        [
            "task=ray_diloco.tasks.token_lm:make_task",
            f"task_args={json.dumps(args)}",
            "diloco.mode=decoupled",
            "token_budget=24000",
            f"run_dir={tmp_path}",
        ],
    )
    summary = run_reference(cfg)
    evals = [e["heldout_loss"] for e in summary["evals"]]
    assert evals[0] == pytest.approx(
        np.log(json.loads((prepared / "meta.json").read_text())["vocab_size"]), abs=0.3
    )  # uniform at init
    assert evals[-1] < evals[0] - 2.0, evals


def test_nanogpt_directories_need_their_dtype_and_vocabulary(
    prepared: Path, tmp_path: Path
) -> None:
    for name in ("train.bin", "val.bin"):
        shutil.copy(prepared / name, tmp_path / name)
    with pytest.raises(ConfigError, match=r"has no meta\.json: give task_args\.dtype"):
        load_task("ray_diloco.tasks.token_lm:make_task", {"data_dir": str(tmp_path)})
    task = load_task(
        "ray_diloco.tasks.token_lm:make_task",
        {"data_dir": str(tmp_path), "dtype": "uint16", "vocab_size": 512},
    )
    assert task.data.tokens_per_example == 64
    with pytest.raises(ConfigError, match=r"token id \d+ >= vocab_size 10"):
        load_task(
            "ray_diloco.tasks.token_lm:make_task",
            {"data_dir": str(tmp_path), "dtype": "uint16", "vocab_size": 10},
        )


def test_prepare_data_bad_input_is_one_error_line(tmp_path: Path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "ray_diloco.cli",
            "prepare-data",
            "--input",
            str(tmp_path / "none*.txt"),
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert run.returncode == 2
    assert run.stderr.startswith("error: --input: ") and run.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.fixture
def memory_dir(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh directory on fsspec's in-memory file system (one per process, so what is put
    there is read back in this process only)."""
    fs = fsspec.filesystem("memory")
    root = f"/{request.node.name}"
    yield f"memory://{root}"
    if fs.exists(root):
        fs.rm(root, recursive=True)


def test_token_files_load_from_an_fsspec_url_as_from_their_directory(
    prepared: Path, memory_dir: str, tmp_path: Path
) -> None:
    fs = fsspec.filesystem("memory")
    for name in ("train.bin", "val.bin", "meta.json"):
        fs.pipe(f"{memory_dir}/{name}", (prepared / name).read_bytes())
    args = {"model": TINY_MODEL, "cache_dir": str(tmp_path / "cache")}
    local = load_task("ray_diloco.tasks.token_lm:make_task", {**args, "data_dir": str(prepared)})
    for data_dir in (memory_dir, f"file://{prepared}"):
        task = load_task("ray_diloco.tasks.token_lm:make_task", {**args, "data_dir": data_dir})
        assert task.data.tokens_per_example == local.data.tokens_per_example
        for x, y in zip(task.data.heldout(), local.data.heldout(), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    cached = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(cached) == 3 and "cache" in cached  # the two token files, fsspec's index
    bad = np.full(64, 65535, dtype=np.uint16).tobytes()  # ids beyond the vocabulary
    fs.pipe(f"{memory_dir}/val.bin", bad)  # the remote file changed: fetched again
    with pytest.raises(ValueError, match=r"val\.bin: token id 65535 >= vocab_size"):
        TokenFiles.open(memory_dir, cache_dir=str(tmp_path / "cache"))


def test_prepare_data_reads_its_input_from_an_fsspec_url(
    texts: Path, memory_dir: str, tmp_path: Path
) -> None:
    fs = fsspec.filesystem("memory")
    for path in sorted(texts.glob("part1/*.txt")):
        fs.pipe(f"{memory_dir}/corpus/{path.name}", path.read_bytes())
    remote = prepare([f"{memory_dir}/corpus/*.txt"], str(tmp_path / "remote"), vocab_size=300)
    local = prepare([f"{texts}/part1/*.txt"], str(tmp_path / "local"), vocab_size=300)
    assert remote["inputs"] != local["inputs"]
    keys = ("train_tokens", "heldout_tokens", "train_documents", "heldout_documents")
    assert {k: remote[k] for k in keys} == {k: local[k] for k in keys}  # the same split
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / "remote" / name).read_bytes() == (tmp_path / "local" / name).read_bytes()
    with pytest.raises(ValueError, match=r"--input: 'memory://.*/none\*\.txt' matches no file"):
        prepare([f"{memory_dir}/none*.txt"], str(tmp_path / "none"))


def test_an_unknown_url_scheme_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"data_dir='nosuch://bucket/tokens': .*nosuch"):
        load_task("ray_diloco.tasks.token_lm:make_task", {"data_dir": "nosuch://bucket/tokens"})
