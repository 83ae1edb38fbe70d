"""`ray-diloco prepare-data`: the parser; tasks/prepare.py tokenizes."""

from __future__ import annotations

import time

from ray_diloco.cli.help import parser
from ray_diloco.config import check_output_dir, whole_number


def prepare_data_main(argv: list[str]) -> int:
    p = parser("prepare-data")
    p.add_argument(
        "--input",
        action="append",
        required=True,
        help="file, glob or fsspec URL (gs://bucket/texts/*.txt), repeatable",
    )
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--tokenizer", help="an existing tokenizer.json (default: train a BPE)")
    p.add_argument("--vocab-size", type=whole_number, default=8192, help="BPE vocabulary to train")
    p.add_argument(
        "--heldout-fraction",
        type=float,
        default=0.02,
        help="share of the files held out (by a hash of the path)",
    )
    args = p.parse_args(argv)
    if not 0 < args.heldout_fraction < 0.5:
        raise ValueError(f"--heldout-fraction {args.heldout_fraction}: use a value in (0, 0.5)")
    if args.vocab_size < 260:
        raise ValueError(f"--vocab-size {args.vocab_size}: a byte-level BPE needs >= 260")
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        raise ValueError(
            "prepare-data needs the tokenizers package, an optional extra: "
            "pip install 'ray_diloco[data]'"
        ) from None
    check_output_dir(args.out, "--out")  # before the tokenizing, which takes a while
    from ray_diloco.tasks.prepare import prepare

    t0 = time.perf_counter()
    meta = prepare(args.input, args.out, args.tokenizer, args.vocab_size, args.heldout_fraction)
    print(
        f"wrote {meta['train_tokens']:,} train and {meta['heldout_tokens']:,} held-out tokens "
        f"({meta['dtype']}, vocabulary {meta['vocab_size']:,}) from "
        f"{meta['train_documents'] + meta['heldout_documents']} files to {args.out} in "
        f"{time.perf_counter() - t0:.1f} s"
    )
    return 0
