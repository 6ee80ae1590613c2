"""Transformer layer (GPT-2 or the Llama family) built from tensor-parallel layers, sharded
over the tp group.

Per layer (pre-normalization, as GPT-2 and Llama)::

    x -> norm -> qkv (column-parallel, heads split over tp) -> [RoPE on q, k] -> causal
      attention on this rank's heads -> proj (row-parallel, all-reduce or reduce-scatter)
      -> +bias, dropout, +x
      -> norm -> fc1 (column-parallel) -> bias+GELU or SwiGLU -> fc2 (row-parallel)
      -> +bias, dropout, +x

The norm is LayerNorm or RMSNorm (``--normalization``); grouped-query attention
(``--num-query-groups``) shares each key/value head among the query heads of its group; with
``--disable-bias-linear`` the linear layers have no bias.

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
from torch.nn.attention import SDPBackend, sdpa_kernel

from megazero.config import ModelConfig
from megazero.distributed import comm
from megazero.distributed.device import is_fake
from megazero.model.fused import bias_dropout_add, bias_gelu, bias_swiglu, make_norm
from megazero.model.kv_cache import KVCache
from megazero.model.rotary import apply_rotary
from megazero.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    checkpoint,
    init_normal,
)
from megazero.tensor_parallel.random import RNGStatesTracker


def output_init_std(config: ModelConfig) -> float:
    """GPT-2/Megatron scaled init for the layers that write into the residual stream."""
    return config.init_method_std / math.sqrt(2.0 * config.num_layers)


class ParallelAttention(nn.Module):
    """Causal self-attention; this rank computes ``heads / tp`` query heads and
    ``kv_heads / tp`` key/value heads (equal without grouped-query attention)."""

    def __init__(self, config: ModelConfig, tp_group, tracker: RNGStatesTracker | None, *,
                 sequence_parallel: bool, device=None):
        super().__init__()
        tp = comm.group_size(tp_group)
        self.heads_per_rank = config.num_attention_heads // tp
        self.groups_per_rank = config.kv_heads // tp
        self.q_per_group = config.num_attention_heads // config.kv_heads
        self.head_dim = config.head_dim
        self.dropout_p = config.attention_dropout
        self.tracker = tracker
        dtype = config.torch_dtype
        # qkv weight rows are ordered [group, (q_1 .. q_{heads/groups}, k, v), head_dim]
        # (Megatron's layout; [head, (q, k, v), head_dim] without GQA), so a contiguous shard
        # of rows holds whole key/value groups with their query heads.
        qkv_size = (config.num_attention_heads + 2 * config.kv_heads) * config.head_dim
        self.qkv = ColumnParallelLinear(
            config.hidden_size, qkv_size, tp_group=tp_group, gather_output=False,
            bias=config.add_bias_linear, sequence_parallel=sequence_parallel,
            init_method=init_normal(config.init_method_std), params_dtype=dtype, device=device)
        self.proj = RowParallelLinear(
            config.hidden_size, config.hidden_size, tp_group=tp_group, input_is_parallel=True,
            bias=config.add_bias_linear, skip_bias_add=True, sequence_parallel=sequence_parallel,
            init_method=init_normal(output_init_std(config)), params_dtype=dtype, device=device)
        self.fused_rope = config.apply_rope_fusion
        self.backend = config.attention_backend
        self.softmax_in_fp32 = config.attention_softmax_in_fp32
        self.selective_recompute = config.recompute_granularity == "selective"

    def _split(self, mixed, rotary):
        """q ``[b, np, s, hn]``, k and v ``[b, ng, s, hn]`` (np, ng: this rank's query and
        key/value heads) from the qkv output ``[s, b, (np + 2 ng) hn]``."""
        s, b = mixed.shape[0], mixed.shape[1]
        g = self.q_per_group
        mixed = mixed.view(s, b, self.groups_per_rank, g + 2, self.head_dim)
        if g == 1:  # one query head per group (no GQA): views, as GPT-2 always did
            q, k, v = mixed.unbind(dim=3)  # [s, b, np, hn]
        else:
            q = mixed[:, :, :, :g].reshape(s, b, self.heads_per_rank, self.head_dim)
            k, v = mixed[:, :, :, g], mixed[:, :, :, g + 1]  # [s, b, ng, hn]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, hn]
        if rotary is not None:
            q = apply_rotary(q, *rotary, fused=self.fused_rope)
            k = apply_rotary(k, *rotary, fused=self.fused_rope)
        return q, k, v

    def _expand(self, t):
        """Key/value heads ``[b, ng, L, hn]`` repeated for their query heads: ``[b, np, L, hn]``
        (query head i reads group i // (np / ng), as Megatron's grouping)."""
        if self.q_per_group == 1:
            return t
        return t.repeat_interleave(self.q_per_group, dim=1)

    def _core(self, q, k, v, keep=None, dropout_p: float = 0.0):
        """Attention of q ``[b, np, s, hn]`` over k, v ``[b, np, L, hn]``: causal when ``keep``
        is None, else where ``keep`` (bool ``[.., s, L]``, True = attend) allows; by the
        configured backend (``--attention-backend``)."""
        if self.backend in ("unfused", "local"):
            dtype = q.dtype
            if self.softmax_in_fp32:
                q, k, v = q.float(), k.float(), v.float()
            scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # [b, np, s, L]
            if keep is None:
                s, L = scores.shape[-2], scores.shape[-1]
                keep = torch.ones(s, L, dtype=torch.bool, device=q.device).tril(L - s)
            probs = scores.masked_fill(~keep, float("-inf")).softmax(dim=-1)
            probs = F.dropout(probs, dropout_p, training=dropout_p > 0)
            return (probs @ v).to(dtype)  # [b, np, s, hn]
        if q.device.type == "cuda" and is_fake(q):
            return _gpu_kernel_on_fake(q, k, v, keep, dropout_p, self.backend)
        kernel = _sdpa_kernels(self.backend, q.device.type)
        with sdpa_kernel(kernel) if kernel else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p,
                                                  is_causal=keep is None)

    def forward(self, x, attention_mask=None, kv_cache: KVCache | None = None, rotary=None):
        mixed, _ = self.qkv(x)  # [s, b, (np + 2 ng) * hn]
        s, b = mixed.shape[0], mixed.shape[1]
        q, k, v = self._split(mixed, rotary)
        if kv_cache is not None and kv_cache.offset > 0:
            if attention_mask is not None:
                raise ValueError("a KV cache is for causal decoding without attention masks")
            past = kv_cache.offset
            k, v = kv_cache.extend(self, k, v)  # [b, ng, past + s, hn]
            # new position i (absolute past + i) sees keys 0..past + i
            keep = torch.ones(s, past + s, dtype=torch.bool, device=q.device).tril(past)
            ctx = self._core(q, self._expand(k), self._expand(v), keep)  # [b, np, s, hn]
            ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, self.heads_per_rank * self.head_dim)
            return self.proj(ctx)
        if kv_cache is not None:
            kv_cache.extend(self, k, v)  # the prompt: plain causal attention below
        k, v = self._expand(k), self._expand(v)
        p = self.dropout_p if self.training else 0.0
        # attention_mask: [b, 1, s, s], True = masked out (Megatron convention)
        keep = None if attention_mask is None else ~attention_mask
        if self.selective_recompute and self.training and torch.is_grad_enabled():
            ctx = self._recomputed_core(q, k, v, keep, p)
        else:
            ctx = self._dropout_core(q, k, v, keep, p)
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, self.heads_per_rank * self.head_dim)
        return self.proj(ctx)  # ([s, b, h] or [s/tp, b, h], bias)

    def _recomputed_core(self, q, k, v, keep, p):
        """Megatron's selective recompute: keep q, k, v; recompute scores, softmax, dropout
        (same random draws: the tracker's states are replayed) in backward."""
        return checkpoint(lambda q_, k_, v_: self._dropout_core(q_, k_, v_, keep, p),
                          q, k, v, tracker=self.tracker)

    def _dropout_core(self, q, k, v, keep, p):
        """The attention core with dropout drawn from the model-parallel stream (different
        heads on each tp rank)."""
        fork = self.tracker.fork() if (self.tracker is not None and p > 0) \
            else contextlib.nullcontext()
        with fork:
            return self._core(q, k, v, keep, p)


