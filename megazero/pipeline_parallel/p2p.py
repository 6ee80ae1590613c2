"""Point-to-point exchange of activations and gradients between pipeline stages.

Neighbours are taken from the ``ParallelState`` (``prev_rank``/``next_rank`` of the pp group,
wrapping around, which the interleaved schedule needs). Activations travel forward (to the
next stage) with one tag, gradients backward (to the previous stage) with another; within one
exchange all activation operations are posted before all gradient operations, so each pair
of ranks matches messages in the same order on both sides even when ``prev == next``
(two stages). All operations of an exchange are posted at once and waited together: no
ordering of blocking calls can deadlock. NCCL gets them as one ``batch_isend_irecv`` (a group,
which it needs); on gloo, where a batch is only a loop over the same non-blocking calls under
a coalescing context, they are posted one by one in the same order, which measured 0.05 ms
less per exchange and about a fifth less idle time in the interleaved schedule.
``post`` returns the exchange in flight (the overlapped interleaved schedule waits for it only
when the received tensor is needed); ``communicate`` posts and waits.

Shapes are fixed per run (``[s, b, h]``) unless ``variable_shapes`` is set, then each tensor is
preceded by a small shape message (a blocking round: a PipelineModule pays it only on its
first batch, then runs at the one shape every stage sent, ``sent_shapes``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megazero.distributed.parallel_state import ParallelState

# High tags: never equal to the small sequence numbers gloo gives its own collectives.
ACT_TAG, GRAD_TAG, SHAPE_TAG_OFFSET = (1 << 29) + 1, (1 << 29) + 2, 10
MAX_DIMS = 8


class PendingExchange:
    """Posted sends/receives of one exchange; ``wait()`` completes them (once)."""

    def __init__(self, reqs, tensors, from_prev=None, from_next=None):
        self.reqs, self.tensors = reqs, tensors  # tensors: keep send buffers alive
        self.from_prev, self.from_next = from_prev, from_next

    def wait(self):
        for req in self.reqs:
            req.wait()
        self.reqs, self.tensors = [], []
        if self.from_prev is not None:
            self.from_prev.requires_grad_(True)
        return self.from_prev, self.from_next


class P2P:
    """Send/recv helpers of one rank, for fixed ``shape`` and ``dtype`` activations."""

    def __init__(self, ps: ParallelState, shape, dtype=torch.float32, device=None,
                 variable_shapes: bool = False, sent_shapes: set | None = None):
        self.ps, self.shape, self.dtype = ps, tuple(shape) if shape else None, dtype
        self.device = device or ps.device
        self.variable_shapes = variable_shapes or self.shape is None
        self.sent_shapes = sent_shapes  # records what this rank sends, when a set
        self._batched = None  # decided at the first exchange (needs the process group)

    # ---- the one primitive ---------------------------------------------------------------
    def post(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
        """Post sends to next/prev and receives from prev/next in one batch, without waiting;
        ``.wait()`` on the result returns ``(from_prev, from_next)`` (None where nothing was
        received). Send tensors are kept alive by the pending exchange until it is waited."""
        ps = self.ps
        if self.variable_shapes:
            prev_shape, next_shape = self._exchange_shapes(send_next, send_prev, recv_prev,
                                                           recv_next)
        else:
            prev_shape = next_shape = self.shape
            for t in (send_next, send_prev):
                if t is not None and tuple(t.shape) != self.shape:
                    raise RuntimeError(
                        f"pipeline stage {ps.pp_rank} sends a tensor of shape {tuple(t.shape)}"
                        f" but the schedule's fixed shape is {self.shape}: check that only "
                        "the last stage computes the loss (model.post_process); a "
                        "PipelineModule whose activations change shape between batches "
                        "needs dynamic_shapes=True")
        if self.sent_shapes is not None:
            self.sent_shapes.update(tuple(t.shape) for t in (send_next, send_prev)
                                    if t is not None)
        ops, from_prev, from_next = [], None, None
        # activations (forward direction) first ...
        if send_next is not None:
            ops.append(self._op(dist.isend, send_next, ps.next_rank, ACT_TAG))
        if recv_prev:
            from_prev = self._empty(prev_shape)
            ops.append(self._op(dist.irecv, from_prev, ps.prev_rank, ACT_TAG))
        # ... then gradients (backward direction)
        if send_prev is not None:
            ops.append(self._op(dist.isend, send_prev, ps.prev_rank, GRAD_TAG))
        if recv_next:
            from_next = self._empty(next_shape)
            ops.append(self._op(dist.irecv, from_next, ps.next_rank, GRAD_TAG))
        return PendingExchange(self._start(ops), [t for _, t in ops], from_prev, from_next)

    def communicate(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
        """``post(...)`` and wait: returns ``(from_prev, from_next)``."""
        return self.post(send_next, send_prev, recv_prev, recv_next).wait()

    def _op(self, fn, tensor, peer, tag):
        if fn is dist.isend:
            tensor = tensor.detach().contiguous()
        self.ps.comm.p2p_posted("send" if fn is dist.isend else "recv", tensor, peer,
                                self.ps.pp_group)
        return dist.P2POp(fn, tensor, peer, tag=tag), tensor

    def _start(self, ops):
        """Post ``[(P2POp, tensor)]`` in order; returns their work handles."""
        if not ops:
            return []
        if self._batched is None:
            self._batched = dist.get_backend() != "gloo"
        comm = self.ps.comm
        try:
            if self._batched:
                works = dist.batch_isend_irecv([op for op, _ in ops])
            else:
                works = [op.op(op.tensor, op.peer, tag=op.tag) for op, _ in ops]
        except RuntimeError as exc:
            raise comm.failure("p2p exchange", self.ps.pp_group, exc,
                               ops[0][0].peer) from exc
        # a failed wait names the pipeline neighbour (dead, or frozen past the timeout)
        return [comm.named_work(w, "send" if op.op is dist.isend else "recv",
                                self.ps.pp_group, op.peer) for w, (op, _) in zip(works, ops)]

    def _run(self, ops):
        PendingExchange(self._start(ops), []).wait()

    def _empty(self, shape):
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def _exchange_shapes(self, send_next, send_prev, recv_prev, recv_next):
        def encode(t):
            s = torch.zeros(MAX_DIMS + 1, dtype=torch.int64)
            s[0] = t.dim()
            s[1:1 + t.dim()] = torch.tensor(t.shape)
            return s.to(self.device)

        ps, ops = self.ps, []
        recv_p = torch.empty(MAX_DIMS + 1, dtype=torch.int64, device=self.device) \
            if recv_prev else None
        recv_n = torch.empty(MAX_DIMS + 1, dtype=torch.int64, device=self.device) \
            if recv_next else None
        if send_next is not None:
            ops.append(self._op(dist.isend, encode(send_next), ps.next_rank,
                                ACT_TAG + SHAPE_TAG_OFFSET))
        if recv_p is not None:
            ops.append(self._op(dist.irecv, recv_p, ps.prev_rank, ACT_TAG + SHAPE_TAG_OFFSET))
        if send_prev is not None:
            ops.append(self._op(dist.isend, encode(send_prev), ps.prev_rank,
                                GRAD_TAG + SHAPE_TAG_OFFSET))
        if recv_n is not None:
            ops.append(self._op(dist.irecv, recv_n, ps.next_rank, GRAD_TAG + SHAPE_TAG_OFFSET))
        self._run(ops)
        decode = lambda s: tuple(int(x) for x in s[1:1 + int(s[0])].tolist())  # noqa: E731
        return (decode(recv_p) if recv_p is not None else None,
                decode(recv_n) if recv_n is not None else None)

    # ---- what the schedules call ---------------------------------------------------------
    def recv_forward(self):
        """Activation from the previous stage (None on the first stage)."""
        if self.ps.is_first_stage:
            return None
        return self.communicate(recv_prev=True)[0]

    def recv_backward(self):
        """Gradient from the next stage (None on the last stage)."""
        if self.ps.is_last_stage:
            return None
        return self.communicate(recv_next=True)[1]

    def send_forward(self, output):
        if not self.ps.is_last_stage and output is not None:
            self.communicate(send_next=output)

    def send_backward(self, input_grad):
        if not self.ps.is_first_stage and input_grad is not None:
            self.communicate(send_prev=input_grad)

    def send_forward_recv_backward(self, output):
        if self.ps.is_last_stage:
            return None
        return self.communicate(send_next=output, recv_next=True)[1]

    def send_backward_recv_forward(self, input_grad):
        if self.ps.is_first_stage:
            return None
        return self.communicate(send_prev=input_grad, recv_prev=True)[0]
