"""Layer: tasks (pure, no Ray). The built-in default task: a byte-level transformer language
model (tasks/transformer.py) on a byte corpus (tasks/byte_corpus.py; by default the Python
standard library's source, so a laptop run needs no download).

    task: ray_diloco.tasks.byte_lm:make_task
    task_args:
      model: {d_model: 96, num_layers: 4, num_heads: 4, d_ff: 384, seq_len: 64}
      data: {source: files, paths: ["corpus/**/*.txt"]}
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from ray_diloco.task import Task
from ray_diloco.tasks import transformer
from ray_diloco.tasks.byte_corpus import DataConfig, load_corpus
from ray_diloco.tasks.windows import TokenWindows


class ByteLMArgs(BaseModel):
    """`task_args` of the byte-level language model."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: transformer.ModelConfig = transformer.ModelConfig()
    data: DataConfig = DataConfig()


def make_task(**task_args: Any) -> Task:
    args = ByteLMArgs.model_validate(task_args)
    if args.model.vocab_size < 256:
        raise ValueError(
            f"task_args.model.vocab_size={args.model.vocab_size}: a byte model needs 256"
        )

    def streams() -> tuple[Any, Any]:
        corpus = load_corpus(args.data)
        return corpus.train, corpus.heldout

    data = TokenWindows(
        streams, args.model.seq_len, args.data.eval_batches, args.data.eval_batch_size
    )
    return Task(
        init=lambda rng: transformer.init_params(args.model, rng),
        loss=transformer.next_token_loss(args.model),
        data=data,
        name="byte_lm",
    )
