"""Autograd collectives of tensor parallelism, over the tensor-parallel group passed in.

Megatron's f/g pairs. Along the last (hidden) dimension:

    copy_to_tp_region          forward: identity        backward: all-reduce
    reduce_from_tp_region      forward: all-reduce      backward: identity
    scatter_to_tp_region       forward: split (last)    backward: all-gather (last)
    gather_from_tp_region      forward: all-gather      backward: split (last)

Along the first (sequence) dimension, for sequence parallelism:

    scatter_to_sequence_parallel_region      forward: split (first)   backward: all-gather
    gather_from_sequence_parallel_region     forward: all-gather      backward: reduce-scatter
    reduce_scatter_to_sequence_parallel_region forward: reduce-scatter backward: all-gather

Every op is the identity on a group of one (or ``None``), so a layer built for tp=1 runs as
plain PyTorch. Tensors are ``[s, b, h]`` (sequence first) as in Megatron.
"""

from __future__ import annotations

import torch

from megazero.distributed import comm


def _divisible(x: torch.Tensor, dim: int, n: int) -> None:
    if x.shape[dim] % n != 0:
        where = "last" if dim == -1 else "first"
        raise ValueError(f"{where} dimension {x.shape[dim]} is not divisible by tp size {n}")


def _split(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's chunk of ``x`` along ``dim`` (first or last)."""
    n = comm.group_size(group)
    if n == 1:
        return x
    _divisible(x, dim, n)
    return x.chunk(n, dim=dim)[comm.group_rank(group)].contiguous()


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    return _split(x, group, -1)


def _split_first(x: torch.Tensor, group) -> torch.Tensor:
    return _split(x, group, 0)


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    n = comm.group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    out = torch.empty((n, *x.shape), dtype=x.dtype, device=x.device)  # [n, ..., h/n]
    comm.all_gather_into(out, x, group)
    return torch.cat(out.unbind(0), dim=-1)  # [..., h]


def _gather_first(x: torch.Tensor, group) -> torch.Tensor:
    n = comm.group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather_into(out, x, group)  # [s, ...] from n x [s/n, ...]
    return out


def _reduce_scatter_first(x: torch.Tensor, group) -> torch.Tensor:
    n = comm.group_size(group)
    if n == 1:
        return x
    _divisible(x, 0, n)
    x = x.contiguous()
    out = torch.empty((x.shape[0] // n, *x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.reduce_scatter_into(out, x, group)  # [s/n, ...]
    return out


def _all_reduce(x: torch.Tensor, group, inplace: bool) -> torch.Tensor:
    if comm.group_size(group) == 1:
        return x
    x = x.contiguous() if inplace else x.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(x, group)
    return x


def _identity(x: torch.Tensor, group) -> torch.Tensor:
    return x


def _view(x: torch.Tensor, group) -> torch.Tensor:
    return x.view_as(x)  # a new tensor for autograd, no copy


def _reduce(x: torch.Tensor, group) -> torch.Tensor:
    # The incoming tensor may alias another branch's (a gradient, an input): reduce a copy.
    return _all_reduce(x, group, inplace=False)


class _Mapping(torch.autograd.Function):
    """``fwd(x, group)`` forward, ``bwd(grad, group)`` backward: every f/g pair below."""

    @staticmethod
    def forward(ctx, x, group, fwd, bwd):
        ctx.group, ctx.bwd = group, bwd
        return fwd(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.bwd(grad, ctx.group), None, None, None


def _apply(x, group, fwd, bwd):
    return _Mapping.apply(x, group, fwd, bwd) if comm.group_size(group) > 1 else x


def copy_to_tp_region(x, group):
    """Forward: identity. Backward: all-reduce the gradient over ``group``."""
    return _apply(x, group, _view, _reduce)


def reduce_from_tp_region(x, group):
    """Forward: all-reduce (sum) over ``group``. Backward: identity."""
    return _apply(x, group, _reduce, _identity)


def scatter_to_tp_region(x, group):
    """Forward: keep this rank's chunk of the last dim. Backward: all-gather the last dim."""
    return _apply(x, group, _split_last, _gather_last)


def gather_from_tp_region(x, group):
    """Forward: all-gather along the last dim. Backward: keep this rank's chunk."""
    return _apply(x, group, _gather_last, _split_last)


def scatter_to_sequence_parallel_region(x, group):
    """Forward: keep this rank's chunk of the first dim. Backward: all-gather the first dim."""
    return _apply(x, group, _split_first, _gather_first)


def gather_from_sequence_parallel_region(x, group, tensor_parallel_output_grad=True):
    """Forward: all-gather along the first dim. Backward: reduce-scatter (or split)."""
    # If the consumer of the gathered tensor is tensor-parallel (a column-parallel linear),
    # each rank holds a partial gradient of the full sequence: reduce-scatter it. Otherwise
    # the gradient is already complete on every rank: keep this rank's slice.
    bwd = _reduce_scatter_first if tensor_parallel_output_grad else _split_first
    return _apply(x, group, _gather_first, bwd)


def reduce_scatter_to_sequence_parallel_region(x, group):
    """Forward: reduce-scatter along the first dim. Backward: all-gather the first dim."""
    return _apply(x, group, _reduce_scatter_first, _gather_first)
