"""Interleaved 1F1B over the pp group (virtual pipeline stages), with optional p2p overlap.

Narayanan et al. 2021, Megatron's interleaved schedule: each rank holds v model chunks;
chunk c of pipeline rank r holds the layers of virtual stage c * p + r. The m micro-batches
run in groups of p, round-robin over the chunks, which divides the fill-and-drain bubble by v.
Virtual micro-batch k runs on chunk ``(k mod p v) div p`` (backward: mirrored) and is
micro-batch ``(k div p v) p + k mod p``.

    warmup    (p - r - 1) * 2 + (v - 1) * p forwards (all v m of them when m == p, or when
              only evaluating)
    steady    one forward, then one backward, per step
    cooldown  the remaining backwards

Exchanges with the neighbours (activations to rank r + 1, gradients to rank r - 1, wrapping
around between the last and the first rank) are computed by the same rules in both drivers:

* blocking (default): after each step's compute one exchange posts everything and waits, as
  Megatron without ``--overlap-p2p-communication``;
* overlapped (``--overlap-p2p-communication``): the activation exchange is posted right after
  the forward and only waited for before the next forward; the gradient exchange is posted
  after the backward and waited for before the next backward; so each exchange's latency
  hides behind the other direction's compute. Every post happens no later, and every wait no
  earlier, than in the blocking driver, so it inherits its freedom from deadlock.
"""

from __future__ import annotations

from megazero.pipeline_parallel.microbatch import (
    GradSyncControl,
    ScheduleContext,
    backward_step,
    forward_step,
)
from megazero.pipeline_parallel.p2p import P2P


