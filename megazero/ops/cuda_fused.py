"""CUDA faces of the LayerNorm and causal-softmax kernels (``megazero.ops._fused_cuda``).

Built from ``csrc/fused/*.cu`` + ``fused_cuda.cc`` by setup.py only when the build
environment has a CUDA torch and a GPU (or ``TORCH_CUDA_ARCH_LIST``). ``fused_layer_norm``
and ``scaled_upper_triang_masked_softmax`` route CUDA tensors here when
:func:`layer_norm_available` / :func:`softmax_available` say so, else to eager PyTorch.
x may be fp32, bf16 or fp16; LayerNorm weight/bias fp32 or x's dtype; statistics in fp32.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from megazero.ops import fused_common as fc
from megazero.ops.registry import register_op

_CUDA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _ok(*tensors) -> bool:
    return all(t is None or (t.is_cuda and t.dtype in _CUDA_DTYPES) for t in tensors)


def layer_norm_available(x, weight, bias) -> bool:
    """True when the CUDA LayerNorm kernel can take these tensors."""
    if x.dim() == 0 or x.numel() == 0 or not _ok(x, weight, bias):
        return False
    if weight is None and bias is not None:
        return False
    if any(p is not None and p.shape != x.shape[-1:] for p in (weight, bias)):
        return False
    if weight is not None and bias is not None and weight.dtype != bias.dtype:
        return False
    return fc.cuda_extension() is not None


class _LayerNormCUDA(torch.autograd.Function):
    """Forward: y = (x - mean) * rstd * w + b (mean, rstd fp32 saved). Backward: dx, dw, db."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        x = x.contiguous()  # [rows, h] as far as the kernel is concerned
        y, mean, rstd = fc.cuda_extension().layer_norm_fwd(x, weight, bias, float(eps))
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = fc.cuda_extension().layer_norm_bwd(dy.contiguous(), x, mean, rstd, weight)
        if weight is None:
            dw = db = None
        return dx, dw, db if ctx.has_bias else None, None


def layer_norm(x, weight, bias, eps: float = 1e-5) -> torch.Tensor:
    """CUDA LayerNorm over the last dim (call after :func:`layer_norm_available`)."""
    contig = lambda p: None if p is None else p.contiguous()
    return _LayerNormCUDA.apply(x, contig(weight), contig(bias), eps)


def softmax_available(scores) -> bool:
    """True when the CUDA causal-softmax kernel can take ``scores`` [..., sq, sq]."""
    return scores.numel() > 0 and _ok(scores) and fc.cuda_extension() is not None


class _CausalSoftmaxCUDA(torch.autograd.Function):
    """Forward: y = causal softmax(scale * x). Backward: dx = scale * y * (dy - sum dy*y)."""

    @staticmethod
    def forward(ctx, scores, scale):
        y = fc.cuda_extension().softmax_fwd(scores.contiguous(), float(scale))
        ctx.save_for_backward(y)
        ctx.scale = float(scale)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return fc.cuda_extension().softmax_bwd(dy.contiguous(), y, ctx.scale), None


def scaled_upper_triang_masked_softmax(scores, scale: float) -> torch.Tensor:
    """CUDA causal softmax (call after :func:`softmax_available`)."""
    return _CausalSoftmaxCUDA.apply(scores, float(scale))


register_op("cuda_layer_norm", fc.CUDA_EXTENSION, "LayerNorm fwd/bwd (CUDA)",
            simd_level_fn=lambda: "cuda")
register_op("cuda_causal_softmax", fc.CUDA_EXTENSION,
            "scaled upper-triangular masked softmax fwd/bwd (CUDA)", simd_level_fn=lambda: "cuda")
