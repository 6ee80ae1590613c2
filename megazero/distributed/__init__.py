"""The distributed substrate: the rank grid and its groups, collectives, torch.distributed init.

- ``parallel_state``: ``ParallelState`` (tp/dp/pp/model-parallel/embedding groups of one rank,
  Megatron's rank order) and the pure rank arithmetic (``rank_grid``, ``rank_of``).
- ``comm``: every collective megazero issues (byte accounting, groups of one short-circuit,
  ``OfflineGroup`` for shape-only tools); ``ring``: ring reduce-scatter/all-gather for gloo.
- ``compressed``: ``CompressedAllReduce``, the 1-bit all-reduce with error feedback of 1-bit
  Adam (the sign codec, ``megazero.ops.sign_pack``, passed in).
- ``init``: ``init_distributed`` (backend choice, torchrun or a world of one).

Imports nothing of megazero but ``config``.
"""

from megazero.distributed.init import (
    default_backend,
    destroy_distributed,
    init_distributed,
    launched_by_torchrun,
)
from megazero.distributed.parallel_state import ParallelState, coords_of, rank_grid, rank_of

__all__ = ["ParallelState", "coords_of", "default_backend", "destroy_distributed",
           "init_distributed", "launched_by_torchrun", "rank_grid", "rank_of"]
