"""Tensor parallelism: layers, autograd collectives, vocab-parallel loss, RNG and recompute,
and the parameter-metadata contract (``ParamMeta``: how each parameter is sharded and drawn).

Usable on its own in a custom model: it needs only a tensor-parallel process group
(``ParallelState.tp_group``, or any ``torch.distributed`` group, or ``None`` for one process).
"""

from megazero.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megazero.tensor_parallel.initializers import init_key, initialize_parameters
from megazero.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    padded_vocab_size,
)
from megazero.tensor_parallel.mappings import (
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
)
from megazero.tensor_parallel.meta import (
    InitSpec,
    ParamMeta,
    ShardInfo,
    init_normal,
    init_ones,
    init_zeros,
    meta_of,
    set_meta,
    update_meta,
)
from megazero.tensor_parallel.random import (
    RNGStatesTracker,
    checkpoint,
    model_parallel_manual_seed,
)

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "padded_vocab_size",
    "vocab_parallel_cross_entropy", "copy_to_tp_region", "reduce_from_tp_region",
    "scatter_to_tp_region", "gather_from_tp_region", "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region", "reduce_scatter_to_sequence_parallel_region",
    "RNGStatesTracker", "checkpoint", "model_parallel_manual_seed", "InitSpec", "ShardInfo",
    "init_key", "init_normal", "init_ones", "init_zeros", "initialize_parameters", "ParamMeta",
    "meta_of", "set_meta", "update_meta",
]
