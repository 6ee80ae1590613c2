"""Where data-parallel gradients live between backward and the step: two strategies.

Both work on the ``FlatLayout`` of the optimizer (buckets split into dp chunks, rank r owning
chunk r of each bucket when the layout is sharded) and give the bucket reducer
(``reducer.BucketReducer``) the same four operations: ``collect`` a parameter's gradient when
autograd finished it, the ``reduce_input`` and ``reduce_output`` of a bucket, ``reduced``
(take the collective's output), ``release`` (the collective is over: its buffers may be
reused) and ``owned`` (this rank's reduced gradient of a segment, what the step reads).

* ``FullGradBuffer`` (ZeRO stages 0 and 1): one flat buffer for every gradient; each
  parameter's ``.grad`` is a view into it, so autograd accumulates micro-batches in place and
  a bucket is reduced once, after the last micro-batch. A sharded layout (stage 1) writes the
  reduce-scattered owned chunk back into the buffer; an unsharded one all-reduces in place.
* ``PartitionGradBuffer`` (stages 2 and 3): only this rank's owned partition exists. Each
  micro-batch's gradient is copied into a bucket-sized staging buffer as it becomes ready, the
  bucket is reduced as soon as it is complete, the owned part is added into the partition and
  ``.grad`` is freed; no full gradient buffer exists.

Reduce-scatters run in place (the owned chunk of the reduced buffer is the output). Staging
buffers come from a ``SlotPool``: slots of the largest bucket's size, allocated the first time
that many are in use at once and reused afterwards (a fresh buffer per bucket and backward
costs its page faults every time, and the allocator may keep the pages). How many are in use
at once is bounded by the reducer (the buckets in flight plus those being filled).

Nothing here communicates.
"""

from __future__ import annotations

import torch

from megazero.data_parallel.layout import Bucket, FlatLayout, ParamRange, Segment


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class SlotPool:
    """Reusable flat buffers of ``numel`` elements (``take``/``give``); never freed."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        self.numel, self.dtype, self.device = numel, dtype, device
        self.slots: list[torch.Tensor] = []
        self.free: list[torch.Tensor] = []

    def take(self) -> torch.Tensor:
        if self.free:
            return self.free.pop()
        slot = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        self.slots.append(slot)
        return slot

    def give(self, slot: torch.Tensor) -> None:
        self.free.append(slot)

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(t) for t in self.slots)


class FullGradBuffer:
    """Stages 0-1: the whole layout's gradients in one flat buffer (``.grad`` are views)."""

    reduces_every_microbatch = False  # ``no_sync`` holds the reduction to the last one

    def __init__(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device):
        self.layout = layout
        self.buffer = torch.zeros(layout.numel, dtype=dtype, device=device)

    def zero(self) -> None:
        self.buffer.zero_()
        for pr in self.layout.ranges.values():
            pr.param.grad = self.buffer[pr.start:pr.end].view(pr.param.shape)

    def collect(self, pr: ParamRange, bucket: Bucket) -> None:
        """Nothing to do: autograd accumulated the gradient into the buffer already."""

    def reduce_input(self, bucket: Bucket) -> torch.Tensor:
        return self.buffer[bucket.start:bucket.end]

    def reduce_output(self, bucket: Bucket) -> torch.Tensor:
        """The reduce-scatter leaves the owned chunk in place (sharded layouts only)."""
        return self.owned_chunk(bucket)

    def reduced(self, bucket: Bucket, out: torch.Tensor) -> None:
        """Nothing to do: the bucket was all-reduced, or its owned chunk reduce-scattered,
        in place."""

    def release(self, bucket: Bucket) -> None:
        """Nothing was taken."""

    def owned(self, seg: Segment) -> torch.Tensor:
        return self.buffer[seg.start:seg.end]

    def owned_chunk(self, bucket: Bucket) -> torch.Tensor:
        c0, c1 = self.layout.owned_chunk(bucket)
        return self.buffer[c0:c1]

    @property
    def nbytes(self) -> int:
        return _nbytes(self.buffer)

    staging_nbytes = 0  # reductions run in place

    def tensors(self) -> list[torch.Tensor]:
        """The storage behind every gradient (memory accounting)."""
        return [self.buffer]

    def staging_tensors(self) -> list[torch.Tensor]:
        return []


