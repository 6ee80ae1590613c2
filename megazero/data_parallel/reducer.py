"""Data-parallel gradient reduction, bucket by bucket, over the dp group.

A bucket of the ``FlatLayout`` is reduced once all its parameters' gradients are ready:
all-reduced when the layout is not sharded (ZeRO-0, or dp = 1), reduce-scattered into this
rank's owned chunk when it is (ZeRO 1-3). Where the gradients live and what happens to the
result is the gradient storage's business (``grads``); this module only counts readiness and
runs the collectives, synchronously or, with ``overlap`` (``--overlap-grad-reduce``, the
default), asynchronously while the rest of the backward runs. At most ``max_in_flight``
asynchronous reductions are outstanding: posting one more first completes the oldest, so the
staging buffers in use stay bounded; the rest are completed at the end of the accumulation.
Both paths run the same collective on the same buffers, so their results are bit-identical.

When gradients become ready in backward (post-accumulate-grad hooks, registered when the
storage reduces every micro-batch or when ``overlap`` is on), a bucket is reduced as soon as
it is complete. Inside ``no_sync`` the full-buffer storage lets gradients accumulate and
``reduce_remaining`` reduces what is left at the accumulation boundary. Per bucket the state
is a readiness count and a separate "reduced in this backward" flag.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megazero.data_parallel.layout import Bucket, FlatLayout, ParamRange
from megazero.distributed import comm


def _call(ref: weakref.ref, method: str, *args) -> None:
    """``ref().method(*args)`` if the referent still lives (a hook outliving its owner)."""
    owner = ref()
    if owner is not None:
        getattr(owner, method)(*args)


@dataclass
class _Pending:
    """An asynchronous reduction in flight: wait, then hand the result to the storage."""

    work: object
    bucket: Bucket
    out: torch.Tensor


class BucketReducer:
    """Counts gradient readiness per bucket and reduces complete buckets over ``dp_group``.

    ``before_reduce(bucket)`` runs before each collective and returns the ``OrderCheck`` it
    carries, or None (ZeRO-3's order check);
    ``after_reduce(bucket)`` once the bucket's gradients have left (ZeRO-3 releases the
    unit's parameters); ``end_of_backward()`` runs after each backward (ZeRO-3 releases
    everything gathered).
    """

    def __init__(self, layout: FlatLayout, grads, dp_group, *, overlap: bool,
                 max_in_flight: int = 1,
                 before_reduce: Callable[[Bucket], object] | None = None,
                 after_reduce: Callable[[Bucket], None] | None = None,
                 end_of_backward: Callable[[], None] | None = None):
        self.layout, self.grads, self.dp_group = layout, grads, dp_group
        self.overlap, self.max_in_flight = overlap, max(1, max_in_flight)
        self.before_reduce, self.after_reduce = before_reduce, after_reduce
        self.end_of_backward = end_of_backward
        self.in_no_sync = False
        self.suspended = False  # no dp reduction at all (1-bit Adam after its freeze step)
        n = len(layout.buckets)
        self.ready = [0] * n  # gradients collected per bucket in this backward
        self.done = [False] * n  # reduced in this backward (late hooks are ignored)
        self._pending: list[_Pending] = []
        self._callback_queued = False
        self._hooks = []
        if grads.reduces_every_microbatch or overlap:
            # The hooks hold the reducer weakly: a strong reference would close a cycle
            # (parameter -> hook -> reducer -> layout -> parameter) through the tensor's hook
            # dict, which the garbage collector does not break, and keep ``dp_group`` (its gloo
            # threads) alive past ``destroy_process_group`` into interpreter teardown.
            ref = weakref.ref(self)
            for pr in layout.ranges.values():
                self._hooks.append(pr.param.register_post_accumulate_grad_hook(
                    lambda p, pr=pr: _call(ref, "_on_grad_ready", pr)))

    def reset(self) -> None:
        n = len(self.layout.buckets)
        self.ready, self.done = [0] * n, [False] * n

    # ---- in backward ---------------------------------------------------------------------
    def _on_grad_ready(self, pr: ParamRange) -> None:
        if self.suspended or (not self.grads.reduces_every_microbatch and self.in_no_sync):
            return
        if self.done[pr.bucket]:
            return
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        bucket = self.layout.buckets[pr.bucket]
        self.grads.collect(pr, bucket)
        self.ready[bucket.index] += 1
        if self.ready[bucket.index] == len(bucket.params):
            self.reduce(bucket, async_op=self.overlap)

    def _backward_done(self) -> None:
        self._callback_queued = False
        if self.grads.reduces_every_microbatch:
            # buckets whose parameters did not all get gradients: reduce what they hold
            for bucket in self.layout.buckets:
                if not self.done[bucket.index] and 0 < self.ready[bucket.index]:
                    self.reduce(bucket, async_op=False)
            self.reset()
        if self.end_of_backward is not None:
            self.end_of_backward()

    # ---- the collectives -----------------------------------------------------------------
    def reduce(self, bucket: Bucket, async_op: bool) -> None:
        order = self.before_reduce(bucket) if self.before_reduce is not None else None
        self.done[bucket.index] = True
        if async_op and len(self._pending) >= self.max_in_flight:
            self._complete(self._pending.pop(0))
        src = self.grads.reduce_input(bucket)
        if self.layout.shard:
            out = self.grads.reduce_output(bucket)
            work = comm.reduce_scatter_into(out, src, self.dp_group, async_op=async_op,
                                            overwrite_input=True, order=order)
        else:
            if order is not None:
                comm.communicator_of(self.dp_group).check_order(self.dp_group, order, src)
            out = src
            work = comm.all_reduce(src, self.dp_group, async_op=async_op)
        if work is not None and async_op:
            self._pending.append(_Pending(work, bucket, out))
        else:
            self.grads.reduced(bucket, out)
            self.grads.release(bucket)
        if self.after_reduce is not None:
            self.after_reduce(bucket)

    def reduce_remaining(self) -> None:
        """At the accumulation boundary: reduce every bucket no hook reduced."""
        if self.suspended:
            return
        for bucket in self.layout.buckets:
            if not self.done[bucket.index]:
                self.reduce(bucket, async_op=False)

    def _complete(self, p: _Pending) -> None:
        p.work.wait()
        self.grads.reduced(p.bucket, p.out)
        self.grads.release(p.bucket)

    def wait(self) -> None:
        pending, self._pending = self._pending, []
        for p in pending:
            self._complete(p)
