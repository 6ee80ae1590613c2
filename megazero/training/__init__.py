"""The training loop: the one package that wires tensor, pipeline and data parallelism together.

- ``pretrain``: ``pretrain(datasets_provider, model_provider, forward_step_func, config)``,
  Megatron's entry point (schedule -> optimizer -> log -> eval -> save).
- ``data``: tokenizer, default corpus and the dp-sharded batch iterators.
- ``log``: Megatron's log line, TensorBoard scalars, memory report; ``timers``: named timers.
"""

from megazero.training.pretrain import pretrain
from megazero.training.step import evaluate, train_step

__all__ = ["evaluate", "pretrain", "train_step"]
