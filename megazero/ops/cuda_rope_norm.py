"""RoPE and RMSNorm on CUDA as megazero custom ops (see ``cuda_fused`` for routing and
registration).

* ``rope(t, cos, sin)``: megazero's kernel (``csrc/fused/rope_cuda.cu``), one launch each
  way. t [b, heads, s, hn] is read through its strides (the model's q and k are permuted views
  of the qkv output; only a unit stride along hn is needed), cos and sin [b, 1, s, rot] through
  theirs (stride 0 on a broadcast batch); the output is contiguous. No gradient for cos and
  sin (they come from positions): the op is taken only when neither requires one.
* ``rms_norm(x, weight, eps)``: ATen's fused RMSNorm (``aten._fused_rms_norm``: one kernel on
  rows whose width is a multiple of 4 and 16-byte aligned, as the model's are; its backward,
  ``aten._fused_rms_norm_backward``, launches an input-gradient and a weight-gradient kernel)
  wrapped in one custom op each way. ATen's is what a CUDA torch dispatches ``F.rms_norm`` to;
  the wrapper keeps it one op where a CPU-only torch decomposes it (the dry run on fake CUDA)
  and opaque to ``torch.compile``. fp32 statistics; y = x * rstd * weight rounded once (the
  PyTorch reference rounds x * rstd to x's dtype first).
"""

from __future__ import annotations

import functools

import torch

from megazero.ops import fused_common as fc
from megazero.ops.cuda_fused import cuda_route, defined, kernels, op_name
from megazero.ops.registry import register_op


@functools.cache
def define_ops() -> None:
    """Register the ops of this module with torch (once)."""
    _define_rope()
    _define_rms_norm()


def _define_rope() -> None:
    def out_like(t):
        return t.new_empty(t.shape)  # contiguous whatever t's strides

    @torch.library.custom_op(op_name("rope"), mutates_args=(), device_types="cuda")
    def rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        out = out_like(t)
        kernels().rope(t, cos, sin, out, False)
        return out

    @rope.register_fake
    def _(t, cos, sin):
        return out_like(t)

    @torch.library.custom_op(op_name("rope_backward"), mutates_args=(), device_types="cuda")
    def rope_backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        dt = out_like(grad)
        kernels().rope(grad, cos, sin, dt, True)
        return dt

    @rope_backward.register_fake
    def _(grad, cos, sin):
        return out_like(grad)

    def setup(ctx, inputs, output):
        ctx.save_for_backward(inputs[1], inputs[2])

    def backward(ctx, dout):
        cos, sin = ctx.saved_tensors
        return torch.ops.megazero.rope_backward(_unit_last(dout), cos, sin), None, None

    rope.register_autograd(backward, setup_context=setup)


def _define_rms_norm() -> None:
    def outs(x):  # y, and rstd [..., 1] fp32 as ATen's CUDA kernel returns them
        return torch.empty_like(x), x.new_empty(x.shape[:-1] + (1,), dtype=torch.float32)

    @torch.library.custom_op(op_name("rms_norm"), mutates_args=(), device_types="cuda")
    def rms_norm(x: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
        return y, rstd

    @rms_norm.register_fake
    def _(x, weight, eps):
        return outs(x)

    @torch.library.custom_op(op_name("rms_norm_backward"), mutates_args=(),
                             device_types="cuda")
    def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor,
                          weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dx, dw = torch.ops.aten._fused_rms_norm_backward(dy, x, [x.shape[-1]], rstd, weight,
                                                         [True, True])
        return dx, dw

    @rms_norm_backward.register_fake
    def _(dy, x, rstd, weight):
        return torch.empty_like(x), torch.empty_like(weight)

    def setup(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], inputs[1], output[1])
        ctx.set_materialize_grads(False)  # rstd takes no gradient: no zeros for it

    def backward(ctx, dy, _drstd):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = torch.ops.megazero.rms_norm_backward(dy.contiguous(), x, rstd, weight)
        return dx, dw, None

    rms_norm.register_autograd(backward, setup_context=setup)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """t, copied only when its last dim is not unit-stride (the kernel's one requirement)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _table(c: torch.Tensor, target: tuple[int, ...]) -> torch.Tensor | None:
    """c as a [b, 1, s, rot] view with a unit stride along rot, or None when it does not
    broadcast to ``target``."""
    if c.shape != target:
        if c.dim() > 4 or any(n != m and n != 1 for n, m in zip(c.shape[::-1], target[::-1])):
            return None
        c = c.expand(target)
    return _unit_last(c)


def rope_tables(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(cos, sin) as the RoPE op takes them, or None when it does not take these tensors."""
    if t.dim() != 4 or t.numel() == 0 or cos.dim() == 0 or not t.dtype == cos.dtype == sin.dtype:
        return None
    if cos.requires_grad or sin.requires_grad or not cuda_route(t, cos, sin):
        return None
    b, _, s, hn = t.shape
    rot = cos.shape[-1]
    if rot == 0 or rot % 2 or rot > hn:
        return None
    c, n = _table(cos, (b, 1, s, rot)), _table(sin, (b, 1, s, rot))
    if c is None or n is None or not defined("rope", define_ops):
        return None
    return c, n


def rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on t [b, heads, s, hn] with the tables of :func:`rope_tables`; contiguous result."""
    return torch.ops.megazero.rope(_unit_last(t), cos, sin)


def takes_rms_norm(x: torch.Tensor, weight) -> bool:
    """Whether :func:`rms_norm` takes these tensors: CUDA, weight [h] of x's dtype (ATen's
    kernels: megazero's extension is not needed)."""
    return x.dim() > 0 and x.numel() > 0 and torch.is_tensor(weight) \
        and weight.dtype == x.dtype and weight.shape == x.shape[-1:] \
        and cuda_route(x, weight, needs_kernels=False) and defined("rms_norm", define_ops)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., h] with weight [h]: one op each way (after :func:`takes_rms_norm`)."""
    y, _ = torch.ops.megazero.rms_norm(x.contiguous(), weight.contiguous(), float(eps))
    return y


register_op("cuda_rope", fc.CUDA_EXTENSION, "rotary position embedding, fwd/bwd (CUDA)",
            simd_level_fn=lambda: "cuda")
