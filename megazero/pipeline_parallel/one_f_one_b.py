"""The 1F1B schedule over the pp group (the interleaved one is in ``interleaved.py``).

1F1B (PipeDream-flush, Megatron's non-interleaved schedule), on pipeline rank r of p with m
micro-batches:

    warmup    min(p - r - 1, m) forwards (receive, compute, send)
    steady    m - warmup times: one forward, then one backward of the oldest micro-batch
    cooldown  the remaining warmup backwards

so at most p - r micro-batches are in flight (activations kept) on rank r.

Gradient reduction hooks are held back (``no_sync``) until the last backward of the iteration.
"""

from __future__ import annotations

from megazero.pipeline_parallel.microbatch import (
    GradSyncControl,
    ScheduleContext,
    backward_step,
    forward_step,
)
from megazero.pipeline_parallel.p2p import P2P


def _p2p(ctx: ScheduleContext) -> P2P:
    return P2P(ctx.ps, ctx.tensor_shape, ctx.dtype, sent_shapes=ctx.sent_shapes)


def forward_backward_pipelining_without_interleaving(**kwargs):
    ctx = ScheduleContext(**kwargs)
    (model,) = ctx.model
    ps, m = ctx.ps, ctx.num_microbatches
    p2p = _p2p(ctx)
    sync = GradSyncControl(ctx)
    num_warmup = min(ps.pp_size - ps.pp_rank - 1, m)
    num_steady = m - num_warmup
    inputs, outputs = [], []
    fwd_id, bwd_id = 0, 0

    def do_backward(input_tensor, output_tensor, output_grad):
        nonlocal bwd_id
        if bwd_id == m - 1:
            sync.release()  # last backward of the iteration: let gradient reduction run
        grad = backward_step(ctx, input_tensor, output_tensor, output_grad, bwd_id)
        bwd_id += 1
        return grad

    # warmup: forwards only
    for _ in range(num_warmup):
        input_tensor = p2p.recv_forward()
        output = forward_step(ctx, model, ctx.data_iterator, fwd_id, 0, input_tensor)
        fwd_id += 1
        p2p.send_forward(output)
        if not ctx.forward_only:
            inputs.append(input_tensor)
            outputs.append(output)

    # steady state: one forward, one backward
    input_tensor = p2p.recv_forward() if num_steady > 0 else None
    for i in range(num_steady):
        last = i == num_steady - 1
        output = forward_step(ctx, model, ctx.data_iterator, fwd_id, 0, input_tensor)
        fwd_id += 1
        if ctx.forward_only:
            p2p.send_forward(output)
            if not last:
                input_tensor = p2p.recv_forward()
            continue
        output_grad = p2p.send_forward_recv_backward(output)
        inputs.append(input_tensor)
        outputs.append(output)
        input_grad = do_backward(inputs.pop(0), outputs.pop(0), output_grad)
        if last:
            input_tensor = None
            p2p.send_backward(input_grad)
        else:
            input_tensor = p2p.send_backward_recv_forward(input_grad)

    # cooldown: the backwards left over from warmup
    if not ctx.forward_only:
        for _ in range(num_warmup):
            output_grad = p2p.recv_backward()
            input_grad = do_backward(inputs.pop(0), outputs.pop(0), output_grad)
            p2p.send_backward(input_grad)
    sync.release()
    return ctx.losses
