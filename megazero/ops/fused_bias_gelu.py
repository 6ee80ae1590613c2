"""Fused bias + GELU (GPT-2's tanh approximation), CPU kernel with a PyTorch fallback.

``fused_bias_gelu(x, bias) = gelu(x + bias)`` with
``gelu(y) = 0.5*y*(1 + tanh(0.79788456*y*(1 + 0.044715*y*y)))``, as Megatron's ``bias_gelu``.

Forward: one pass over ``x`` [..., h] (bias [h]) writes the output; only ``x`` and ``bias`` are
saved. Backward: one pass recomputes GELU's derivative from ``x + bias``, writes ``dx`` and sums
``dbias`` over rows (per-thread fp32 partials). fp32 and bf16 (fp32 arithmetic inside).
CUDA tensors take megazero's CUDA op (``cuda_elementwise.bias_gelu``: one kernel forward; the
backward one kernel, plus the bias gradient's column sum) where the CUDA kernels are built or the
tensors are fake (the dry run). Elsewhere (CUDA without the kernels, other dtypes, extension
missing, fewer than ``MIN_NUMEL`` elements, where eager is faster) it runs
``F.gelu(x + bias, approximate="tanh")``, the same function in eager PyTorch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from megazero.ops import cuda_elementwise
from megazero.ops import fused_common as fc
from megazero.ops.registry import register_op

MIN_NUMEL = 8192  # below this eager PyTorch is faster (benchmarks/RESULTS.md)


def bias_gelu_reference(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The eager formula, op by op (what the fused kernel replaces); reference for tests."""
    y = x if bias is None else x + bias
    return y * 0.5 * (1.0 + torch.tanh(0.79788456 * y * (1 + 0.044715 * y * y)))


class _FusedBiasGelu(torch.autograd.Function):
    """Forward: y = gelu(x + bias). Backward: dx = dy * gelu'(x + bias), dbias = sum dx."""

    @staticmethod
    def forward(ctx, x, bias, ext):
        x = x.contiguous()
        rows, cols = fc.rows_cols(x)  # x as [rows, h]
        y = torch.empty_like(x)
        ext.bias_gelu_fwd(fc.ptr(x), fc.address(bias), fc.ptr(y), rows, cols,
                          fc.dtype_code(x.dtype), fc.num_threads())
        ctx.save_for_backward(x, bias)
        ctx.ext = ext
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, bias = ctx.saved_tensors
        ext = ctx.ext
        dy = dy.contiguous()
        rows, cols = fc.rows_cols(x)
        dx = torch.empty_like(x)
        dbias = None if bias is None else torch.empty_like(bias)
        ext.bias_gelu_bwd(fc.ptr(dy), fc.ptr(x), fc.address(bias), fc.ptr(dx),
                          fc.address(dbias), rows, cols, fc.dtype_code(x.dtype),
                          fc.num_threads())
        return dx, dbias, None


def _fusable(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    if x.dim() == 0 or not fc.worth_a_kernel(x.numel(), MIN_NUMEL):
        return False
    if not fc.cpu_kernel_args_ok(x, bias):
        return False
    return bias is None or (bias.dtype == x.dtype and bias.shape == x.shape[-1:])


def fused_bias_gelu(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """gelu_tanh(x + bias) for x [..., h] and bias [h] (or None); autograd-aware."""
    if x.is_cuda and cuda_elementwise.takes_bias_gelu(x, bias):
        return cuda_elementwise.bias_gelu(x, bias)
    ext = fc.cpu_extension_for(x, bias) if _fusable(x, bias) else None
    if ext is not None:
        return _FusedBiasGelu.apply(x, None if bias is None else bias.contiguous(), ext)
    return F.gelu(x if bias is None else x + bias, approximate="tanh")


register_op("bias_gelu", fc.CPU_EXTENSION, "bias + tanh GELU, fwd/bwd (CPU)",
            simd_level_fn=fc.simd_level)
