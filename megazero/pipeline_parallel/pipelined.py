"""Pipelined schedules over the pp group: 1F1B and interleaved 1F1B (virtual stages).

1F1B (PipeDream-flush, Megatron's non-interleaved schedule), on pipeline rank r of p with m
micro-batches:

    warmup    min(p - r - 1, m) forwards (receive, compute, send)
    steady    m - warmup times: one forward, then one backward of the oldest micro-batch
    cooldown  the remaining warmup backwards

so at most p - r micro-batches are in flight (activations kept) on rank r.

Interleaved (Narayanan et al. 2021): each rank holds v chunks; chunk c of rank r holds layers
of virtual stage c * p + r. The m micro-batches are processed in groups of p, round-robin over
chunks, which divides the bubble by v. Virtual micro-batch k runs on chunk
``(k mod p v) div p`` (backward: mirrored) and is micro-batch ``(k div p v) p + k mod p``.

Gradient reduction hooks are held back (``no_sync``) until the last backward of the iteration.
"""

from __future__ import annotations

import contextlib

from megazero.pipeline_parallel.p2p import P2P
from megazero.pipeline_parallel.schedules import ScheduleContext, backward_step, forward_step


class _SyncControl:
    """Enter ``no_sync`` for the whole schedule; leave it before the last backward."""

    def __init__(self, ctx: ScheduleContext):
        self.stack = contextlib.ExitStack()
        if ctx.no_sync is not None and not ctx.forward_only:
            self.stack.enter_context(ctx.no_sync())

    def release(self):
        self.stack.close()


def _p2p(ctx: ScheduleContext) -> P2P:
    return P2P(ctx.ps, ctx.tensor_shape, ctx.dtype)


def forward_backward_pipelining_without_interleaving(**kwargs):
    ctx = ScheduleContext(**kwargs)
    (model,) = ctx.model
    ps, m = ctx.ps, ctx.num_microbatches
    p2p = _p2p(ctx)
    sync = _SyncControl(ctx)
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


def forward_backward_pipelining_with_interleaving(**kwargs):
    ctx = ScheduleContext(**kwargs)
    ps, p, v = ctx.ps, ctx.ps.pp_size, len(ctx.model)
    m = ctx.num_microbatches
    if m % p != 0:
        raise ValueError(f"the interleaved schedule needs the number of micro-batches ({m}) "
                         f"to be a multiple of --pipeline-model-parallel-size ({p})")
    p2p = _p2p(ctx)
    sync = _SyncControl(ctx)
    total = m * v
    iters = ctx.data_iterator if isinstance(ctx.data_iterator, list) \
        else [ctx.data_iterator] * v
    inputs = [[] for _ in range(v)]
    outputs = [[] for _ in range(v)]
    output_grads = [[] for _ in range(v)]
    first_rank, last_rank = ps.is_first_stage, ps.is_last_stage

    def chunk_of(k, forward):
        c = (k % (p * v)) // p
        return c if forward else v - c - 1

    def microbatch_of(k):
        return (k // (p * v)) * p + k % p

    if m == p:
        num_warmup, all_warmup = total, True
    else:
        num_warmup, all_warmup = min((p - ps.pp_rank - 1) * 2 + (v - 1) * p, total), False
    num_steady = total - num_warmup

    def fwd(k):
        c = chunk_of(k, True)
        if first_rank and c == 0 and len(inputs[c]) == len(outputs[c]):
            inputs[c].append(None)  # the first virtual stage reads ids from the data
        out = forward_step(ctx, ctx.model[c], iters[c], microbatch_of(k), c, inputs[c][-1])
        outputs[c].append(out)
        if ctx.forward_only:
            inputs[c].pop()
            outputs[c].pop()
        return out

    def bwd(k):
        c = chunk_of(k, False)
        if last_rank and c == v - 1 and not output_grads[c]:
            output_grads[c].append(None)  # the last virtual stage starts from the loss
        if k == total - 1:
            sync.release()
        return backward_step(ctx, inputs[c].pop(0), outputs[c].pop(0), output_grads[c].pop(0),
                             microbatch_of(k), c)

    # warmup
    if not first_rank:
        inputs[0].append(p2p.communicate(recv_prev=True)[0])
    for k in range(num_warmup):
        out = fwd(k)
        nxt = chunk_of(k + 1, True)
        recv_prev = not (first_rank and nxt == 0) and k != total - 1
        if last_rank and chunk_of(k, True) == v - 1:
            out = None  # the loss stays here
        if k == num_warmup - 1 and not ctx.forward_only and not all_warmup:
            recv_next = not last_rank
            in_t, out_g = p2p.communicate(send_next=out, recv_prev=recv_prev,
                                          recv_next=recv_next)
            output_grads[v - 1].append(out_g)
        else:
            in_t, _ = p2p.communicate(send_next=out, recv_prev=recv_prev)
        inputs[nxt].append(in_t)

    # steady state
    for i in range(num_steady):
        fk, bk = i + num_warmup, i
        out = fwd(fk)
        in_grad = bwd(bk)
        if last_rank and chunk_of(fk, True) == v - 1:
            out = None
        if first_rank and chunk_of(bk, False) == 0:
            in_grad = None
        if first_rank:  # the first stage runs p - 1 forwards ahead of the last
            nf = chunk_of(fk - (p - 1), True)
            recv_prev = nf != v - 1
            nf += 1
        else:
            nf, recv_prev = chunk_of(fk + 1, True), True
        if last_rank:
            nb = chunk_of(bk - (p - 1), False)
            recv_next = nb != 0
            nb -= 1
        else:
            nb, recv_next = chunk_of(bk + 1, False), True
        if i == num_steady - 1:
            recv_prev = False
        in_t, out_g = p2p.communicate(send_next=out, send_prev=in_grad, recv_prev=recv_prev,
                                      recv_next=recv_next)
        if recv_prev:
            inputs[nf].append(in_t)
        if recv_next:
            output_grads[nb].append(out_g)

    # cooldown
    if not ctx.forward_only:
        if all_warmup and not last_rank:
            output_grads[v - 1].append(p2p.communicate(recv_next=True)[1])
        for k in range(num_steady, total):
            in_grad = bwd(k)
            if first_rank and chunk_of(k, False) == 0:
                in_grad = None
            nb = chunk_of(k + 1, False)
            recv_next = not (last_rank and nb == v - 1) and k != total - 1
            _, out_g = p2p.communicate(send_prev=in_grad, recv_next=recv_next)
            if recv_next:
                output_grads[nb].append(out_g)
    sync.release()
    return ctx.losses
