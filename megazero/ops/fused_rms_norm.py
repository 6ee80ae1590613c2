"""RMSNorm (Llama's normalization): a fused CPU kernel, its PyTorch reference, and the op the
model calls.

``rms_norm(x, weight, eps) = x / sqrt(mean(x^2, -1) + eps) * weight`` over the last dim of
``x`` [..., h] (weight [h]), computed in fp32 and cast back to x's dtype before the weight
multiplies (Megatron's and HF Llama's order).

Kernel (``megazero.ops._fused``, fp32 and bf16 with fp32 arithmetic inside): forward writes y
and keeps the per-row 1/rms (fp32); backward computes dx from it in two sweeps per row and
dweight summed over rows as per-thread fp32 partials. CUDA tensors take ATen's fused
RMSNorm as one megazero op each way (``cuda_rope_norm.rms_norm``; one kernel forward, two
backward), real or fake. Elsewhere (other dtypes, a weight of another dtype than x's (the
reference then promotes), extension missing, fewer than ``MIN_NUMEL`` elements, where eager is
as fast) :func:`rms_norm_reference` runs.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from megazero.ops import cuda_rope_norm
from megazero.ops import fused_common as fc
from megazero.ops.registry import register_op

MIN_NUMEL = 4096  # below this the eager formula is as fast (benchmarks/RESULTS.md)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The eager formula (fp32 inside); reference for tests and the unfused path."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y.to(x.dtype) * weight


class _FusedRMSNorm(torch.autograd.Function):
    """Forward: y = x * rstd * w. Backward: dx = rstd * (g - xhat * mean(g * xhat)) with
    g = dy * w and xhat = x * rstd; dw = sum dy * xhat."""

    @staticmethod
    def forward(ctx, x, weight, eps, ext):
        x = x.contiguous()
        rows, h = fc.rows_cols(x)  # x as [rows, h]
        y = torch.empty_like(x)
        rstd = torch.empty(rows, dtype=torch.float32)
        ext.rms_norm_fwd(fc.ptr(x), fc.ptr(weight), fc.ptr(y), fc.ptr(rstd), rows, h,
                         float(eps), fc.dtype_code(x.dtype), fc.num_threads())
        ctx.save_for_backward(x, weight, rstd)
        ctx.ext = ext
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dy = dy.contiguous()
        rows, h = fc.rows_cols(x)
        dx = torch.empty_like(x)
        dw = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        ctx.ext.rms_norm_bwd(fc.ptr(dy), fc.ptr(x), fc.ptr(rstd), fc.ptr(weight),
                             fc.ptr(dx), fc.address(dw), rows, h, fc.dtype_code(x.dtype),
                             fc.num_threads())
        return dx, dw, None, None


def _fusable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if x.dim() == 0 or x.numel() == 0 or not fc.worth_a_kernel(x.numel(), MIN_NUMEL):
        return False
    if not torch.is_tensor(weight) or not fc.cpu_kernel_args_ok(x, weight):
        return False
    return weight.dtype == x.dtype and weight.shape == x.shape[-1:]


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., h] with weight [h]; autograd-aware."""
    if x.is_cuda and cuda_rope_norm.takes_rms_norm(x, weight):
        return cuda_rope_norm.rms_norm(x, weight, eps)
    if _fusable(x, weight) and (ext := fc.cpu_extension_for(x, weight)) is not None:
        return _FusedRMSNorm.apply(x, weight.contiguous(), eps, ext)
    return rms_norm_reference(x, weight, eps)


register_op("rms_norm", fc.CPU_EXTENSION, "RMSNorm fwd/bwd, fp32 stats (CPU)",
            simd_level_fn=fc.simd_level)
