"""Tensor-parallel layers (Megatron's), sharded over the tensor-parallel group passed in.

    ColumnParallelLinear   Y = X A^T + b, A split by output rows: rank i holds A_i [out/tp, in]
    RowParallelLinear      Y = X A^T + b, A split by input columns: rank i holds A_i [out, in/tp]
    VocabParallelEmbedding E split by vocabulary rows, vocab padded to a multiple of
                           make_vocab_size_divisible_by * tp; ids outside the shard give zeros

Each layer takes ``tp_group`` (``None`` for one process) and, optionally, ``sequence_parallel``
(inputs/outputs split along the sequence dim, Megatron's sequence parallelism). Weights are
initialised layout-invariantly (see ``initializers``): one key gives the same full weight for
any tp. Without an explicit ``init_key`` a key is drawn from torch's default generator, so ranks
seeded alike agree. Tensors are ``[s, b, h]`` (sequence first) but any leading dims work.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megazero.distributed import comm
from megazero.tensor_parallel import mappings
from megazero.tensor_parallel.initializers import draw_key, fill_shard, init_key
from megazero.tensor_parallel.meta import (
    InitSpec,
    ParamMeta,
    ShardInfo,
    init_normal,
    init_zeros,
    replicated,
    set_meta,
)


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what} {numerator} is not divisible by {denominator}")
    return numerator // denominator


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp_size: int) -> int:
    """Megatron's padding: the smallest multiple of divisible_by * tp holding the vocabulary."""
    multiple = make_vocab_size_divisible_by * tp_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


def _make_param(shape, spec: InitSpec, shard: ShardInfo, key: int | None, *, dtype, device,
                tensor_parallel: bool, sequence_parallel: bool = False) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
    set_meta(param, ParamMeta(shard=shard, local_shape=tuple(shape), init=spec,
                              tensor_parallel=tensor_parallel,
                              sequence_parallel=sequence_parallel))
    if param.device.type != "meta":
        fill_shard(param.data, spec, shard, draw_key() if key is None else key)
    return param


def _keys(init_key_: int | None, seed_name: tuple[int, str] | None):
    """(weight key, bias key) from an explicit key or (seed, name); None means draw."""
    if seed_name is not None:
        seed, name = seed_name
        return init_key(seed, f"{name}.weight"), init_key(seed, f"{name}.bias")
    if init_key_ is not None:
        return init_key_, init_key_ + 1
    return None, None


class _ParallelLinear(nn.Module):
    """What both tensor-parallel linears hold: the tp group and its size and rank, the sizes,
    and a weight (and optional bias) drawn layout-invariantly for their shards."""

    def __init__(self, input_size: int, output_size: int, tp_group, *, skip_bias_add: bool,
                 sequence_parallel: bool):
        super().__init__()
        self.tp_group = tp_group
        self.tp_size, self.tp_rank = comm.group_size(tp_group), comm.group_rank(tp_group)
        self.input_size, self.output_size = input_size, output_size
        self.skip_bias_add, self.sequence_parallel = skip_bias_add, sequence_parallel

    def _make_params(self, weight_shape, weight_shard: ShardInfo, bias_shape, bias_shard, *,
                     bias: bool, bias_sequence_parallel: bool, init_method, init_key,
                     seed_name, params_dtype, device) -> None:
        wkey, bkey = _keys(init_key, seed_name)
        self.weight = _make_param(weight_shape, init_method or init_normal(0.02), weight_shard,
                                  wkey, dtype=params_dtype, device=device, tensor_parallel=True)
        if not bias:
            self.register_parameter("bias", None)
            return
        self.bias = _make_param(bias_shape, init_zeros(), bias_shard, bkey, dtype=params_dtype,
                                device=device, tensor_parallel=bias_shard.dim is not None,
                                sequence_parallel=bias_sequence_parallel)


