"""Scaled upper-triangular masked (causal) softmax for attention scores [b*np, sq, sk].

``scaled_upper_triang_masked_softmax(scores, scale)`` is ``softmax(scale * scores)`` over the
last dim with the causal mask (row i keeps columns 0..i, the rest get probability 0), as
Megatron's ``ScaledUpperTriangMaskedSoftmax``, for attention that does not go through
``scaled_dot_product_attention``. The kernels touch only the unmasked triangle: forward writes
probabilities (zeros above the diagonal) and saves them; backward computes
``dx = scale * y * (dy - sum(dy * y))`` on the triangle. CPU kernel for fp32/bf16, CUDA kernel
when built; elsewhere :func:`softmax_eager` (scale, masked_fill(-inf), softmax).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from megazero.ops import cuda_fused
from megazero.ops import fused_common as fc
from megazero.ops.registry import register_op

_MASKS: dict[tuple, torch.Tensor] = {}


def causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    """Bool [sq, sk], True above the diagonal (masked); cached per size and device."""
    key = (sq, sk, str(device))
    mask = _MASKS.get(key)
    if mask is None:
        if len(_MASKS) > 16:
            _MASKS.clear()
        mask = torch.ones(sq, sk, dtype=torch.bool, device=device).triu_(1)
        _MASKS[key] = mask
    return mask


def softmax_eager(scores: torch.Tensor, scale: float) -> torch.Tensor:
    """The eager composition: scale, masked_fill(-inf) above the diagonal, softmax."""
    sq, sk = scores.shape[-2:]
    masked = (scores * scale).masked_fill(causal_mask(sq, sk, scores.device), float("-inf"))
    return torch.softmax(masked, dim=-1)


def softmax_reference(scores: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference for tests: the eager composition in fp32, cast back to the input dtype."""
    return softmax_eager(scores.float(), scale).to(scores.dtype)


class _CausalSoftmaxCPU(torch.autograd.Function):
    """Forward: y = causal softmax(scale * x). Backward: dx = scale * y * (dy - sum dy*y)."""

    @staticmethod
    def forward(ctx, scores, scale, ext):
        scores = scores.contiguous()
        sq, sk = scores.shape[-2:]
        batches = scores.numel() // (sq * sk)  # scores as [batches, sq, sk]
        y = torch.empty_like(scores)
        ext.softmax_fwd(fc.ptr(scores), fc.ptr(y), batches, sq, sk, float(scale),
                        fc.dtype_code(scores.dtype), fc.num_threads())
        ctx.save_for_backward(y)
        ctx.dims, ctx.ext = (batches, sq, sk, float(scale)), ext
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        batches, sq, sk, scale = ctx.dims
        ext = ctx.ext
        dy = dy.contiguous()
        dx = torch.empty_like(y)
        ext.softmax_bwd(fc.ptr(dy), fc.ptr(y), fc.ptr(dx), batches, sq, sk, scale,
                        fc.dtype_code(y.dtype), fc.num_threads())
        return dx, None, None


def scaled_upper_triang_masked_softmax(scores: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax(scale * scores) for scores [..., sq, sk] with sq == sk."""
    if scores.dim() < 2 or scores.shape[-2] != scores.shape[-1]:
        raise ValueError(f"expected scores [..., sq, sk] with sq == sk, got {tuple(scores.shape)}")
    if scores.numel() == 0:
        return softmax_eager(scores, scale)
    if scores.is_cuda:
        if cuda_fused.softmax_available(scores):
            return cuda_fused.scaled_upper_triang_masked_softmax(scores, scale)
    elif fc.cpu_kernel_args_ok(scores) and (ext := fc.cpu_extension_for(scores)) is not None:
        return _CausalSoftmaxCPU.apply(scores, float(scale), ext)
    return softmax_eager(scores, scale)


register_op("causal_softmax", fc.CPU_EXTENSION,
            "scaled upper-triangular masked softmax fwd/bwd (CPU)", simd_level_fn=fc.simd_level)
