"""Rotary position embedding (RoPE): a fused CPU kernel, its PyTorch reference, and the op the
model calls.

``rope(t, cos, sin)`` rotates the first ``rot = cos.shape[-1]`` dims of each head of
``t`` [b, heads, s, hn] in the "rotate half" convention (dim i pairs with i + rot/2, as
Megatron and HF Llama): ``t_rot * cos + rotate_half(t_rot) * sin``, where
``rotate_half([x1, x2]) = [-x2, x1]``; cos and sin are [b, 1, s, rot] (or broadcastable to it);
dims from ``rot`` on pass through.

Kernel (``megazero.ops._fused``, fp32 and bf16 with fp32 arithmetic inside): one pass over t,
read through its strides (the model's q and k are permuted, even non-dense, views of the qkv
output; only a unit stride along hn is needed), writing the output in t's layout (contiguous
when t is not dense); cos and sin are read through their strides too (stride 0 for a
broadcast batch). Backward is the same pass with the transposed rotation, for t only: cos and
sin come from positions, so the kernel path is taken only when neither requires a gradient.
CUDA tensors take megazero's CUDA op (``cuda_rope_norm.rope``, the same strided reads, a
contiguous output) where the CUDA kernels are built or the tensors are fake (the dry run).
Elsewhere (CUDA without the kernels, other or mixed dtypes, shapes that do not broadcast as
above, extension missing, fewer than ``MIN_NUMEL`` elements of t, where eager is as fast)
:func:`rope_reference` runs.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from megazero.ops import cuda_rope_norm
from megazero.ops import fused_common as fc
from megazero.ops.registry import register_op

MIN_NUMEL = 8192  # elements of t; below this eager is as fast (benchmarks/RESULTS.md)


def rope_reference(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The eager formula; reference for tests and the unfused path."""
    rot = cos.shape[-1]
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    x1, x2 = t_rot.chunk(2, dim=-1)
    rotated = t_rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rotated, t_pass), dim=-1) if t_pass.shape[-1] else rotated


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """t, copied only when its last dim is not unit-stride (the kernel's one requirement)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _run(ext, src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool):
    """The kernel on src [b, heads, s, hn] (cos, sin expanded to [b, 1, s, rot])."""
    src = _unit_last(src)
    out = torch.empty_like(src)  # src's strides when dense, else contiguous
    b, heads, s, hn = src.shape
    strides = (*src.stride()[:3], *out.stride()[:3], cos.stride(0), cos.stride(2),
               sin.stride(0), sin.stride(2))
    ext.rope(fc.ptr(src), fc.ptr(cos), fc.ptr(sin), fc.ptr(out),
             (b, heads, s, hn, cos.shape[-1]), strides, backward, fc.dtype_code(src.dtype),
             fc.num_threads())
    return out


class _FusedRope(torch.autograd.Function):
    """Forward: o1 = x1 c1 - x2 s1, o2 = x2 c2 + x1 s2 on the rotated dims (the rest copied).
    Backward: dx1 = d1 c1 + d2 s2, dx2 = d2 c2 - d1 s1; no gradient for cos and sin."""

    @staticmethod
    def forward(ctx, t, cos, sin, ext):
        ctx.save_for_backward(cos, sin)
        ctx.ext = ext
        return _run(ext, t, cos, sin, backward=False)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        cos, sin = ctx.saved_tensors
        return _run(ctx.ext, dout, cos, sin, backward=True), None, None, None


def _as_table(c: torch.Tensor, target: tuple[int, ...]) -> torch.Tensor | None:
    """c as a [b, 1, s, rot] view with a unit stride along rot, or None when c does not
    broadcast to ``target`` (torch.broadcast_shapes costs ~13 us a call; this ~2 us)."""
    if c.shape != target:  # the model's tables are [b, 1, s, rot] already
        if c.dim() > 4 or any(n != m and n != 1 for n, m in zip(c.shape[::-1], target[::-1])):
            return None
        c = c.expand(target)
    return c if c.stride(-1) == 1 else c.contiguous()


def _tables(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """cos and sin as [b, 1, s, rot] views with a unit stride along rot, or None when the
    kernel does not suit these inputs."""
    if t.dim() != 4 or t.numel() == 0 or not fc.worth_a_kernel(t.numel(), MIN_NUMEL):
        return None
    if not fc.cpu_kernel_args_ok(t, cos, sin) or not t.dtype == cos.dtype == sin.dtype:
        return None
    if cos.requires_grad or sin.requires_grad:
        return None  # the kernel gives cos and sin no gradient
    b, _, s, hn = t.shape
    rot = cos.shape[-1] if cos.dim() else 0
    if rot == 0 or rot % 2 or rot > hn:
        return None
    target = (b, 1, s, rot)
    c, n = _as_table(cos, target), _as_table(sin, target)
    return None if c is None or n is None else (c, n)


def fused_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on t [b, heads, s, hn] with cos, sin [b, 1, s, rot]; autograd-aware."""
    if t.is_cuda:
        tables = cuda_rope_norm.rope_tables(t, cos, sin)
        return rope_reference(t, cos, sin) if tables is None else \
            cuda_rope_norm.rope(t, *tables)
    tables = _tables(t, cos, sin)
    if tables is not None and (ext := fc.cpu_extension_for(t, *tables)) is not None:
        return _FusedRope.apply(t, *tables, ext)
    return rope_reference(t, cos, sin)


register_op("rope", fc.CPU_EXTENSION, "rotary position embedding (rotate half), fwd/bwd (CPU)",
            simd_level_fn=fc.simd_level)
