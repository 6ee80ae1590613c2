"""Bias + SwiGLU (Llama's MLP activation): a fused CPU kernel, its PyTorch reference, and the op
the model calls.

``bias_swiglu(y, bias) = silu(g) * u`` where ``g``, ``u`` are the even and odd entries of the
last dim of ``y + bias`` (y [..., 2f], bias [2f] or None; output [..., f]). megazero's fc1
rows are ordered ``[f, (gate, up)]`` so that a contiguous tensor-parallel shard holds whole
(gate, up) pairs.

Kernel (``megazero.ops._fused``, fp32 and bf16 with fp32 arithmetic inside): forward reads each
row of pairs once (split into gates and ups in registers) and writes the output; only ``y``
and ``bias`` are saved. Backward recomputes the sigmoid, writes the gradient of ``y``
interleaved as ``y`` is, and sums ``dbias`` over rows (per-thread fp32 partials). CUDA tensors
take megazero's CUDA op (``cuda_elementwise.bias_swiglu``) where the CUDA kernels are built or
the tensors are fake (the dry run). Elsewhere (CUDA without the kernels, other dtypes,
extension missing, fewer than ``MIN_NUMEL`` elements of ``y``, where eager is as fast)
:func:`swiglu_reference` of ``y + bias`` runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from megazero.ops import cuda_elementwise
from megazero.ops import fused_common as fc
from megazero.ops.registry import register_op

MIN_NUMEL = 8192  # elements of y; below this eager is as fast (benchmarks/RESULTS.md)


def swiglu_reference(y: torch.Tensor) -> torch.Tensor:
    """silu(y[..., 0::2]) * y[..., 1::2]: [..., 2f] -> [..., f]."""
    pairs = y.unflatten(-1, (-1, 2))  # [..., f, 2]
    return F.silu(pairs[..., 0]) * pairs[..., 1]


class _FusedBiasSwiGLU(torch.autograd.Function):
    """Forward: out = silu(g) * u. Backward: dg = dout * u * silu'(g), du = dout * silu(g),
    dbias = sum over rows of (dg, du) interleaved."""

    @staticmethod
    def forward(ctx, y, bias, ext):
        y = y.contiguous()
        rows, two_f = fc.rows_cols(y)  # y as [rows, 2f]
        out = y.new_empty(y.shape[:-1] + (two_f // 2,))
        ext.swiglu_fwd(fc.ptr(y), fc.address(bias), fc.ptr(out), rows, two_f // 2,
                       fc.dtype_code(y.dtype), fc.num_threads())
        ctx.save_for_backward(y, bias)
        ctx.ext = ext
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        y, bias = ctx.saved_tensors
        dout = dout.contiguous()
        rows, two_f = fc.rows_cols(y)
        dy = torch.empty_like(y)
        dbias = torch.empty_like(bias) if bias is not None and ctx.needs_input_grad[1] else None
        ctx.ext.swiglu_bwd(fc.ptr(dout), fc.ptr(y), fc.address(bias), fc.ptr(dy),
                           fc.address(dbias), rows, two_f // 2, fc.dtype_code(y.dtype),
                           fc.num_threads())
        return dy, dbias, None


def _fusable(y: torch.Tensor, bias: torch.Tensor | None) -> bool:
    if y.dim() == 0 or y.numel() == 0 or y.shape[-1] % 2:
        return False
    if not fc.worth_a_kernel(y.numel(), MIN_NUMEL) or not fc.cpu_kernel_args_ok(y, bias):
        return False
    return bias is None or (bias.dtype == y.dtype and bias.shape == y.shape[-1:])


def fused_bias_swiglu(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """swiglu(y + bias) for y [..., 2f] (gate and up interleaved); autograd-aware."""
    if y.is_cuda and cuda_elementwise.takes_bias_swiglu(y, bias):
        return cuda_elementwise.bias_swiglu(y, bias)
    if _fusable(y, bias) and (ext := fc.cpu_extension_for(y, bias)) is not None:
        return _FusedBiasSwiGLU.apply(y, None if bias is None else bias.contiguous(), ext)
    return swiglu_reference(y if bias is None else y + bias)


register_op("bias_swiglu", fc.CPU_EXTENSION, "bias + SwiGLU (interleaved gate/up), fwd/bwd (CPU)",
            simd_level_fn=fc.simd_level)
