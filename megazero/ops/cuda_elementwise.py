"""Bias-GELU, bias-dropout-add and bias-SwiGLU on CUDA: megazero custom ops over the kernels of
``csrc/fused/elementwise_cuda.cu`` (see ``cuda_fused`` for the routing and registration).

Per chain, forward is one kernel; backward is one kernel for the input gradient, plus one more
(``megazero::column_sum``) when the bias needs a gradient: the backward kernel sums its fp32
gradients over chunks of rows into partials ``[chunks, cols]`` and ``column_sum`` adds the
chunks in order (no atomics, the same bits every run).

* ``bias_gelu(x, bias)``: gelu_tanh(x + bias); saves x and bias, the backward recomputes.
* ``bias_dropout_add(x, bias, residual, p, training)``: residual + dropout(x + bias). The mask
  of flat element i is the CPU kernel's counter-based hash of (seed, i) (so it equals
  ``fused_dropout.dropout_keep_mask(seed, ...)``); the backward regenerates it from the seed,
  no mask is kept. The 62-bit seed is drawn without a host sync from the host-side state of
  the tensor's CUDA generator (:func:`dropout_seed`: its seed and offset, then the offset
  advances), so ``RNGStatesTracker.fork`` and recompute's state restore give the same masks.
  On fake tensors (the dry run) the fake implementation runs: no seed is drawn and no
  generator touched; the seed output is a fake int64 scalar. Without dropout (eval, p = 0) the
  forward is residual + (x + bias), one kernel, and the backward launches only dbias's sum.
* ``bias_swiglu(y, bias)``: silu(gate) * up of y + bias, (gate, up) interleaved in y's last dim.
"""

from __future__ import annotations

import functools

import torch

from megazero.ops import fused_common as fc
from megazero.ops.cuda_fused import cuda_route, defined, kernels, op_name
from megazero.ops.registry import register_op

MIN_CHUNK_ROWS = 32  # csrc/fused/fused_cuda.h: kMinChunkRows, kMaxChunks
MAX_CHUNKS = 256
_MASK64 = (1 << 64) - 1


