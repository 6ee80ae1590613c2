"""Fused LayerNorm over the last dim: CPU kernels (and CUDA kernels when built).

``fused_layer_norm(x, weight, bias, eps)`` normalises each row of x [..., h] with fp32
statistics: forward writes y and keeps the per-row mean and 1/std (fp32); backward computes
dx, dweight and dbias from them in one sweep per row (dweight/dbias as per-thread fp32
partials). x may be fp32 or bf16 and weight/bias fp32 or x's dtype independently (Megatron's
MixedFusedLayerNorm); y and dx take x's dtype, dweight/dbias the parameters'. Elsewhere, on a
GPU (ATen's LayerNorm: one kernel forward, two backward; megazero's CUDA LayerNorm measured
0.54-0.64x its speed on an H200 and was retired) and below ``MIN_NUMEL`` elements (where
ATen's own fused LayerNorm is as fast or faster), it runs ``F.layer_norm`` (parameters cast to
x's dtype). :class:`FusedLayerNorm` is the module.
"""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from megazero.ops import fused_common as fc
from megazero.ops.registry import register_op

MIN_NUMEL = 262144  # below this F.layer_norm is as fast or faster (benchmarks/RESULTS.md)


def layer_norm_reference(x, weight, bias, eps: float = 1e-5) -> torch.Tensor:
    """Eager LayerNorm over the last dim (fp32 statistics), output in x's dtype."""
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).pow(2).mean(-1, keepdim=True)
    y = (xf - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


class _FusedLayerNormCPU(torch.autograd.Function):
    """Forward: y = (x - mean) * rstd * w + b. Backward: dx, dw = sum dy*xhat, db = sum dy."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, ext):
        x = x.contiguous()
        rows, h = fc.rows_cols(x)  # x as [rows, h]
        y = torch.empty_like(x)
        mean, rstd = torch.empty(2, rows, dtype=torch.float32)  # [rows] each
        wdt = fc.dtype_code(weight.dtype if weight is not None else x.dtype)
        ext.layer_norm_fwd(fc.ptr(x), fc.address(weight), fc.address(bias), fc.ptr(y),
                           fc.ptr(mean), fc.ptr(rstd), rows, h, float(eps),
                           fc.dtype_code(x.dtype), wdt, fc.num_threads())
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.has_bias, ctx.ext = bias is not None, ext
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        ext = ctx.ext
        dy = dy.contiguous()
        rows, h = fc.rows_cols(x)
        dx = torch.empty_like(x)
        dw = db = None
        if weight is not None:
            dw, db = torch.empty_like(weight), torch.empty_like(weight)
        wdt = fc.dtype_code(weight.dtype if weight is not None else x.dtype)
        ext.layer_norm_bwd(fc.ptr(dy), fc.ptr(x), fc.ptr(mean), fc.ptr(rstd),
                           fc.address(weight), fc.ptr(dx), fc.address(dw), fc.address(db),
                           rows, h, fc.dtype_code(x.dtype), wdt, fc.num_threads())
        return dx, dw, db if ctx.has_bias else None, None, None


def _fusable_cpu(x, weight, bias) -> bool:
    if x.dim() == 0 or x.numel() == 0 or not fc.worth_a_kernel(x.numel(), MIN_NUMEL):
        return False
    if not fc.cpu_kernel_args_ok(x, weight, bias):
        return False
    h = x.shape[-1]
    if weight is None and bias is not None:
        return False  # kernels take bias only together with a weight
    for p in (weight, bias):
        if p is not None and p.shape != (h,):
            return False
    return weight is None or bias is None or weight.dtype == bias.dtype


def fused_layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                     eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm of x [..., h] over h with weight/bias [h] (or None); autograd-aware."""
    if not x.is_cuda and _fusable_cpu(x, weight, bias) and \
            (ext := fc.cpu_extension_for(x, weight, bias)) is not None:
        return _FusedLayerNormCPU.apply(
            x, None if weight is None else weight.contiguous(),
            None if bias is None else bias.contiguous(), eps, ext)
    cast = lambda p: None if p is None else p.to(x.dtype)
    return F.layer_norm(x, x.shape[-1:], cast(weight), cast(bias), eps)


class FusedLayerNorm(torch.nn.Module):
    """LayerNorm over the last dim with parameters ``weight`` (ones) and ``bias`` (zeros)."""

    def __init__(self, hidden_size, eps: float = 1e-5, dtype: torch.dtype | None = None,
                 device=None):
        super().__init__()
        if not isinstance(hidden_size, numbers.Integral):
            (hidden_size,) = tuple(hidden_size)  # one normalised dim only
        self.hidden_size = int(hidden_size)
        self.normalized_shape = (self.hidden_size,)  # as nn.LayerNorm
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(self.hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(self.hidden_size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., h] -> [..., h]
        return fused_layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


register_op("layer_norm", fc.CPU_EXTENSION, "LayerNorm fwd/bwd, fp32 stats (CPU)",
            simd_level_fn=fc.simd_level)
