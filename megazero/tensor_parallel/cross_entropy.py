"""Cross entropy over vocabulary-parallel logits, reduced over the tensor-parallel group.

Each tp rank holds logits for its vocabulary shard ``[s, b, Vp/tp]``; the full logits are never
gathered. Forward reduces three per-token scalars over tp: the max logit (for stability), then,
in one all-reduce, the target's logit and the sum of exponentials. Backward is local:
``softmax - one_hot(target)`` on this rank's shard.

Unlike Megatron, columns of the padded vocabulary (ids >= ``vocab_size``) are masked out of
the softmax, so the loss does not depend on how much padding the tp size implied.

On CUDA (megazero's kernels built, or fake tensors in the dry run) the same reductions run over
megazero's kernels (``ops.cuda_cross_entropy``), which read the logits in their own dtype with
fp32 math in registers and never materialise fp32 logits: with tp = 1 one kernel gives loss,
max and sum; with tp > 1 a kernel gives this shard's max, target logit and sum, the max is
all-reduced, a kernel puts the rest on the global max, target logit and sum are all-reduced
together, a kernel writes the loss. Backward is one kernel recomputing the softmax from the
saved logits, max and sum. Elsewhere the PyTorch formulation below runs (fp32 copy, softmax
saved).
"""

from __future__ import annotations

import torch

from megazero.distributed import comm
from megazero.ops import cuda_cross_entropy


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, inplace):
        # logits: [s, b, v] (this rank's shard), target: [s, b] global ids
        n, rank = comm.group_size(group), comm.group_rank(group)
        v = logits.shape[-1]
        start = rank * v
        # fp32 math; with ``inplace`` and fp32 logits the caller's tensor is overwritten (as
        # Megatron does), saving one logits-sized buffer.
        x = logits.float()
        if x is logits and not inplace:
            x = x.clone()
        if vocab_size is not None and start + v > vocab_size:
            x[..., max(vocab_size - start, 0):] = float("-inf")  # padded vocabulary columns

        logits_max = x.max(dim=-1).values  # [s, b]
        comm.all_reduce(logits_max, group, op=torch.distributed.ReduceOp.MAX)
        x.sub_(logits_max.unsqueeze(-1))

        outside = (target < start) | (target >= start + v)  # [s, b]
        local_target = (target - start).masked_fill(outside, 0)
        predicted = x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)  # [s, b]
        predicted = predicted.masked_fill(outside, 0.0)

        x.exp_()
        sum_exp = x.sum(dim=-1)  # [s, b]
        stacked = torch.stack([predicted, sum_exp])  # [2, s, b]: one all-reduce for both
        if n > 1:
            comm.all_reduce(stacked, group)
        predicted, sum_exp = stacked[0], stacked[1]
        loss = torch.log(sum_exp) - predicted  # [s, b]

        x.div_(sum_exp.unsqueeze(-1))  # softmax shard
        ctx.save_for_backward(x, local_target, outside)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax  # reused in place: backward runs once
        hit = (~outside).to(grad.dtype).unsqueeze(-1)  # [s, b, 1]
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None


class _VocabParallelCrossEntropyCUDA(torch.autograd.Function):
    """Forward: loss [s, b] from megazero's kernels and the tp all-reduces (see the module
    docstring). Backward: (softmax - one_hot) * grad on the local shard, one kernel."""

    @staticmethod
    def forward(ctx, logits, target, group, vocab_size):
        # logits: [s, b, v] (this rank's shard), target: [s, b] global ids
        n, rank = comm.group_size(group), comm.group_rank(group)
        v = logits.shape[-1]
        start = rank * v
        valid = v if vocab_size is None else min(max(vocab_size - start, 0), v)
        logits = logits.contiguous()
        if n == 1:
            loss, logits_max, sum_exp = cuda_cross_entropy.forward(logits, target, start, valid)
        else:
            max_local, logits_max, stats = cuda_cross_entropy.stats(logits, target, start, valid)
            comm.all_reduce(logits_max, group, op=torch.distributed.ReduceOp.MAX)  # [rows]
            reduced = cuda_cross_entropy.rescale(max_local, logits_max, stats)  # [2, rows]
            comm.all_reduce(reduced, group)
            loss, sum_exp = cuda_cross_entropy.loss(reduced), reduced[1]
        ctx.save_for_backward(logits, target, logits_max, sum_exp)
        ctx.start, ctx.valid = start, valid
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, target, logits_max, sum_exp = ctx.saved_tensors
        grad = cuda_cross_entropy.backward(grad_loss.float(), logits, target, logits_max,
                                           sum_exp, ctx.start, ctx.valid)
        return grad, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 tp_group=None, vocab_size: int | None = None,
                                 inplace: bool = False) -> torch.Tensor:
    """Per-token loss ``[s, b]`` of logits ``[s, b, Vp/tp]`` against global ids ``[s, b]``.

    ``vocab_size`` is the true vocabulary size; logits of padding columns beyond it are
    ignored. Forward: three tp reductions (max, then target logit and sum-exp together).
    Backward: ``(softmax - one_hot) * grad`` on the local shard, no communication.
    ``inplace=True`` lets fp32 logits be overwritten (they are unusable afterwards; the CUDA
    kernels need no such buffer and leave them intact).
    """
    if vocab_parallel_logits.is_cuda and cuda_cross_entropy.takes(vocab_parallel_logits, target):
        return _VocabParallelCrossEntropyCUDA.apply(vocab_parallel_logits, target, tp_group,
                                                    vocab_size)
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, tp_group, vocab_size,
                                            inplace)