def partial_rows(rows: int) -> int:
    """Row chunks of a backward's bias partials: ceil(rows / 32), between 1 and 256."""
    return max(1, min(MAX_CHUNKS, -(-rows // MIN_CHUNK_ROWS)))


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def dropout_seed(device: torch.device) -> int:
    """A 62-bit dropout seed from ``device``'s CUDA generator: a hash of its seed and offset
    (host-side state, no sync); the offset then advances by 4 (Philox's step), so the next call
    differs and a restored generator state (tracker fork, recompute) repeats it."""
    if not torch.cuda.default_generators:
        torch.cuda.init()
    index = device.index if device.index is not None else torch.cuda.current_device()
    gen = torch.cuda.default_generators[index]
    seed, offset = gen.initial_seed(), gen.get_offset()
    gen.set_offset(offset + 4)
    return _splitmix64(seed ^ _splitmix64(offset)) >> 2


def _grads(like: torch.Tensor, cols: int, chunks: int):
    """(input gradient shaped as ``like``, fp32 partials [chunks, cols]) of a backward kernel."""
    return torch.empty_like(like), like.new_empty((chunks, cols), dtype=torch.float32)


def _chunks(like: torch.Tensor, cols: int, wanted: bool) -> int:
    return partial_rows(like.numel() // cols) if wanted else 0


def _bias_grad(partials: torch.Tensor, bias: torch.Tensor | None, wanted: bool):
    return torch.ops.megazero.column_sum(partials, bias.dtype) if wanted else None


@functools.cache
def define_ops() -> None:
    """Register the ops of this module with torch (once)."""
    _define_column_sum()
    _define_bias_gelu()
    _define_bias_swiglu()
    _define_bias_dropout_add()


def _define_column_sum() -> None:
    @torch.library.custom_op(op_name("column_sum"), mutates_args=(), device_types="cuda")
    def column_sum(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        out = partials.new_empty(partials.shape[1], dtype=dtype)
        kernels().column_sum(partials, out)
        return out

    @column_sum.register_fake
    def _(partials, dtype):
        return partials.new_empty(partials.shape[1], dtype=dtype)


def _define_bias_gelu() -> None:
    @torch.library.custom_op(op_name("bias_gelu"), mutates_args=(), device_types="cuda")
    def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = torch.empty_like(x)
        kernels().bias_gelu_fwd(x, bias, y)
        return y

    @bias_gelu.register_fake
    def _(x, bias):
        return torch.empty_like(x)

    @torch.library.custom_op(op_name("bias_gelu_backward"), mutates_args=(), device_types="cuda")
    def bias_gelu_backward(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None,
                           chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
        dx, partials = _grads(x, x.shape[-1], chunks)
        kernels().bias_gelu_bwd(dy, x, bias, dx, partials)
        return dx, partials

    @bias_gelu_backward.register_fake
    def _(dy, x, bias, chunks):
        return _grads(x, x.shape[-1], chunks)

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def backward(ctx, dy):
        x, bias = ctx.saved_tensors
        wanted = bias is not None and ctx.needs_input_grad[1]
        dx, partials = torch.ops.megazero.bias_gelu_backward(
            dy.contiguous(), x, bias, _chunks(x, x.shape[-1], wanted))
        return dx, _bias_grad(partials, bias, wanted)

    bias_gelu.register_autograd(backward, setup_context=setup)


def _define_bias_swiglu() -> None:
    def out_like(y):
        return y.new_empty(y.shape[:-1] + (y.shape[-1] // 2,))

    @torch.library.custom_op(op_name("bias_swiglu"), mutates_args=(), device_types="cuda")
    def bias_swiglu(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = out_like(y)
        kernels().swiglu_fwd(y, bias, out)
        return out

    @bias_swiglu.register_fake
    def _(y, bias):
        return out_like(y)

    @torch.library.custom_op(op_name("bias_swiglu_backward"), mutates_args=(),
                             device_types="cuda")
    def bias_swiglu_backward(dout: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None,
                             chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
        dy, partials = _grads(y, y.shape[-1], chunks)
        kernels().swiglu_bwd(dout, y, bias, dy, partials)
        return dy, partials

    @bias_swiglu_backward.register_fake
    def _(dout, y, bias, chunks):
        return _grads(y, y.shape[-1], chunks)

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def backward(ctx, dout):
        y, bias = ctx.saved_tensors
        wanted = bias is not None and ctx.needs_input_grad[1]
        dy, partials = torch.ops.megazero.bias_swiglu_backward(
            dout.contiguous(), y, bias, _chunks(y, y.shape[-1], wanted))
        return dy, _bias_grad(partials, bias, wanted)

    bias_swiglu.register_autograd(backward, setup_context=setup)


def _define_bias_dropout_add() -> None:
    @torch.library.custom_op(op_name("bias_dropout_add"), mutates_args=(), device_types="cuda",
                             tags=(torch.Tag.nondeterministic_seeded,))
    def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                         threshold: int, scale: float,
                         enabled: bool) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty_like(x)
        seed = dropout_seed(x.device) if enabled else 0
        kernels().bias_dropout_add_fwd(x, bias, residual, out, seed, threshold, scale, enabled)
        return out, torch.tensor(seed, dtype=torch.int64)  # the seed stays on the host

    @bias_dropout_add.register_fake
    def _(x, bias, residual, threshold, scale, enabled):
        return torch.empty_like(x), torch.empty((), dtype=torch.int64)

    @torch.library.custom_op(op_name("bias_dropout_add_backward"), mutates_args=(),
                             device_types="cuda")
    def bias_dropout_add_backward(dy: torch.Tensor, seed: torch.Tensor, threshold: int,
                                  scale: float, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
        dx, partials = _grads(dy, dy.shape[-1], chunks)
        kernels().bias_dropout_add_bwd(dy, dx, partials, int(seed), threshold, scale)
        return dx, partials

    @bias_dropout_add_backward.register_fake
    def _(dy, seed, threshold, scale, chunks):
        return _grads(dy, dy.shape[-1], chunks)

    def setup(ctx, inputs, output):
        x, bias, _, threshold, scale, enabled = inputs
        ctx.save_for_backward(output[1])
        ctx.args = (threshold, scale, enabled, bias is not None, x.shape[-1])

    def backward(ctx, dout, _dseed):
        (seed,) = ctx.saved_tensors
        threshold, scale, enabled, has_bias, cols = ctx.args
        wanted = has_bias and ctx.needs_input_grad[1]
        if not enabled:  # out = residual + x + bias
            return dout, dout.reshape(-1, cols).sum(0) if wanted else None, dout, \
                None, None, None
        dx, partials = torch.ops.megazero.bias_dropout_add_backward(
            dout.contiguous(), seed, threshold, scale, _chunks(dout, cols, wanted))
        dbias = torch.ops.megazero.column_sum(partials, dout.dtype) if wanted else None
        return dx, dbias, dout, None, None, None

    bias_dropout_add.register_autograd(backward, setup_context=setup)


def _bias_fits(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return bias is None or (bias.dtype == x.dtype and bias.shape == x.shape[-1:])


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


def takes_bias_gelu(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :func:`bias_gelu` takes these tensors (CUDA, kernels built or fake)."""
    return x.dim() > 0 and x.numel() > 0 and _bias_fits(x, bias) and cuda_route(x, bias) \
        and defined("bias_gelu", define_ops)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """gelu_tanh(x + bias): x [..., h], bias [h] or None (after :func:`takes_bias_gelu`)."""
    return torch.ops.megazero.bias_gelu(x.contiguous(), _contiguous(bias))


def takes_bias_swiglu(y: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :func:`bias_swiglu` takes these tensors."""
    return y.dim() > 0 and y.numel() > 0 and y.shape[-1] % 2 == 0 and _bias_fits(y, bias) \
        and cuda_route(y, bias) and defined("bias_swiglu", define_ops)


def bias_swiglu(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """silu(gate) * up of y + bias: y [..., 2f] (gate, up interleaved) -> [..., f]."""
    return torch.ops.megazero.bias_swiglu(y.contiguous(), _contiguous(bias))


def takes_bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None,
                           residual: torch.Tensor) -> bool:
    """Whether :func:`bias_dropout_add` takes these tensors."""
    return x.dim() > 0 and x.numel() > 0 and _bias_fits(x, bias) \
        and residual.shape == x.shape and residual.dtype == x.dtype \
        and cuda_route(x, bias, residual) and defined("bias_dropout_add", define_ops)


def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                     threshold: int, scale: float, enabled: bool) -> torch.Tensor:
    """residual + mask * scale * (x + bias) for x, residual [s, b, h] (``fused_dropout``'s
    ``dropout_params`` give threshold and scale), or residual + (x + bias) when not enabled."""
    out, _ = torch.ops.megazero.bias_dropout_add(x.contiguous(), _contiguous(bias),
                                                 residual.contiguous(), int(threshold),
                                                 float(scale), bool(enabled))
    return out


register_op("cuda_bias_gelu", fc.CUDA_EXTENSION, "bias + tanh GELU, fwd/bwd (CUDA)",
            simd_level_fn=lambda: "cuda")
register_op("cuda_bias_dropout_add", fc.CUDA_EXTENSION,
            "bias + dropout + residual add, recomputed masks (CUDA)", simd_level_fn=lambda: "cuda")
register_op("cuda_bias_swiglu", fc.CUDA_EXTENSION,
            "bias + SwiGLU (interleaved gate/up), fwd/bwd (CUDA)", simd_level_fn=lambda: "cuda")
