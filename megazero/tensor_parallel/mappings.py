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


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    n = comm.group_size(group)
    if n == 1:
        return x
    if x.shape[-1] % n != 0:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by tp size {n}")
    return x.chunk(n, dim=-1)[comm.group_rank(group)].contiguous()


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    n = comm.group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    out = torch.empty((n, *x.shape), dtype=x.dtype, device=x.device)  # [n, ..., h/n]
    comm.all_gather_into(out, x, group)
    return torch.cat(out.unbind(0), dim=-1)  # [..., h]


def _split_first(x: torch.Tensor, group) -> torch.Tensor:
    n = comm.group_size(group)
    if n == 1:
        return x
    if x.shape[0] % n != 0:
        raise ValueError(f"first dimension {x.shape[0]} is not divisible by tp size {n}")
    return x.chunk(n, dim=0)[comm.group_rank(group)].contiguous()


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
    if x.shape[0] % n != 0:
        raise ValueError(f"first dimension {x.shape[0]} is not divisible by tp size {n}")
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


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # The incoming gradient may alias another branch's gradient: reduce a copy.
        return _all_reduce(grad, ctx.group, inplace=False), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group, inplace=False)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first(grad, ctx.group), None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group = group
        ctx.tp_output_grad = tensor_parallel_output_grad
        return _gather_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        # If the consumer of the gathered tensor is tensor-parallel (a column-parallel linear),
        # each rank holds a partial gradient of the full sequence: reduce-scatter it. Otherwise
        # the gradient is already complete on every rank: keep this rank's slice.
        if ctx.tp_output_grad:
            return _reduce_scatter_first(grad, ctx.group), None, None
        return _split_first(grad, ctx.group), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first(grad, ctx.group), None


def copy_to_tp_region(x, group):
    """Forward: identity. Backward: all-reduce the gradient over ``group``."""
    return _CopyToTP.apply(x, group) if comm.group_size(group) > 1 else x


def reduce_from_tp_region(x, group):
    """Forward: all-reduce (sum) over ``group``. Backward: identity."""
    return _ReduceFromTP.apply(x, group) if comm.group_size(group) > 1 else x


def scatter_to_tp_region(x, group):
    """Forward: keep this rank's chunk of the last dim. Backward: all-gather the last dim."""
    return _ScatterToTP.apply(x, group) if comm.group_size(group) > 1 else x


def gather_from_tp_region(x, group):
    """Forward: all-gather along the last dim. Backward: keep this rank's chunk."""
    return _GatherFromTP.apply(x, group) if comm.group_size(group) > 1 else x


def scatter_to_sequence_parallel_region(x, group):
    """Forward: keep this rank's chunk of the first dim. Backward: all-gather the first dim."""
    return _ScatterToSP.apply(x, group) if comm.group_size(group) > 1 else x


def gather_from_sequence_parallel_region(x, group, tensor_parallel_output_grad=True):
    """Forward: all-gather along the first dim. Backward: reduce-scatter (or split)."""
    if comm.group_size(group) == 1:
        return x
    return _GatherFromSP.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x, group):
    """Forward: reduce-scatter along the first dim. Backward: all-gather the first dim."""
    return _ReduceScatterToSP.apply(x, group) if comm.group_size(group) > 1 else x
