"""Forward/backward schedules over micro-batches, across the pipeline-parallel group.

``get_forward_backward_func(pp_size, virtual_pp_size)`` returns one of:

* ``forward_backward_no_pipelining``: one stage; gradient accumulation over micro-batches
  (all but the last inside the optimizer's ``no_sync``).
* ``forward_backward_pipelining_without_interleaving``: 1F1B. Warmup of ``pp - rank - 1``
  forwards, a steady phase alternating one forward and one backward, a cooldown of backwards.
* ``forward_backward_pipelining_with_interleaving``: each rank holds ``v`` model chunks
  (virtual stages); the same three phases over ``v * m`` chunk-micro-batches, with the
  p2p exchanges optionally overlapped with compute (``overlap_p2p_comm``).

Every schedule takes the same keyword arguments and returns, on the last stage, the list of
per-micro-batch loss dicts (empty elsewhere). ``forward_step_func(data_iterator, model)``
returns ``(output, loss_func)`` as in Megatron; ``loss_func(output)`` returns
``(loss, {"lm loss": detached loss})``. Losses are divided by the number of micro-batches and
multiplied by ``loss_scale`` before backward.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from megazero.parallel_state import ParallelState


@dataclass
class ScheduleContext:
    """What every schedule needs besides the model and the data."""

    forward_step_func: object
    data_iterator: object  # an iterator, or a list of iterators (one per model chunk)
    model: list  # model chunks
    num_microbatches: int
    ps: ParallelState
    forward_only: bool = False
    loss_scale: float = 1.0
    no_sync: object = None  # context manager factory: suppress gradient reduction
    tensor_shape: tuple | None = None  # (s, b, h) activation shape between stages
    dtype: torch.dtype = torch.float32
    trace: object = None  # optional PipelineTrace
    overlap_p2p_comm: bool = False  # interleaved: exchanges in flight during compute
    losses: list = field(default_factory=list)


class GradSyncControl:
    """Enter ``no_sync`` for the whole schedule; leave it before the last backward."""

    def __init__(self, ctx: ScheduleContext):
        self.stack = contextlib.ExitStack()
        if ctx.no_sync is not None and not ctx.forward_only:
            self.stack.enter_context(ctx.no_sync())

    def release(self):
        self.stack.close()


def _trace(ctx: ScheduleContext, kind: str, microbatch: int, chunk: int = 0):
    if ctx.trace is None:
        return contextlib.nullcontext()
    return ctx.trace.span(kind, microbatch, chunk)


def forward_step(ctx: ScheduleContext, model, data_iterator, microbatch: int, chunk: int = 0,
                 input_tensor=None):
    """Run one micro-batch forward on one chunk; on the last stage return the scaled loss."""
    with _trace(ctx, "forward", microbatch, chunk):
        if hasattr(model, "set_input_tensor"):
            model.set_input_tensor(input_tensor)
        output, loss_func = ctx.forward_step_func(data_iterator, model)
        last = getattr(model, "post_process", None)
        if last is None:  # a model without the attribute: the last chunk of the last stage
            last = ctx.ps.is_last_stage and chunk == len(ctx.model) - 1
        if last:
            loss, reduced = loss_func(output)
            ctx.losses.append(reduced)
            output = loss / ctx.num_microbatches
    return output


def backward_step(ctx: ScheduleContext, input_tensor, output_tensor, output_grad,
                  microbatch: int, chunk: int = 0):
    """Backward of one micro-batch; returns the gradient of the stage's input (or None)."""
    if ctx.forward_only:
        return None
    with _trace(ctx, "backward", microbatch, chunk):
        if input_tensor is not None:
            input_tensor.retain_grad()
        if output_grad is None:  # last stage: the loss
            output_tensor = output_tensor * ctx.loss_scale
        torch.autograd.backward(output_tensor, grad_tensors=output_grad)
        return input_tensor.grad if input_tensor is not None else None


def forward_backward_no_pipelining(**kwargs):
    """Gradient accumulation on one stage: micro-batches 0..m-2 under ``no_sync``."""
    ctx = ScheduleContext(**kwargs)
    (model,) = ctx.model
    no_sync = ctx.no_sync if (ctx.no_sync is not None and not ctx.forward_only) \
        else contextlib.nullcontext
    with no_sync():
        for i in range(ctx.num_microbatches - 1):
            out = forward_step(ctx, model, ctx.data_iterator, i)
            backward_step(ctx, None, out, None, i)
    last = ctx.num_microbatches - 1
    out = forward_step(ctx, model, ctx.data_iterator, last)
    backward_step(ctx, None, out, None, last)
    return ctx.losses


def get_forward_backward_func(pp_size: int, virtual_pp_size: int | None = None):
    if pp_size == 1:
        return forward_backward_no_pipelining
    from megazero.pipeline_parallel import interleaved, pipelined

    if virtual_pp_size is not None and virtual_pp_size > 1:
        return interleaved.forward_backward_pipelining_with_interleaving
    return pipelined.forward_backward_pipelining_without_interleaving
