"""Naive data parallelism over the dp group: the baseline to read next to ``ZeroOptimizer``.

Every rank keeps the whole model, all its gradients and a ``torch.optim`` optimizer over all
of it. After the last micro-batch's backward every gradient is all-reduced over the dp group,
one collective per parameter, and divided by the dp size; then every rank clips and steps the
same way, so the replicas stay identical. No buckets, no overlap with backward, no sharding,
no fp32 main copy, no loss scaling: picotron keeps ``DataParallelNaive`` beside its bucketed
class for the same reason. ``ZeroOptimizer`` at stage 0 computes the same update with one
collective per bucket instead of one per parameter (``benchmarks/bench_dp_naive.py``
measures the difference); stages 1-3 also split the optimizer states, gradients and
parameters over the dp ranks.

It handles data parallelism alone (tensor- and pipeline-parallel gradients need the
finalisation of ``finalize``), and has the methods the schedules and the training loop call:
``no_sync``, ``zero_grad``, ``finish_grad_sync``, ``step``, ``loss_scale``.
"""

from __future__ import annotations

import contextlib
import math

import torch

from megazero.distributed import comm
from megazero.distributed.parallel_state import ParallelState


class DataParallelNaive:
    """Replicated data parallelism of ``model`` with ``optimizer`` (any ``torch.optim``)."""

    loss_scale = 1.0

    def __init__(self, model: torch.nn.Module, ps: ParallelState,
                 optimizer: torch.optim.Optimizer, *, clip_grad: float = 0.0):
        if ps.tp_size > 1 or ps.pp_size > 1:
            raise ValueError("DataParallelNaive handles data parallelism alone (tp = pp = 1); "
                             "use data_parallel.build_optimizer with model parallelism")
        self.ps, self.optimizer, self.clip_grad = ps, optimizer, clip_grad
        self.params = [p for p in model.parameters() if p.requires_grad]
        # Every rank starts from rank 0's parameters.
        for p in self.params:
            comm.broadcast(p.data, ps.dp_ranks[0], ps.dp_group)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients accumulate in ``.grad`` anyway; nothing is reduced before
        ``finish_grad_sync``."""
        yield

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def finish_grad_sync(self) -> None:
        """Average every gradient over the dp group: one all-reduce per parameter."""
        for p in self.params:
            if p.grad is None:  # unused on this rank: it still takes part in the sum
                p.grad = torch.zeros_like(p)
            comm.all_reduce(p.grad, self.ps.dp_group)
            p.grad.div_(self.ps.dp_size)

    @torch.no_grad()
    def step(self) -> tuple[bool, float, int]:
        """Clip to ``clip_grad`` (when > 0) and step; (updated, grad norm, skipped)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = float(torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.double()) for g in grads]))) \
            if grads else 0.0
        if not math.isfinite(norm):
            return False, norm, 1
        if self.clip_grad > 0 and norm > self.clip_grad:
            coeff = self.clip_grad / (norm + 1e-6)
            for g in grads:
                g.mul_(coeff)
        self.optimizer.step()
        return True, norm, 0

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors ``memory_report`` counts, by category (as ``ZeroOptimizer``'s)."""
        return {"params": list(self.params),
                "grads": [p.grad for p in self.params if p.grad is not None],
                "main_params": [],
                "optimizer_states": [v for s in self.optimizer.state.values()
                                     for v in s.values() if torch.is_tensor(v)]}

    def memory_report(self) -> dict:
        nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
        states = sum(nbytes(v) for s in self.optimizer.state.values() for v in s.values()
                     if torch.is_tensor(v))
        return {"params": sum(nbytes(p) for p in self.params),
                "grads": sum(nbytes(p.grad) for p in self.params if p.grad is not None),
                "main_params": 0, "optimizer_states": states}
