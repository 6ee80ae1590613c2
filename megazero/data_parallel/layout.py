"""Flat-buffer layout of parameters, cut into buckets and data-parallel shards.

Parameters are placed back to back in one flat buffer per dtype, grouped into buckets (the unit
of one reduce-scatter / all-gather). Each bucket is padded to a multiple of ``dp * align`` and
split into ``dp`` equal chunks: data-parallel rank r owns chunk r of every bucket (as in
Megatron's distributed optimizer). A parameter may straddle chunks and buckets may hold many
parameters. ZeRO-1/2 use buckets of ``--zero-reduce-bucket-size`` elements, by default
``default_bucket_size``: several per model, so that reductions overlap the backward; ZeRO-3
uses one bucket per module so a layer can be gathered on its own; ZeRO-0 owns everything.

``Segment`` is a piece of one parameter inside this rank's owned chunk: the unit the optimizer
updates, and what checkpoints record (parameter name, flat range within the parameter).
``FlatParams`` is the parameter storage of stages 0-2 over a layout: one flat buffer the
parameters are views of. Nothing here communicates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megazero.tensor_parallel.meta import meta_of

BUCKETS_PER_MODEL = 8  # default: the model in about this many buckets, ...
MIN_BUCKET = 1_000_000  # ... of at least this many elements (smaller ones cost latency) ...
MAX_BUCKET = 40_000_000  # ... and at most Megatron's default (or 1M per dp rank, if more)


def default_bucket_size(numel: int, dp_size: int) -> int:
    """Elements per gradient bucket for a model of ``numel`` elements (this rank's stage):
    ``numel / BUCKETS_PER_MODEL`` within [``MIN_BUCKET``, max(``MAX_BUCKET``, 1M x dp)], so
    a bucket's reduce-scatter overlaps the backward of the buckets after it and no
    collective is latency-bound."""
    cap = max(MAX_BUCKET, 1_000_000 * dp_size)
    return max(MIN_BUCKET, min(cap, -(-numel // BUCKETS_PER_MODEL)))


def param_numel(p) -> int:
    """Elements of a parameter's local tensor (its recorded shape when its storage is
    partitioned away, as under ZeRO-3)."""
    return meta_of(p).numel


@dataclass
class ParamRange:
    name: str
    param: torch.nn.Parameter
    start: int  # offset in the flat buffer
    numel: int
    bucket: int

    @property
    def end(self) -> int:
        return self.start + self.numel


@dataclass
class Bucket:
    index: int
    start: int  # offset in the flat buffer (multiple of dp * align)
    end: int  # padded end
    params: list[ParamRange] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return self.end - self.start

    def chunk(self, dp_rank: int, dp_size: int) -> tuple[int, int]:
        size = self.numel // dp_size
        return self.start + dp_rank * size, self.start + (dp_rank + 1) * size


@dataclass
class Segment:
    """The part ``[param_start, param_end)`` (flat, within the local parameter) of one
    parameter that lies in this rank's owned chunk at ``[start, end)`` of the flat buffer;
    ``offset`` is its position in the rank's partition (its owned chunks, padding included,
    concatenated in bucket order)."""

    name: str
    param: torch.nn.Parameter
    start: int
    end: int
    param_start: int
    param_end: int
    offset: int
    bucket: int = 0
    chunk_offset: int = 0  # position inside this bucket's owned chunk

    @property
    def numel(self) -> int:
        return self.end - self.start


class FlatLayout:
    """Placement of ``named_params`` (in the given order) into buckets and dp shards.

    ``buckets`` is a list of lists of names (each becomes one bucket, in that order), or
    ``None`` to cut greedily at ``bucket_size`` elements. ``own_bucket`` names parameters that
    must sit alone in their bucket (so two pipeline stages holding them lay them out alike).
    """

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], dp_size: int,
                 dp_rank: int, *, bucket_size: int | None = None,
                 buckets: list[list[str]] | None = None, own_bucket: set[str] | None = None,
                 align: int = 16, shard: bool = True):
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.shard = shard
        self.align = align
        by_name = dict(named_params)
        if buckets is None:
            buckets = self._greedy_buckets(named_params, bucket_size, own_bucket or set())
        self.buckets: list[Bucket] = []
        self.ranges: dict[str, ParamRange] = {}
        offset = 0
        unit = (dp_size if shard else 1) * align
        for bi, names in enumerate(buckets):
            bucket = Bucket(bi, offset, offset)
            pos = offset
            for name in names:
                p = by_name[name]
                pr = ParamRange(name, p, pos, param_numel(p), bi)
                bucket.params.append(pr)
                self.ranges[name] = pr
                pos += pr.numel
            bucket.end = offset + max(unit, -(-(pos - offset) // unit) * unit)
            offset = bucket.end
            self.buckets.append(bucket)
        self.numel = offset
        self.segments = self._owned_segments()
        self.owned_numel = sum(s.numel for s in self.segments)

    @staticmethod
    def _greedy_buckets(named_params, bucket_size, own_bucket):
        buckets, current, size = [], [], 0
        for name, p in named_params:
            if name in own_bucket:
                if current:
                    buckets.append(current)
                    current, size = [], 0
                buckets.append([name])
                continue
            n = param_numel(p)
            if bucket_size is not None and current and size + n > bucket_size:
                buckets.append(current)  # at most bucket_size, unless one parameter is more
                current, size = [], 0
            current.append(name)
            size += n
        if current:
            buckets.append(current)
        return buckets

    def owned_chunk(self, bucket: Bucket) -> tuple[int, int]:
        if not self.shard:
            return bucket.start, bucket.end
        return bucket.chunk(self.dp_rank, self.dp_size)

    def _owned_segments(self) -> list[Segment]:
        segments, base = [], 0
        for bucket in self.buckets:
            c0, c1 = self.owned_chunk(bucket)
            for pr in bucket.params:
                a, b = max(pr.start, c0), min(pr.end, c1)
                if a < b:
                    segments.append(Segment(pr.name, pr.param, a, b, a - pr.start,
                                            b - pr.start, base + a - c0, bucket.index, a - c0))
            base += c1 - c0
        return segments

    def bucket_owned_offsets(self) -> list[tuple[int, int]]:
        """For each bucket, the [start, end) of its owned chunk inside the owned partition.

        Padding counts: the owned partition is the concatenation of owned chunks.
        """
        out, offset = [], 0
        for bucket in self.buckets:
            c0, c1 = self.owned_chunk(bucket)
            out.append((offset, offset + (c1 - c0)))
            offset += c1 - c0
        return out

    @property
    def partition_numel(self) -> int:
        """Elements of the owned partition including padding (sum of owned chunks)."""
        return sum(c1 - c0 for c0, c1 in map(self.owned_chunk, self.buckets))


class FlatParams:
    """Every parameter as a view of one flat buffer (stages 0-2): the owned chunk of a bucket
    is updated in place by the step, then the full bucket is all-gathered."""

    def __init__(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device):
        self.layout = layout
        self.buffer = torch.zeros(layout.numel, dtype=dtype, device=device)
        for pr in layout.ranges.values():
            view = self.buffer[pr.start:pr.end]
            view.copy_(pr.param.data.reshape(-1))
            pr.param.data = view.view(pr.param.shape)

    def owned_chunk(self, bucket) -> torch.Tensor:
        c0, c1 = self.layout.owned_chunk(bucket)
        return self.buffer[c0:c1]

    def write(self, bucket, offset: int, values: torch.Tensor) -> None:
        """Owned chunk of ``bucket``, elements [offset, offset + numel) = ``values``."""
        self.owned_chunk(bucket)[offset:offset + values.numel()].copy_(values,
                                                                         non_blocking=True)

    def flush(self) -> None:
        """Writes are complete (nothing is held back here)."""

    def replicated_buckets(self):
        """Buckets whose full parameters every rank holds (all-gathered after the step)."""
        return self.layout.buckets

    def full_bucket(self, bucket) -> torch.Tensor:
        return self.buffer[bucket.start:bucket.end]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def tensors(self) -> list[torch.Tensor]:
        """The storage behind every parameter (memory accounting)."""
        return [self.buffer]