class PartitionGradBuffer:
    """Stages 2-3: only the owned partition of the gradients, filled bucket by bucket."""

    reduces_every_microbatch = True  # staging buffers are reduced as soon as complete

    def __init__(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device):
        self.layout, self.dtype = layout, dtype
        self.partition = torch.zeros(layout.partition_numel, dtype=dtype, device=device)
        self.offsets = layout.bucket_owned_offsets()  # bucket -> [o0, o1) in the partition
        # one slot holds a bucket's gradients; the reduce-scatter leaves the owned chunk
        # in place, in the slot
        self.slots = SlotPool(max((b.numel for b in layout.buckets), default=0), dtype, device)
        self._staging: dict[int, tuple[torch.Tensor, list]] = {}  # bucket -> (slot, filled)
        # bucket -> slots of its reductions in flight, oldest first: the next micro-batch's
        # gradients of a bucket go to a fresh slot while the previous one is still reduced
        self._inflight: dict[int, list[torch.Tensor]] = {}

    def zero(self) -> None:
        self.partition.zero_()
        for pr in self.layout.ranges.values():
            pr.param.grad = None

    def collect(self, pr: ParamRange, bucket: Bucket) -> None:
        """Copy this micro-batch's gradient into the bucket's staging buffer; free ``.grad``."""
        entry = self._staging.get(bucket.index)
        if entry is None:
            entry = self._staging[bucket.index] = (self.slots.take(), [])
        slot, filled = entry
        off = pr.start - bucket.start
        slot[off:off + pr.numel].copy_(pr.param.grad.reshape(-1))
        filled.append((off, pr.numel))
        pr.param.grad = None  # only the owned slice is kept

    def reduce_input(self, bucket: Bucket) -> torch.Tensor:
        """The staging buffer; ranges no gradient arrived for (unused parameters) are zeroed
        (a reused slot holds an earlier bucket's values). The slot is in flight from here."""
        slot, filled = self._staging.pop(bucket.index)
        self._inflight.setdefault(bucket.index, []).append(slot)
        staging = slot[:bucket.numel]
        if sum(n for _, n in filled) != bucket.numel:
            at = 0
            for off, n in sorted(filled) + [(bucket.numel, 0)]:
                if off > at:
                    staging[at:off].zero_()
                at = max(at, off + n)
        return staging

    def reduce_output(self, bucket: Bucket) -> torch.Tensor:
        c0, c1 = self.layout.owned_chunk(bucket)
        slot = self._inflight[bucket.index][-1]
        return slot[c0 - bucket.start:c1 - bucket.start]

    def reduced(self, bucket: Bucket, out: torch.Tensor) -> None:
        """Add the bucket's reduced owned chunk (the whole bucket when unsharded)."""
        o0, o1 = self.offsets[bucket.index]
        self.partition[o0:o1].add_(out)

    def release(self, bucket: Bucket) -> None:
        """The oldest reduction of ``bucket`` is complete: its slot is free."""
        slots = self._inflight.get(bucket.index)
        if slots:
            self.slots.give(slots.pop(0))

    def owned(self, seg: Segment) -> torch.Tensor:
        return self.partition[seg.offset:seg.offset + seg.numel]

    def owned_chunk(self, bucket: Bucket) -> torch.Tensor:
        o0, o1 = self.offsets[bucket.index]
        return self.partition[o0:o1]

    @property
    def nbytes(self) -> int:
        return _nbytes(self.partition)

    @property
    def staging_nbytes(self) -> int:
        return self.slots.nbytes

    def tensors(self) -> list[torch.Tensor]:
        """The storage behind the owned gradients (memory accounting)."""
        return [self.partition]

    def staging_tensors(self) -> list[torch.Tensor]:
        return list(self.slots.slots)


def grad_storage(stage: int, layout: FlatLayout, dtype: torch.dtype, device: torch.device):
    """The strategy of ZeRO ``stage``: the full buffer for 0-1, the owned partition for 2-3."""
    cls = FullGradBuffer if stage < 2 else PartitionGradBuffer
    return cls(layout, dtype, device)