def _gpu_kernel_on_fake(q, k, v, keep, dropout_p: float, backend: str):
    """The dry run on fake CUDA: the kernel ``scaled_dot_product_attention`` takes on a GPU
    (sm_80+), called directly. A CPU build of torch has no CUDA kernels to choose from and
    takes the math path, which keeps the ``[b, np, s, L]`` scores and probabilities a GPU
    kernel never holds and launches a dozen ops. Flash attention for fp16/bf16 causal
    attention without a mask and head dims of at most 256 that are multiples of 8 (``auto``
    and ``flash``); otherwise the memory-efficient kernel (a boolean mask becomes its additive
    bias, as torch converts it)."""
    hn = q.shape[-1]
    flash_ok = (q.dtype in (torch.float16, torch.bfloat16) and keep is None and hn % 8 == 0
                and hn <= 256)
    if backend in ("auto", "flash") and flash_ok:
        # [b, np, s, hn] (and the log-sum-exp, RNG state for backward)
        return torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, dropout_p, True)[0]
    bias = None
    if keep is not None:
        bias = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(
            ~keep, float("-inf"))  # [.., s, L]
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, q.requires_grad or k.requires_grad, dropout_p, keep is None)[0]


def _sdpa_kernels(backend: str, device_type: str):
    """scaled_dot_product_attention's allowed kernels for ``--attention-backend`` (None:
    torch chooses). "fused" is cuDNN's or the memory-efficient kernel on a GPU; the CPU's only
    fused kernel is its flash attention."""
    if backend == "flash":
        return [SDPBackend.FLASH_ATTENTION]
    if backend == "fused":
        return [SDPBackend.FLASH_ATTENTION] if device_type == "cpu" else \
            [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    return None


class ParallelMLP(nn.Module):
    """h -> ffn/tp (column-parallel) -> bias+GELU -> h (row-parallel); with SwiGLU, fc1 makes
    2 ffn/tp (gate and up, rows interleaved ``[ffn, (gate, up)]`` so that a contiguous shard
    holds whole pairs) and silu(gate) * up goes to fc2."""

    def __init__(self, config: ModelConfig, tp_group, *, sequence_parallel: bool, device=None):
        super().__init__()
        dtype = config.torch_dtype
        self.swiglu = config.swiglu
        self.fused_bias_gelu = config.bias_gelu_fusion
        self.fused_swiglu = config.bias_swiglu_fusion
        fc1_out = 2 * config.ffn_hidden_size if config.swiglu else config.ffn_hidden_size
        self.fc1 = ColumnParallelLinear(
            config.hidden_size, fc1_out, tp_group=tp_group, gather_output=False,
            bias=config.add_bias_linear, skip_bias_add=True, sequence_parallel=sequence_parallel,
            init_method=init_normal(config.init_method_std), params_dtype=dtype, device=device)
        self.fc2 = RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, tp_group=tp_group,
            bias=config.add_bias_linear, input_is_parallel=True, skip_bias_add=True,
            sequence_parallel=sequence_parallel,
            init_method=init_normal(output_init_std(config)), params_dtype=dtype, device=device)

    def forward(self, x):
        h, bias = self.fc1(x)  # [s, b, ffn/tp] (SwiGLU: [s, b, 2 ffn/tp])
        if self.swiglu:
            h = bias_swiglu(h, bias, self.fused_swiglu)  # [s, b, ffn/tp]
        else:
            h = bias_gelu(h, bias, self.fused_bias_gelu)
        return self.fc2(h)  # ([s, b, h], bias)


