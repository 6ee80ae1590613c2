"""Gradient finalisation after the data-parallel reduction (Megatron-core's
``finalize_model_grads``), and the global gradient norm.

After the dp reduction each rank holds its owned, dp-summed gradients. Two more reductions
make them the gradients of the full model:

* parameters replicated over tp but used on a tp rank's part of the sequence (sequence
  parallelism: LayerNorms, the row-parallel biases, position embeddings) hold partial sums:
  all-reduced over the tp group;
* the word embedding tied across pipeline stages (first and last stage each hold a copy):
  all-reduced over the embedding group; it sits alone in its bucket, so both stages own the
  same slice of it.

The global norm counts every gradient element once over the whole model (tp replicas and the
last stage's copy of the tied embedding excluded), summed over the model-parallel group and,
when the optimizer state is sharded, the dp group. Which parameter is what comes from its
``ParamMeta`` (``params``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megazero.data_parallel.layout import Segment
from megazero.data_parallel.params import all_reduce_list, counted_in_norm, tied_across_stages
from megazero.distributed import comm
from megazero.distributed.parallel_state import ParallelState
from megazero.tensor_parallel.meta import meta_of


def finalize_model_grads(segments: list[Segment], owned: Callable[[Segment], torch.Tensor],
                         ps: ParallelState) -> None:
    """All-reduce sequence-parallel gradients over tp and tied-embedding gradients over the
    embedding group (``owned(seg)``: this rank's reduced gradient of a segment, in place)."""
    if ps.tp_size > 1:
        grads = [owned(s) for s in segments if meta_of(s.param).sequence_parallel]
        all_reduce_list(grads, ps.tp_group)
    if ps.pp_size > 1:
        grads = [owned(s) for s in segments if tied_across_stages(s.param, ps)]
        if grads:
            all_reduce_list(grads, ps.embedding_group)


def grad_norm_sq(segments: list[Segment], owned: Callable[[Segment], torch.Tensor],
                 ps: ParallelState, *, sharded: bool, low_precision: bool) -> torch.Tensor:
    """Sum of squares of the reduced (still scaled) gradients over the whole model: a float64
    ``[1]`` tensor on the device, read by nobody here (the step decides on it on the device)."""
    grads = [g for s in segments
             if counted_in_norm(s.param, ps) and (g := owned(s)).numel() > 0]
    local = torch.zeros(1, dtype=torch.float64, device=ps.device)
    if grads:
        # bf16/fp16 gradients: fp32 norms in the multi-tensor kernel, no per-tensor casts
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32) if low_precision \
            else torch._foreach_norm(grads)
        local += torch.stack(norms).double().pow(2).sum()
    comm.all_reduce(local, ps.mp_group)
    if sharded:
        comm.all_reduce(local, ps.dp_group)
    return local


def step_scalars(sumsq: torch.Tensor, scale, dp_size: int, clip: float):
    """The step's scalars from the global sum of squares ``sumsq`` (float64 ``[1]``, still
    multiplied by the loss scale and summed over dp), computed where ``sumsq`` lives:
    ``found_inf`` (bool ``[1]``: a non-finite gradient anywhere), ``grad_norm`` (float64 ``[1]``,
    of the true gradients; NaN on overflow) and ``factor`` (float64 ``[1]``: un-scaling, dp
    averaging and the clip coefficient ``min(1, clip / (norm + 1e-6))`` in one multiplier).
    The same IEEE float64 operations, in the same order, as Python's arithmetic on the value
    read to the host: the result is bit for bit what the host would compute (given the
    device's square root: IEEE on CUDA; torch's CPU one can be one ulp off ``math.sqrt``)."""
    # float64 [1] beside sumsq: a division by a Python or 0-dim host scalar multiplies by its
    # reciprocal (ATen's scalar fast path), one rounding more than the host's division
    divisor = scale.reshape(1).to(sumsq) * dp_size if torch.is_tensor(scale) \
        else torch.full_like(sumsq, scale * dp_size)
    finite = torch.isfinite(sumsq)
    norm = torch.where(finite, sumsq.sqrt() / divisor, float("nan"))
    coeff = torch.ones_like(norm)
    if clip > 0:
        c = torch.full_like(norm, clip) / (norm + 1e-6)  # not clip / t: that is t^-1 * clip
        coeff = torch.where(c < 1.0, c, 1.0)
    return ~finite, norm, coeff / divisor