class _Interleaved:
    """The bookkeeping of one rank's interleaved schedule (chunks, queues, neighbours)."""

    def __init__(self, ctx: ScheduleContext):
        self.ctx, ps = ctx, ctx.ps
        self.p, self.v, self.m = ps.pp_size, len(ctx.model), ctx.num_microbatches
        p, v, m = self.p, self.v, self.m
        if m % p != 0:
            raise ValueError(f"the interleaved schedule needs the number of micro-batches ({m}) "
                             f"to be a multiple of --pipeline-model-parallel-size ({p})")
        self.p2p = P2P(ps, ctx.tensor_shape, ctx.dtype, sent_shapes=ctx.sent_shapes)
        self.sync = GradSyncControl(ctx)
        self.total = m * v
        self.iters = ctx.data_iterator if isinstance(ctx.data_iterator, list) \
            else [ctx.data_iterator] * v
        self.inputs = [[] for _ in range(v)]  # per chunk: received activations, oldest first
        self.outputs = [[] for _ in range(v)]
        self.output_grads = [[] for _ in range(v)]
        self.first, self.last = ps.is_first_stage, ps.is_last_stage
        if ctx.forward_only or m == p:
            self.num_warmup, self.all_warmup = self.total, True
        else:
            self.num_warmup = min((p - ps.pp_rank - 1) * 2 + (v - 1) * p, self.total)
            self.all_warmup = False
        self.num_steady = self.total - self.num_warmup

    # ---- indices -------------------------------------------------------------------------
    def chunk_of(self, k, forward):
        c = (k % (self.p * self.v)) // self.p
        return c if forward else self.v - c - 1

    def microbatch_of(self, k):
        return (k // (self.p * self.v)) * self.p + k % self.p

    # ---- compute -------------------------------------------------------------------------
    def fwd(self, k):
        """Forward of virtual micro-batch k; returns what goes to the next stage (or None)."""
        ctx, c = self.ctx, self.chunk_of(k, True)
        inputs, outputs = self.inputs[c], self.outputs[c]
        if self.first and c == 0 and len(inputs) == len(outputs):
            inputs.append(None)  # the first virtual stage reads ids from the data
        out = forward_step(ctx, ctx.model[c], self.iters[c], self.microbatch_of(k), c,
                           inputs[-1])
        outputs.append(out)
        if ctx.forward_only:
            inputs.pop()
            outputs.pop()
        if self.last and c == self.v - 1:
            return None  # the loss stays here
        return out

    def bwd(self, k):
        """Backward of virtual micro-batch k; returns the gradient for the previous stage."""
        c = self.chunk_of(k, False)
        if self.last and c == self.v - 1 and not self.output_grads[c]:
            self.output_grads[c].append(None)  # the last virtual stage starts from the loss
        if k == self.total - 1:
            self.sync.release()
        grad = backward_step(self.ctx, self.inputs[c].pop(0), self.outputs[c].pop(0),
                             self.output_grads[c].pop(0), self.microbatch_of(k), c)
        if self.first and c == 0:
            return None  # nothing before the first virtual stage
        return grad

    # ---- what the next exchange receives -------------------------------------------------
    def warmup_recv(self, k):
        """After warmup forward k: (chunk of the next input, whether to receive it)."""
        nxt = self.chunk_of(k + 1, True)
        return nxt, not (self.first and nxt == 0) and k != self.total - 1

    def steady_recv(self, i, fk, bk):
        """After steady step i: (next input's chunk, receive it?, next grad's chunk, receive?)."""
        p, v = self.p, self.v
        if self.first:  # the first stage runs p - 1 forwards ahead of the last
            nf = self.chunk_of(fk - (p - 1), True)
            recv_prev, nf = nf != v - 1, nf + 1
        else:
            nf, recv_prev = self.chunk_of(fk + 1, True), True
        if self.last:
            nb = self.chunk_of(bk - (p - 1), False)
            recv_next, nb = nb != 0, nb - 1
        else:
            nb, recv_next = self.chunk_of(bk + 1, False), True
        if i == self.num_steady - 1:
            recv_prev = False
        return nf, recv_prev, nb, recv_next

    def cooldown_recv(self, k):
        """After cooldown backward k: (chunk of the next gradient, whether to receive it)."""
        nb = self.chunk_of(k + 1, False)
        return nb, not (self.last and nb == self.v - 1) and k != self.total - 1

    def first_grad_expected(self):
        """Whether warmup ends by receiving the first gradient (not on the last rank)."""
        return not self.ctx.forward_only and not self.last

    # ---- the blocking driver -------------------------------------------------------------
    def run_blocking(self):
        p2p, ctx = self.p2p, self.ctx
        # warmup
        if not self.first:
            self.inputs[0].append(p2p.communicate(recv_prev=True)[0])
        for k in range(self.num_warmup):
            out = self.fwd(k)
            nxt, recv_prev = self.warmup_recv(k)
            if k == self.num_warmup - 1 and not self.all_warmup:
                in_t, out_g = p2p.communicate(send_next=out, recv_prev=recv_prev,
                                              recv_next=not self.last)
                self.output_grads[self.v - 1].append(out_g)
            else:
                in_t, _ = p2p.communicate(send_next=out, recv_prev=recv_prev)
            self.inputs[nxt].append(in_t)
        # steady state
        for i in range(self.num_steady):
            fk, bk = i + self.num_warmup, i
            out = self.fwd(fk)
            in_grad = self.bwd(bk)
            nf, recv_prev, nb, recv_next = self.steady_recv(i, fk, bk)
            in_t, out_g = p2p.communicate(send_next=out, send_prev=in_grad,
                                          recv_prev=recv_prev, recv_next=recv_next)
            if recv_prev:
                self.inputs[nf].append(in_t)
            if recv_next:
                self.output_grads[nb].append(out_g)
        # cooldown
        if not ctx.forward_only:
            if self.all_warmup and self.first_grad_expected():
                self.output_grads[self.v - 1].append(p2p.communicate(recv_next=True)[1])
            for k in range(self.num_steady, self.total):
                in_grad = self.bwd(k)
                nb, recv_next = self.cooldown_recv(k)
                _, out_g = p2p.communicate(send_prev=in_grad, recv_next=recv_next)
                if recv_next:
                    self.output_grads[nb].append(out_g)
        self.sync.release()
        return ctx.losses

    # ---- the overlapped driver -----------------------------------------------------------
    def run_overlapped(self):
        p2p, ctx, v = self.p2p, self.ctx, self.v
        fwd_wait = bwd_wait = None  # (pending exchange, queue its received tensor goes to)

        def complete(wait, index):
            if wait is not None:
                pending, queue = wait
                received = pending.wait()[index]
                if queue is not None:
                    queue.append(received)

        # warmup
        if not self.first:
            fwd_wait = (p2p.post(recv_prev=True), self.inputs[0])
        for k in range(self.num_warmup):
            complete(fwd_wait, 0)
            out = self.fwd(k)
            nxt, recv_prev = self.warmup_recv(k)
            fwd_wait = (p2p.post(send_next=out, recv_prev=recv_prev), self.inputs[nxt])
            if k == self.num_warmup - 1 and not self.all_warmup:
                bwd_wait = (p2p.post(recv_next=not self.last), self.output_grads[v - 1])
        # steady state: the activation exchange in flight during the backward, the gradient
        # exchange during the next forward
        for i in range(self.num_steady):
            fk, bk = i + self.num_warmup, i
            complete(fwd_wait, 0)
            out = self.fwd(fk)
            nf, recv_prev, nb, recv_next = self.steady_recv(i, fk, bk)
            fwd_wait = (p2p.post(send_next=out, recv_prev=recv_prev),
                        self.inputs[nf] if recv_prev else None)
            complete(bwd_wait, 1)
            in_grad = self.bwd(bk)
            bwd_wait = (p2p.post(send_prev=in_grad, recv_next=recv_next),
                        self.output_grads[nb] if recv_next else None)
        # cooldown
        complete(fwd_wait, 0)
        if not ctx.forward_only:
            if self.all_warmup and self.first_grad_expected():
                bwd_wait = (p2p.post(recv_next=True), self.output_grads[v - 1])
            for k in range(self.num_steady, self.total):
                complete(bwd_wait, 1)
                in_grad = self.bwd(k)
                nb, recv_next = self.cooldown_recv(k)
                bwd_wait = (p2p.post(send_prev=in_grad, recv_next=recv_next),
                            self.output_grads[nb] if recv_next else None)
        complete(bwd_wait, 1)
        self.sync.release()
        return ctx.losses


def forward_backward_pipelining_with_interleaving(**kwargs):
    """Interleaved 1F1B over ``len(model)`` chunks per rank; losses on the last stage."""
    ctx = ScheduleContext(**kwargs)
    schedule = _Interleaved(ctx)
    return schedule.run_overlapped() if ctx.overlap_p2p_comm else schedule.run_blocking()