class ColumnParallelLinear(_ParallelLinear):
    """Linear layer with the output dimension split over tp ranks.

    Forward: input ``[s, b, in]`` (``[s/tp, b, in]`` with sequence_parallel, all-gathered
    first) -> output ``[s, b, out/tp]``, or ``[s, b, out]`` with ``gather_output``. Returns
    ``(output, bias)``: ``bias`` is ``None`` unless ``skip_bias_add`` (then it is this rank's
    bias shard, for the caller to fuse). Backward all-reduces (or reduce-scatters with
    sequence parallelism) the input gradient over tp.
    """

    def __init__(self, input_size: int, output_size: int, *, tp_group=None, bias: bool = True,
                 gather_output: bool = True, skip_bias_add: bool = False,
                 sequence_parallel: bool = False, init_method: InitSpec | None = None,
                 init_key: int | None = None, seed_name: tuple[int, str] | None = None,
                 params_dtype: torch.dtype = torch.float32, device=None):
        super().__init__(input_size, output_size, tp_group, skip_bias_add=skip_bias_add,
                         sequence_parallel=sequence_parallel)
        if sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: sequence_parallel and gather_output "
                             "cannot both be set")
        per = self.output_size_per_partition = divide(output_size, self.tp_size, "output size")
        self.gather_output = gather_output
        start = self.tp_rank * per
        self._make_params((per, input_size), ShardInfo((output_size, input_size), 0, start, per),
                          (per,), ShardInfo((output_size,), 0, start, per), bias=bias,
                          bias_sequence_parallel=False, init_method=init_method,
                          init_key=init_key, seed_name=seed_name, params_dtype=params_dtype,
                          device=device)

    def forward(self, x):
        if self.sequence_parallel:
            x = mappings.gather_from_sequence_parallel_region(x, self.tp_group)  # [s, b, in]
        else:
            x = mappings.copy_to_tp_region(x, self.tp_group)
        bias = self.bias if not self.skip_bias_add else None
        out = F.linear(x, self.weight, bias)  # [s, b, out/tp]
        if self.gather_output:
            out = mappings.gather_from_tp_region(out, self.tp_group)  # [s, b, out]
        return out, (self.bias if self.skip_bias_add else None)

    def extra_repr(self):
        return (f"in={self.input_size}, out={self.output_size}, tp={self.tp_size}, "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(_ParallelLinear):
    """Linear layer with the input dimension split over tp ranks.

    Forward: input ``[s, b, in/tp]`` (or ``[s, b, in]``, scattered first, unless
    ``input_is_parallel``) -> partial products all-reduced over tp -> ``[s, b, out]``; with
    sequence_parallel they are reduce-scattered instead -> ``[s/tp, b, out]``. The bias is
    replicated and added after the reduction. Returns ``(output, bias)`` like Megatron.
    """

    def __init__(self, input_size: int, output_size: int, *, tp_group=None, bias: bool = True,
                 input_is_parallel: bool = False, skip_bias_add: bool = False,
                 sequence_parallel: bool = False, init_method: InitSpec | None = None,
                 init_key: int | None = None, seed_name: tuple[int, str] | None = None,
                 params_dtype: torch.dtype = torch.float32, device=None):
        super().__init__(input_size, output_size, tp_group, skip_bias_add=skip_bias_add,
                         sequence_parallel=sequence_parallel)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel")
        per = self.input_size_per_partition = divide(input_size, self.tp_size, "input size")
        self.input_is_parallel = input_is_parallel
        # The bias is replicated; with sequence parallelism each rank sees only its part of
        # the sequence, so its gradient is all-reduced over tp (gradient finalisation).
        self._make_params((output_size, per),
                          ShardInfo((output_size, input_size), 1, self.tp_rank * per, per),
                          (output_size,), replicated((output_size,)), bias=bias,
                          bias_sequence_parallel=sequence_parallel, init_method=init_method,
                          init_key=init_key, seed_name=seed_name, params_dtype=params_dtype,
                          device=device)

    def forward(self, x):
        if not self.input_is_parallel:
            x = mappings.scatter_to_tp_region(x, self.tp_group)  # [s, b, in/tp]
        out = F.linear(x, self.weight)  # [s, b, out] partial sums
        if self.sequence_parallel:
            out = mappings.reduce_scatter_to_sequence_parallel_region(out, self.tp_group)
        else:
            out = mappings.reduce_from_tp_region(out, self.tp_group)
        if self.skip_bias_add or self.bias is None:
            return out, self.bias
        return out + self.bias, None

    def extra_repr(self):
        return (f"in={self.input_size}, out={self.output_size}, tp={self.tp_size}, "
                f"input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split over tp ranks.

    The table is padded to ``padded_vocab_size(vocab, divisible_by, tp)`` rows; padding rows are
    zeros. Rank i holds rows ``[i * Vp/tp, (i + 1) * Vp/tp)``; ids outside that range look up
    zeros, and the partial embeddings are all-reduced over tp (or reduce-scattered along the
    sequence with ``sequence_parallel``). Input ids ``[s, b]`` -> output ``[s, b, h]``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group=None,
                 make_vocab_size_divisible_by: int = 128, sequence_parallel: bool = False,
                 init_method: InitSpec | None = None, init_key: int | None = None,
                 seed_name: tuple[int, str] | None = None,
                 params_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.tp_group = tp_group
        self.tp_size, self.tp_rank = comm.group_size(tp_group), comm.group_rank(tp_group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padded_vocab_size = padded_vocab_size(num_embeddings, make_vocab_size_divisible_by,
                                                   self.tp_size)
        self.sequence_parallel = sequence_parallel
        per = self.padded_vocab_size // self.tp_size
        self.vocab_start_index = self.tp_rank * per
        self.vocab_end_index = self.vocab_start_index + per
        real = max(0, min(self.vocab_end_index, num_embeddings) - self.vocab_start_index)
        shard = ShardInfo((num_embeddings, embedding_dim), 0,
                          min(self.vocab_start_index, num_embeddings), real)
        wkey, _ = _keys(init_key, seed_name)
        self.weight = _make_param((per, embedding_dim), init_method or init_normal(0.02), shard,
                                  wkey, dtype=params_dtype, device=device,
                                  tensor_parallel=True)

    def forward(self, ids):
        if self.tp_size > 1:
            outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
            local = (ids - self.vocab_start_index).masked_fill(outside, 0)
        else:
            local = ids
        out = F.embedding(local, self.weight)  # [s, b, h]
        if self.tp_size > 1:
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence_parallel_region(out, self.tp_group)
        return mappings.reduce_from_tp_region(out, self.tp_group)

    def extra_repr(self):
        return (f"vocab={self.num_embeddings} (padded {self.padded_vocab_size}), "
                f"dim={self.embedding_dim}, tp={self.tp_size}")
