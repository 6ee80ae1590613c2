"""Checkpoints in Megatron's layout that load at any layout.

- ``paths``: file names, the tracker, atomic writes with a CRC-32 sidecar and the file's
  coordinates, ``verify_file`` (before unpickling), ``load_file`` (``weights_only=True``),
  defensive parsing of the tracker and ``layout.json``, removal of dead writers' temporaries.
- ``save``: ``save_checkpoint`` (model files per (tp, pp) cell, ZeRO shards per dp rank,
  ``layout.json``, the tracker last; never NaN or inf).
- ``savedir``: ``prepare_save_dir`` (writable ``--save``, its lock, no ``--load`` typo that
  would move the tracker back).
- ``reader``: ``CheckpointReader``, memory-mapped access to any region of any saved tensor,
  every file checked against its checksum and coordinates.
- ``load``: ``load_checkpoint``, the one load path (the same layout is the reader's special
  case); returns a ``LoadedCheckpoint`` for the caller to apply.
- ``reshard``: ``assemble`` / ``cut`` full tensors from and to shards; ``rng``: RNG states.
- ``megatron``: Megatron-LM checkpoints (``torch`` format, legacy or Megatron-core names):
  ``is_megatron_checkpoint``, ``MegatronReader`` (full tensors and optimizer states for any
  layout; ``load_checkpoint`` uses it for ``--load`` of a Megatron folder);
  ``megatron_format``: safe unpickling, names, the architecture from Megatron's args;
  ``megatron_save``: ``write_megatron_checkpoint`` (full tensors -> Megatron files at any
  tp/pp).

Imports ``distributed`` and ``tensor_parallel`` (the ``ParamMeta`` contract), never the model,
the optimizers' classes or training: the optimizer is reached through its
``sharded_state_dict`` / ``load_sharded_state_dict`` methods.
"""

from megazero.checkpoint.load import LoadedCheckpoint, checkpoint_model_args, load_checkpoint
from megazero.checkpoint.megatron import MegatronReader, is_megatron_checkpoint
from megazero.checkpoint.megatron_save import write_megatron_checkpoint
from megazero.checkpoint.paths import CheckpointError, read_tracker, verify_file
from megazero.checkpoint.reader import CheckpointReader
from megazero.checkpoint.save import save_checkpoint
from megazero.checkpoint.savedir import SaveDirGuard, prepare_save_dir

__all__ = ["CheckpointError", "CheckpointReader", "LoadedCheckpoint", "MegatronReader",
           "SaveDirGuard", "checkpoint_model_args", "is_megatron_checkpoint", "load_checkpoint",
           "prepare_save_dir", "read_tracker", "save_checkpoint", "verify_file",
           "write_megatron_checkpoint"]
