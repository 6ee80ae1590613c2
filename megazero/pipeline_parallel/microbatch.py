"""One micro-batch forward and backward on one model chunk, shared by every schedule.

``ScheduleContext`` carries what all schedules need (the user's ``forward_step_func``, the data
iterator(s), model chunks, micro-batch count, ``ParallelState``, loss scale, ``no_sync``).
``forward_step`` runs ``forward_step_func(data_iterator, model)`` -> ``(output, loss_func)`` as
in Megatron and, on the last stage, turns the output into the loss divided by the number of
micro-batches; ``backward_step`` back-propagates (from the loss times ``loss_scale`` on the last
stage, else from the gradient received from the next stage) and returns the gradient of the
stage's input. ``forward_backward_no_pipelining`` is the schedule of one stage: gradient
accumulation with all but the last micro-batch inside the optimizer's ``no_sync``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from megazero.distributed.parallel_state import ParallelState


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
    sent_shapes: set | None = None  # if a set: the shapes of the tensors this rank sends
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
