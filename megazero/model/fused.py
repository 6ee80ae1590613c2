"""Element-wise pieces of the transformer layer, fused when megazero's kernels allow.

Each function takes a ``fused`` flag (from ``--no-bias-gelu-fusion`` and friends). With it, the
compiled op from ``megazero.ops`` runs when built and its PyTorch reference otherwise; without
it, the plain eager composition runs. All are local (no communication). The norms
(``LayerNorm``, ``RMSNorm``, chosen by ``make_norm`` from ``--normalization``) are replicated
over tp.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megazero import ops
from megazero.tensor_parallel.meta import ParamMeta, init_ones, init_zeros, set_meta

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def gelu_tanh(y: torch.Tensor) -> torch.Tensor:
    """GPT-2's GELU (tanh approximation)."""
    return 0.5 * y * (1.0 + torch.tanh(_SQRT_2_OVER_PI * y * (1.0 + 0.044715 * y * y)))


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None, fused: bool) -> torch.Tensor:
    """gelu(x + bias): [s, b, f/tp] -> [s, b, f/tp]."""
    if fused and bias is not None:
        return ops.fused_bias_gelu(x, bias)
    if bias is not None:
        x = x + bias
    return F.gelu(x, approximate="tanh")


def bias_swiglu(x: torch.Tensor, bias: torch.Tensor | None, fused: bool) -> torch.Tensor:
    """swiglu(x + bias): [s, b, 2f/tp] -> [s, b, f/tp] (gate and up interleaved)."""
    if fused:
        return ops.fused_bias_swiglu(x, bias)
    return ops.swiglu_reference(x if bias is None else x + bias)


def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                     p: float, training: bool, fused: bool) -> torch.Tensor:
    """residual + dropout(x + bias): [s, b, h] (or [s/tp, b, h] with sequence parallelism)."""
    if fused:
        return ops.fused_bias_dropout_add(x, bias, residual, p, training)
    if bias is not None:
        x = x + bias
    return residual + F.dropout(x, p=p, training=training)


class LayerNorm(nn.Module):
    """LayerNorm over the last dim, replicated across tp (its params carry shard metadata).

    With sequence parallelism each tp rank normalises its own part of the sequence, so the
    gradients of ``weight`` and ``bias`` are partial: their ``ParamMeta`` says
    ``sequence_parallel``, and gradient finalisation all-reduces them over tp.
    """

    def __init__(self, hidden: int, eps: float = 1e-5, *, sequence_parallel: bool = False,
                 fused: bool = True, params_dtype=torch.float32, device=None):
        super().__init__()
        self.hidden, self.eps, self.fused = hidden, eps, fused
        self.weight = nn.Parameter(torch.ones(hidden, dtype=params_dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(hidden, dtype=params_dtype, device=device))
        for p, spec in ((self.weight, init_ones()), (self.bias, init_zeros())):
            set_meta(p, ParamMeta.replicated((hidden,), init=spec,
                                             sequence_parallel=sequence_parallel))

    def forward(self, x):
        if self.fused:
            return ops.fused_layer_norm(x, self.weight, self.bias, self.eps)
        return F.layer_norm(x, (self.hidden,), self.weight, self.bias, self.eps)

    def extra_repr(self):
        return f"{self.hidden}, eps={self.eps}"


class RMSNorm(nn.Module):
    """RMSNorm over the last dim (a weight, no bias), replicated across tp; with sequence
    parallelism its gradient is partial, as LayerNorm's."""

    def __init__(self, hidden: int, eps: float = 1e-5, *, sequence_parallel: bool = False,
                 fused: bool = True, params_dtype=torch.float32, device=None):
        super().__init__()
        self.hidden, self.eps, self.fused = hidden, eps, fused
        self.weight = nn.Parameter(torch.ones(hidden, dtype=params_dtype, device=device))
        set_meta(self.weight, ParamMeta.replicated((hidden,), init=init_ones(),
                                                   sequence_parallel=sequence_parallel))

    def forward(self, x):
        if self.fused:
            return ops.fused_rms_norm(x, self.weight, self.eps)
        return ops.rms_norm_reference(x, self.weight, self.eps)

    def extra_repr(self):
        return f"{self.hidden}, eps={self.eps}"


def make_norm(config, sequence_parallel: bool, device=None) -> nn.Module:
    """The configured norm (``--normalization``) over ``hidden_size``."""
    cls = RMSNorm if config.normalization == "RMSNorm" else LayerNorm
    return cls(config.hidden_size, config.layernorm_epsilon, sequence_parallel=sequence_parallel,
               fused=config.fused_layernorm, params_dtype=config.torch_dtype, device=device)
