"""GPT-2 transformer layer built from tensor-parallel layers, sharded over the tp group.

Per layer (pre-LayerNorm, as GPT-2)::

    x -> LN -> qkv (column-parallel, heads split over tp) -> causal attention on this rank's
      heads -> proj (row-parallel, all-reduce or reduce-scatter) -> +bias, dropout, +x
      -> LN -> fc1 (column-parallel) -> bias+GELU -> fc2 (row-parallel) -> +bias, dropout, +x

Tensors are ``[s, b, h]``; with sequence parallelism the LayerNorm/dropout regions hold
``[s/tp, b, h]`` and the column-parallel layers all-gather the sequence first, the row-parallel
ones reduce-scatter it after. Dropout on tensor-parallel activations (attention probabilities)
and on sequence-parallel activations draws from the tracker's model-parallel stream.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from megazero.config import ModelConfig
from megazero.distributed import comm
from megazero.model.fused import LayerNorm, bias_dropout_add, bias_gelu
from megazero.model.kv_cache import KVCache
from megazero.tensor_parallel import ColumnParallelLinear, RowParallelLinear, init_normal
from megazero.tensor_parallel.random import RNGStatesTracker


def output_init_std(config: ModelConfig) -> float:
    """GPT-2/Megatron scaled init for the layers that write into the residual stream."""
    return config.init_method_std / math.sqrt(2.0 * config.num_layers)


class ParallelAttention(nn.Module):
    """Causal self-attention; this rank computes ``heads / tp`` heads."""

    def __init__(self, config: ModelConfig, tp_group, tracker: RNGStatesTracker | None, *,
                 sequence_parallel: bool, device=None):
        super().__init__()
        tp = comm.group_size(tp_group)
        self.heads_per_rank = config.num_attention_heads // tp
        self.head_dim = config.head_dim
        self.dropout_p = config.attention_dropout
        self.tracker = tracker
        dtype = config.torch_dtype
        # qkv weight rows are ordered [head, (q, k, v), head_dim] (Megatron's layout), so a
        # contiguous shard of rows holds whole heads.
        self.qkv = ColumnParallelLinear(
            config.hidden_size, 3 * config.hidden_size, tp_group=tp_group, gather_output=False,
            sequence_parallel=sequence_parallel, init_method=init_normal(config.init_method_std),
            params_dtype=dtype, device=device)
        self.proj = RowParallelLinear(
            config.hidden_size, config.hidden_size, tp_group=tp_group, input_is_parallel=True,
            skip_bias_add=True, sequence_parallel=sequence_parallel,
            init_method=init_normal(output_init_std(config)), params_dtype=dtype, device=device)

    def forward(self, x, attention_mask=None, kv_cache: KVCache | None = None):
        mixed, _ = self.qkv(x)  # [s, b, 3 * np * hn]
        s, b = mixed.shape[0], mixed.shape[1]
        mixed = mixed.view(s, b, self.heads_per_rank, 3, self.head_dim)
        q, k, v = (t.permute(1, 2, 0, 3) for t in mixed.unbind(dim=3))  # [b, np, s, hn]
        if kv_cache is not None and kv_cache.offset > 0:
            if attention_mask is not None:
                raise ValueError("a KV cache is for causal decoding without attention masks")
            past = kv_cache.offset
            k, v = kv_cache.extend(self, k, v)  # [b, np, past + s, hn]
            # new position i (absolute past + i) sees keys 0..past + i
            keep = torch.ones(s, past + s, dtype=torch.bool, device=q.device).tril(past)
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)  # [b, np, s, hn]
            ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, self.heads_per_rank * self.head_dim)
            return self.proj(ctx)
        if kv_cache is not None:
            kv_cache.extend(self, k, v)  # the prompt: plain causal attention below
        p = self.dropout_p if self.training else 0.0
        fork = self.tracker.fork() if (self.tracker is not None and p > 0) \
            else contextlib.nullcontext()
        with fork:  # attention dropout differs across tp ranks (different heads)
            if attention_mask is None:
                ctx = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
            else:  # attention_mask: [b, 1, s, s], True = masked out (Megatron convention)
                ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask,
                                                     dropout_p=p)
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, self.heads_per_rank * self.head_dim)
        return self.proj(ctx)  # ([s, b, h] or [s/tp, b, h], bias)


class ParallelMLP(nn.Module):
    """h -> ffn/tp (column-parallel) -> bias+GELU -> h (row-parallel)."""

    def __init__(self, config: ModelConfig, tp_group, *, sequence_parallel: bool, device=None):
        super().__init__()
        dtype = config.torch_dtype
        self.fused_bias_gelu = config.bias_gelu_fusion
        self.fc1 = ColumnParallelLinear(
            config.hidden_size, config.ffn_hidden_size, tp_group=tp_group, gather_output=False,
            skip_bias_add=True, sequence_parallel=sequence_parallel,
            init_method=init_normal(config.init_method_std), params_dtype=dtype, device=device)
        self.fc2 = RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, tp_group=tp_group,
            input_is_parallel=True, skip_bias_add=True, sequence_parallel=sequence_parallel,
            init_method=init_normal(output_init_std(config)), params_dtype=dtype, device=device)

    def forward(self, x):
        h, bias = self.fc1(x)  # [s, b, ffn/tp]
        h = bias_gelu(h, bias, self.fused_bias_gelu)
        return self.fc2(h)  # ([s, b, h], bias)


class TransformerLayer(nn.Module):
    """One pre-LayerNorm GPT-2 block."""

    def __init__(self, config: ModelConfig, tp_group, tracker: RNGStatesTracker | None, *,
                 sequence_parallel: bool = False, device=None):
        super().__init__()
        dtype = config.torch_dtype
        ln = dict(sequence_parallel=sequence_parallel, fused=config.fused_layernorm,
                  params_dtype=dtype, device=device)
        self.input_layernorm = LayerNorm(config.hidden_size, config.layernorm_epsilon, **ln)
        self.attention = ParallelAttention(config, tp_group, tracker,
                                           sequence_parallel=sequence_parallel, device=device)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, config.layernorm_epsilon,
                                                  **ln)
        self.mlp = ParallelMLP(config, tp_group, sequence_parallel=sequence_parallel,
                               device=device)
        self.hidden_dropout = config.hidden_dropout
        self.fused_bda = config.bias_dropout_fusion
        self.sequence_parallel = sequence_parallel
        self.tracker = tracker

    def _dropout_region(self):
        # Replicated activations (no sequence parallelism) must drop the same elements on every
        # tp rank: default stream. Sequence-parallel shards are distinct: model-parallel stream.
        if self.sequence_parallel and self.tracker is not None and self.training:
            return self.tracker.fork()
        return contextlib.nullcontext()

    def forward(self, x, attention_mask=None, kv_cache: KVCache | None = None):
        p, training = self.hidden_dropout, self.training
        attn_out, attn_bias = self.attention(self.input_layernorm(x), attention_mask,
                                             kv_cache=kv_cache)
        with self._dropout_region():
            x = bias_dropout_add(attn_out, attn_bias, x, p, training, self.fused_bda)
        mlp_out, mlp_bias = self.mlp(self.post_attention_layernorm(x))
        with self._dropout_region():
            x = bias_dropout_add(mlp_out, mlp_bias, x, p, training, self.fused_bda)
        return x  # [s, b, h] (or [s/tp, b, h])
