"""Fused bias + dropout + residual add with counter-based, recomputable dropout masks.

``fused_bias_dropout_add(x, bias, residual, p, training) = residual + dropout(x + bias, p)``.

Masks: each call draws one 62-bit seed from torch's current default CPU generator
(``torch.randint``), so inside ``RNGStatesTracker.fork()`` it comes from the tracker's stream
and checkpointed/restored RNG states reproduce it (activation recompute, resumed runs). Element
``i`` (flat index into the contiguous ``x``) is kept when a hash of (seed, i) is at least
``p * 2**32`` (:func:`dropout_keep_mask`, the same function as the C++ kernel's). The mask is a
pure function of (seed, i): backward regenerates it instead of storing it, so the op keeps no
mask tensor (eager dropout keeps a full-size one).

Forward is one pass over x, bias, residual; backward one pass writing ``dx`` and summing
``dbias``; ``dresidual`` is ``dy`` itself. With ``training=False`` or ``p == 0`` the result is
``residual + (x + bias)`` (exact in fp32; bf16 rounds once instead of twice). CPU fp32/bf16 use
the kernel; other CPU cases run :func:`bias_dropout_add_reference` (same masks). CUDA tensors
take megazero's CUDA op (``cuda_elementwise.bias_dropout_add``: the same hash, so the same mask
for the same seed; the seed is drawn from the CUDA generator's host-side state, which the
tracker forks) where the CUDA kernels are built or the tensors are fake (the dry run), else
eager PyTorch with ``F.dropout`` (masks from the CUDA generator).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.autograd.function import once_differentiable

from megazero.ops import cuda_elementwise
from megazero.ops import fused_common as fc
from megazero.ops.registry import register_op

_MASK32 = 0xFFFFFFFF
_MIX_MUL1 = 0x7FEB352D  # csrc/fused/fused_common.h: kMixMul1
_MIX_MUL2 = 0x846CA68B


def draw_seed() -> int:
    """A dropout seed from torch's current default CPU generator (advances it); drawn on a
    real tensor also inside the dry run's fake-tensor mode."""
    with unset_fake_temporarily():
        return int(torch.randint(0, 2**62, (1,)).item())


def dropout_params(p: float) -> tuple[int, float]:
    """(threshold, scale): element dropped when hash < threshold; kept ones scaled."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    if p >= 1.0:
        return 0, 0.0  # keep every hash, scale by 0: everything dropped
    return min(int(round(p * 2**32)), _MASK32), 1.0 / (1.0 - p)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32), without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _MIX_MUL1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MIX_MUL2)
    return x ^ (x >> 16)


def dropout_hash(seed: int, numel: int, device=None, offset: int = 0) -> torch.Tensor:
    """32-bit hash of (seed, i) for i in [offset, offset + numel), as int64 [numel]."""
    idx = torch.arange(offset, offset + numel, dtype=torch.int64, device=device)
    lo, hi = idx & _MASK32, idx >> 32
    key = _mix32(_mix32(hi ^ (seed >> 32)) ^ (seed & _MASK32))
    return _mix32(_mix32(lo ^ key))


def dropout_keep_mask(seed: int, shape, p: float, device=None) -> torch.Tensor:
    """Bool mask of kept elements for a contiguous tensor of ``shape`` (the kernel's mask)."""
    numel = 1
    for s in shape:
        numel *= s
    threshold, _ = dropout_params(p)
    return (dropout_hash(seed, numel, device) >= threshold).view(shape)


def bias_dropout_add_reference(x, bias, residual, p: float, training: bool,
                               seed: int | None = None) -> torch.Tensor:
    """Eager PyTorch with the kernel's masks: residual + mask * scale * (x + bias)."""
    y = x if bias is None else x + bias
    if not training or p == 0.0:
        return residual + y
    if seed is None:
        seed = draw_seed()
    threshold, scale = dropout_params(p)
    keep = dropout_hash(seed, y.numel(), y.device).view(y.shape) >= threshold
    return residual + y * (keep.to(y.dtype) * scale)


class _FusedBiasDropoutAdd(torch.autograd.Function):
    """Forward: residual + mask(seed) * scale * (x + bias). Backward: dx = dy * mask * scale
    (mask regenerated from the seed), dbias = sum over rows of dx, dresidual = dy."""

    @staticmethod
    def forward(ctx, x, bias, residual, p, training, ext):
        x, residual = x.contiguous(), residual.contiguous()
        rows, cols = fc.rows_cols(x)  # x, residual as [rows, h]
        enabled = bool(training) and p > 0.0
        seed = draw_seed() if enabled else 0
        threshold, scale = dropout_params(p) if enabled else (0, 1.0)
        out = torch.empty_like(x)
        ext.bias_dropout_add_fwd(fc.ptr(x), fc.address(bias), fc.ptr(residual),
                                 fc.ptr(out), rows, cols, seed, threshold, scale, enabled,
                                 fc.dtype_code(x.dtype), fc.num_threads())
        ctx.args = (rows, cols, seed, threshold, scale, enabled, bias is not None)
        ctx.ext = ext
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        rows, cols, seed, threshold, scale, enabled, has_bias = ctx.args
        dy = dy.contiguous()
        if not enabled:
            dbias = dy.reshape(rows, cols).sum(0) if has_bias else None
            return dy, dbias, dy, None, None, None
        ext = ctx.ext
        dx = torch.empty_like(dy)
        dbias = dy.new_empty(cols) if has_bias else None
        ext.bias_dropout_add_bwd(fc.ptr(dy), fc.ptr(dx), fc.address(dbias), rows, cols,
                                 seed, threshold, scale, True, fc.dtype_code(dy.dtype),
                                 fc.num_threads())
        return dx, dbias, dy, None, None, None


def _fusable(x, bias, residual) -> bool:
    if x.dim() == 0 or not fc.cpu_kernel_args_ok(x, bias, residual):
        return False
    if residual.shape != x.shape or residual.dtype != x.dtype:
        return False
    return bias is None or (bias.dtype == x.dtype and bias.shape == x.shape[-1:])


def fused_bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                           p: float, training: bool) -> torch.Tensor:
    """residual + dropout(x + bias, p) for x, residual [s, b, h] and bias [h] (or None)."""
    if x.is_cuda:
        if cuda_elementwise.takes_bias_dropout_add(x, bias, residual):
            enabled = bool(training) and p > 0.0
            threshold, scale = dropout_params(p) if enabled else (0, 1.0)
            return cuda_elementwise.bias_dropout_add(x, bias, residual, threshold, scale, enabled)
        y = x if bias is None else x + bias
        return residual + F.dropout(y, p=p, training=training)
    ext = fc.cpu_extension_for(x, bias, residual) if _fusable(x, bias, residual) \
        else None
    if ext is not None:  # at any size: small tensors too keep the kernel's masks
        return _FusedBiasDropoutAdd.apply(x, None if bias is None else bias.contiguous(),
                                          residual, float(p), bool(training), ext)
    return bias_dropout_add_reference(x, bias, residual, float(p), bool(training))


register_op("bias_dropout_add", fc.CPU_EXTENSION,
            "bias + dropout + residual add, recomputed masks (CPU)", simd_level_fn=fc.simd_level)
