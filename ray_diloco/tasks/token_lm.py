"""Layer: tasks (pure, no Ray). The built-in task for real data: the transformer language
model (tasks/transformer.py) on pre-tokenized token files (tasks/token_files.py).

    ray-diloco prepare-data --input 'texts/**/*.txt' --out data/texts --vocab-size 8192
    task: ray_diloco.tasks.token_lm:make_task
    task_args:
      data_dir: data/texts          # train.bin, val.bin (+ meta.json) on every host, or a
                                    # URL: gs://bucket/tokens (copied into cache_dir once)
      model: {d_model: 256, num_layers: 6, num_heads: 8, d_ff: 1024, seq_len: 256}

The model's vocabulary defaults to the files' (`meta.json`, or `vocab_size` for nanoGPT files).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ray_diloco.task import Task
from ray_diloco.tasks import transformer
from ray_diloco.tasks.token_files import CACHE_DIR, TokenDtype, TokenFiles
from ray_diloco.tasks.windows import TokenWindows


class TokenLMArgs(BaseModel):
    """`task_args` of the token-file language model."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    data_dir: str
    cache_dir: str = CACHE_DIR  # where a remote data_dir's token files are copied to
    dtype: TokenDtype | None = None
    vocab_size: int | None = Field(None, ge=2)
    model: transformer.ModelConfig = transformer.ModelConfig()
    eval_batches: int = Field(8, ge=1)
    eval_batch_size: int = Field(32, ge=1)


def make_task(**task_args: Any) -> Task:
    args = TokenLMArgs.model_validate(task_args)
    files = TokenFiles.open(args.data_dir, args.dtype, args.vocab_size, args.cache_dir)
    model = args.model
    if "vocab_size" not in (task_args.get("model") or {}):
        model = model.model_copy(update={"vocab_size": files.vocab_size})
    elif model.vocab_size < files.vocab_size:
        raise ValueError(
            f"task_args.model.vocab_size={model.vocab_size} is smaller than the token files' "
            f"vocabulary ({files.vocab_size}); raise it or leave it out"
        )
    data = TokenWindows(files.streams, model.seq_len, args.eval_batches, args.eval_batch_size)
    return Task(
        init=lambda rng: transformer.init_params(model, rng),
        loss=transformer.next_token_loss(model),
        data=data,
        name="token_lm",
    )