class TransformerLayer(nn.Module):
    """One pre-normalization block (GPT-2 or Llama-style)."""

    def __init__(self, config: ModelConfig, tp_group, tracker: RNGStatesTracker | None, *,
                 sequence_parallel: bool = False, device=None):
        super().__init__()
        self.input_layernorm = make_norm(config, sequence_parallel, device)
        self.attention = ParallelAttention(config, tp_group, tracker,
                                           sequence_parallel=sequence_parallel, device=device)
        self.post_attention_layernorm = make_norm(config, sequence_parallel, device)
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

    def forward(self, x, attention_mask=None, kv_cache: KVCache | None = None, rotary=None):
        """``rotary``: RoPE's (cos, sin) ``[b, 1, s, rot]`` (None without RoPE)."""
        attn_out, attn_bias = self.attention(self.input_layernorm(x), attention_mask,
                                             kv_cache=kv_cache, rotary=rotary)
        x = self._residual_dropout(attn_out, attn_bias, x)
        mlp_out, mlp_bias = self.mlp(self.post_attention_layernorm(x))
        x = self._residual_dropout(mlp_out, mlp_bias, x)
        return x  # [s, b, h] (or [s/tp, b, h])

    def _residual_dropout(self, out, bias, residual):
        """residual + dropout(out + bias), drawn from the stream ``_dropout_region`` picks."""
        with self._dropout_region():
            return bias_dropout_add(out, bias, residual, self.hidden_dropout, self.training,
                                    self.fused_bda)
