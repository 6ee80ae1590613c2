"""The vocab-parallel softmax cross entropy's CUDA kernels as megazero custom ops
(``csrc/fused/cross_entropy_cuda.cu``; routing and registration in ``cuda_fused``).

The logits ``[rows, v]`` (this rank's vocabulary shard, columns from ``valid`` on padding) are
read in their own dtype with fp32 math in registers: no fp32 copy of them is ever made, and the
backward recomputes the softmax from the saved logits, row max and row sum. The ops take no
communication; ``tensor_parallel.cross_entropy`` places the tp all-reduces between them:

* one tp rank: ``vocab_ce_forward`` -> (loss, max, sum), one kernel (one pass over the logits);
* several: ``vocab_ce_stats`` -> (local max, max to all-reduce, stats [3, rows]), all-reduce
  (MAX) of the max, ``vocab_ce_rescale`` -> [2, rows] (target logit - max, sum on that max),
  all-reduce (SUM), ``vocab_ce_loss`` -> loss: three kernels, one pass over the logits;
* backward: ``vocab_ce_backward`` -> dlogits = (softmax - one_hot(target)) * grad, one kernel.

Targets are int64 global ids ``[s, b]`` (any strides) or ``[rows]``; ids outside this shard
contribute only through the other ranks, as in the PyTorch formulation.
"""

from __future__ import annotations

import functools

import torch

from megazero.ops import fused_common as fc
from megazero.ops.cuda_fused import cuda_route, defined, kernels, op_name
from megazero.ops.registry import register_op


def _rows(logits: torch.Tensor) -> int:
    return logits.numel() // logits.shape[-1]


def _f32(like: torch.Tensor, *shape: int) -> torch.Tensor:
    return like.new_empty(shape, dtype=torch.float32)


@functools.cache
def define_ops() -> None:
    """Register the ops of this module with torch (once)."""

    @torch.library.custom_op(op_name("vocab_ce_forward"), mutates_args=(), device_types="cuda")
    def vocab_ce_forward(logits: torch.Tensor, target: torch.Tensor, start: int,
                         valid: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        loss, mx, sm = (_f32(logits, _rows(logits)) for _ in range(3))
        kernels().ce_fwd(logits, target, start, valid, loss, mx, sm)
        return loss, mx, sm

    @vocab_ce_forward.register_fake
    def _(logits, target, start, valid):
        return tuple(_f32(logits, _rows(logits)) for _ in range(3))

    @torch.library.custom_op(op_name("vocab_ce_stats"), mutates_args=(), device_types="cuda")
    def vocab_ce_stats(logits: torch.Tensor, target: torch.Tensor, start: int,
                       valid: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = _rows(logits)
        mloc, mred, stats = _f32(logits, rows), _f32(logits, rows), _f32(logits, 3, rows)
        kernels().ce_stats(logits, target, start, valid, mloc, mred, stats)
        return mloc, mred, stats

    @vocab_ce_stats.register_fake
    def _(logits, target, start, valid):
        rows = _rows(logits)
        return _f32(logits, rows), _f32(logits, rows), _f32(logits, 3, rows)

    @torch.library.custom_op(op_name("vocab_ce_rescale"), mutates_args=(), device_types="cuda")
    def vocab_ce_rescale(max_local: torch.Tensor, max: torch.Tensor,
                         stats: torch.Tensor) -> torch.Tensor:
        out = _f32(max, 2, max.numel())
        kernels().ce_rescale(max_local, max, stats, out)
        return out

    @vocab_ce_rescale.register_fake
    def _(max_local, max, stats):
        return _f32(max, 2, max.numel())

    @torch.library.custom_op(op_name("vocab_ce_loss"), mutates_args=(), device_types="cuda")
    def vocab_ce_loss(reduced: torch.Tensor) -> torch.Tensor:
        loss = _f32(reduced, reduced.shape[1])
        kernels().ce_loss(reduced, loss)
        return loss

    @vocab_ce_loss.register_fake
    def _(reduced):
        return _f32(reduced, reduced.shape[1])

    @torch.library.custom_op(op_name("vocab_ce_backward"), mutates_args=(),
                             device_types="cuda")
    def vocab_ce_backward(grad: torch.Tensor, logits: torch.Tensor, target: torch.Tensor,
                          max: torch.Tensor, sum: torch.Tensor, start: int,
                          valid: int) -> torch.Tensor:
        dlogits = torch.empty_like(logits)
        kernels().ce_bwd(grad, logits, target, max, sum, start, valid, dlogits)
        return dlogits

    @vocab_ce_backward.register_fake
    def _(grad, logits, target, max, sum, start, valid):
        return torch.empty_like(logits)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """t as the kernels read per-row values: 1-D or 2-D views of any strides as they are."""
    return t if t.dim() in (1, 2) else t.reshape(-1)


def takes(logits: torch.Tensor, target: torch.Tensor) -> bool:
    """Whether the CUDA cross entropy takes logits [..., v] and int64 target [...]."""
    return logits.dim() > 0 and logits.numel() > 0 and target.dtype == torch.int64 \
        and target.shape == logits.shape[:-1] and target.device == logits.device \
        and cuda_route(logits) and defined("vocab_ce_forward", define_ops)


def forward(logits, target, start: int, valid: int):
    """One tp rank: (loss [rows], max [rows], sum [rows]) of contiguous logits."""
    return torch.ops.megazero.vocab_ce_forward(logits, _as_rows(target), start, valid)


def stats(logits, target, start: int, valid: int):
    """Several tp ranks: (local max, max to all-reduce, stats [3, rows])."""
    return torch.ops.megazero.vocab_ce_stats(logits, _as_rows(target), start, valid)


def rescale(max_local, max, stats_):
    """[2, rows]: (target logit - max, sum of exp(x - max)) of this shard, to all-reduce."""
    return torch.ops.megazero.vocab_ce_rescale(max_local, max, stats_)


def loss(reduced):
    """log(sum) - (target logit - max) [rows] from the all-reduced [2, rows]."""
    return torch.ops.megazero.vocab_ce_loss(reduced)


def backward(grad, logits, target, max, sum_, start: int, valid: int):
    """dlogits = (exp(x - max) / sum - one_hot(target)) * grad, in the logits' dtype."""
    return torch.ops.megazero.vocab_ce_backward(_as_rows(grad), logits, _as_rows(target), max,
                                                sum_, start, valid)


register_op("cuda_vocab_cross_entropy", fc.CUDA_EXTENSION,
            "vocab-parallel softmax cross entropy, fwd/bwd (CUDA)", simd_level_fn=lambda: "cuda")
