"""Checkpoints in Megatron's layout that load at any layout.

- ``paths``: file names, the tracker, atomic writes, ``load_file`` (``weights_only=True``).
- ``save``: ``save_checkpoint`` (model files per (tp, pp) cell, ZeRO shards per dp rank,
  ``layout.json``, the tracker last).
- ``reader``: ``CheckpointReader``, memory-mapped access to any region of any saved tensor.
- ``load``: ``load_checkpoint``, the one load path (the same layout is the reader's special
  case); returns a ``LoadedCheckpoint`` for the caller to apply.
- ``reshard``: ``assemble`` / ``cut`` full tensors from and to shards; ``rng``: RNG states.

Imports ``distributed`` and ``tensor_parallel`` (the ``ParamMeta`` contract), never the model,
the optimizers' classes or training: the optimizer is reached through its
``sharded_state_dict`` / ``load_sharded_state_dict`` methods.
"""

from megazero.checkpoint.load import LoadedCheckpoint, checkpoint_model_args, load_checkpoint
from megazero.checkpoint.paths import CheckpointError, read_tracker
from megazero.checkpoint.reader import CheckpointReader
from megazero.checkpoint.save import save_checkpoint

__all__ = ["CheckpointError", "CheckpointReader", "LoadedCheckpoint", "checkpoint_model_args",
           "load_checkpoint", "read_tracker", "save_checkpoint"]
