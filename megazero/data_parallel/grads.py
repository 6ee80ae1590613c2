"""Where data-parallel gradients live between backward and the step: two strategies.

Both work on the ``FlatLayout`` of the optimizer (buckets split into dp chunks, rank r owning
chunk r of each bucket when the layout is sharded) and give the bucket reducer
(``reducer.BucketReducer``) the same four operations: ``collect`` a parameter's gradient when
autograd finished it, the ``reduce_input`` of a bucket, ``reduced`` (take the collective's
output), and ``owned`` (this rank's reduced gradient of a segment, what the step reads).

* ``FullGradBuffer`` (ZeRO stages 0 and 1): one flat buffer for every gradient; each
  parameter's ``.grad`` is a view into it, so autograd accumulates micro-batches in place and
  a bucket is reduced once, after the last micro-batch. A sharded layout (stage 1) writes the
  reduce-scattered owned chunk back into the buffer; an unsharded one all-reduces in place.
* ``PartitionGradBuffer`` (stages 2 and 3): only this rank's owned partition exists. Each
  micro-batch's gradient is copied into a bucket-sized staging buffer as it becomes ready, the
  bucket is reduced as soon as it is complete, the owned part is added into the partition and
  ``.grad`` is freed; no full gradient buffer exists.

Nothing here communicates.
"""

from __future__ import annotations

import torch

from megazero.data_parallel.layout import Bucket, FlatLayout, ParamRange, Segment


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


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

    def reduced(self, bucket: Bucket, out: torch.Tensor) -> None:
        """``out``: the all-reduced bucket (in place) or its reduce-scattered owned chunk."""
        if self.layout.shard:
            c0, c1 = self.layout.owned_chunk(bucket)
            self.buffer[c0:c1].copy_(out)

    def owned(self, seg: Segment) -> torch.Tensor:
        return self.buffer[seg.start:seg.end]

    def owned_chunk(self, bucket: Bucket) -> torch.Tensor:
        c0, c1 = self.layout.owned_chunk(bucket)
        return self.buffer[c0:c1]

    @property
    def nbytes(self) -> int:
        return _nbytes(self.buffer)

    def tensors(self) -> list[torch.Tensor]:
        """The storage behind every gradient (memory accounting)."""
        return [self.buffer]


class PartitionGradBuffer:
    """Stages 2-3: only the owned partition of the gradients, filled bucket by bucket."""

    reduces_every_microbatch = True  # staging buffers are reduced as soon as complete

    def __init__(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device):
        self.layout, self.dtype = layout, dtype
        self.partition = torch.zeros(layout.partition_numel, dtype=dtype, device=device)
        self.offsets = layout.bucket_owned_offsets()  # bucket -> [o0, o1) in the partition
        self._staging: dict[int, torch.Tensor] = {}

    def zero(self) -> None:
        self.partition.zero_()
        for pr in self.layout.ranges.values():
            pr.param.grad = None

    def collect(self, pr: ParamRange, bucket: Bucket) -> None:
        """Copy this micro-batch's gradient into the bucket's staging buffer; free ``.grad``."""
        staging = self._staging.get(bucket.index)
        if staging is None:
            staging = torch.zeros(bucket.numel, dtype=self.dtype, device=pr.param.device)
            self._staging[bucket.index] = staging
        off = pr.start - bucket.start
        staging[off:off + pr.numel].copy_(pr.param.grad.reshape(-1))
        pr.param.grad = None  # only the owned slice is kept

    def reduce_input(self, bucket: Bucket) -> torch.Tensor:
        return self._staging.pop(bucket.index)

    def reduced(self, bucket: Bucket, out: torch.Tensor) -> None:
        """Add the bucket's reduced owned chunk (the whole bucket when unsharded)."""
        o0, o1 = self.offsets[bucket.index]
        self.partition[o0:o1].add_(out)

    def owned(self, seg: Segment) -> torch.Tensor:
        return self.partition[seg.offset:seg.offset + seg.numel]

    def owned_chunk(self, bucket: Bucket) -> torch.Tensor:
        o0, o1 = self.offsets[bucket.index]
        return self.partition[o0:o1]

    @property
    def nbytes(self) -> int:
        return _nbytes(self.partition)

    def tensors(self) -> list[torch.Tensor]:
        """The storage behind the owned gradients (memory accounting)."""
        return [self.partition]


def grad_storage(stage: int, layout: FlatLayout, dtype: torch.dtype, device: torch.device):
    """The strategy of ZeRO ``stage``: the full buffer for 0-1, the owned partition for 2-3."""
    cls = FullGradBuffer if stage < 2 else PartitionGradBuffer
    return cls(layout, dtype, device)
