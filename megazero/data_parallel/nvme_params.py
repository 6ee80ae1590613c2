"""ZeRO-Infinity's parameter offload to NVMe (``--offload-param nvme``, ZeRO stage 3): this
rank's chunk of every unit bucket of the dp-partitioned parameters lives in a file, not in
memory; only the persistent bucket (parameters at or below
``--zero-param-persistence-threshold``) stays resident.

``SwappedParams`` is ``zero3.PartitionedParams`` with the unit chunks in
``DIR/megazero-params-<host>-<rank>-<pid>-<random>/params.bin`` (model dtype, each bucket's
chunk at an ``ALIGN``-aligned offset so that the I/O engine moves it with O_DIRECT):

* ``owned_chunk(bucket)`` reads the chunk into a fresh aligned host buffer (then onto the
  device) and returns it: a snapshot the ZeRO-3 gatherer all-gathers over ``ps.dp_group``
  (at dp 1, the snapshot is the bucket), then drops when the unit is released. A unit is
  read when it is gathered or prefetched, so the read of unit n + 1 happens before unit n
  computes and its all-gather overlaps that compute.
* ``write(bucket, offset, values)`` changes a chunk through a write-back buffer of one
  bucket (the optimizer's step writes in partition order: each chunk is read and written
  once per step); ``flush()`` writes it back. Every writer (the step, checkpoint loads,
  ``GatheredParameters(modifier_rank=...)``) flushes before it returns.

The swap files are scratch, removed when the storage is collected or the process exits;
checkpoints are written from the snapshots as usual (layout-free), so they load with or
without NVMe at any layout. The fp32 main values must live elsewhere: ``--offload-param
nvme`` goes with ``--offload-optimizer cpu|nvme``.
"""

from __future__ import annotations

import os
import shutil

import torch

from megazero.data_parallel.nvme import NvmeZeroOptimizer, remove_at_exit, swap_directory
from megazero.data_parallel.zero3 import PartitionedParams, Zero3Optimizer
from megazero.ops.aio import ALIGN, AsyncIO, aligned_empty


class SwappedParams(PartitionedParams):
    """This rank's unit chunks in a swap file under ``nvme_path`` (see the module docstring)."""

    swapped = True

    def __init__(self, layout, persistent_bucket, dtype, device, *, fill, nvme_path: str,
                 rank: int, num_threads: int = 4, block_size: int = 1 << 20):
        self.swap_dir = swap_directory(nvme_path, "params", rank)
        remove_at_exit(self, self.swap_dir)
        self.path = os.path.join(self.swap_dir, "params.bin")
        self.aio = AsyncIO(num_threads=num_threads, block_size=block_size)
        self._dirty = None  # (bucket index, host buffer) of the write-back buffer
        self.bytes_read = self.bytes_written = 0
        super().__init__(layout, persistent_bucket, dtype, device, fill=fill)

    def _store_units(self, fill) -> None:
        """Each unit bucket's chunk built in an aligned buffer and written to the file."""
        self.partition = None
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        self.file_offsets, offset = {}, 0
        for bucket in self.layout.buckets:
            if bucket.index == self.persistent_bucket:
                continue
            o0, o1 = self.offsets[bucket.index]
            self.file_offsets[bucket.index] = offset
            offset += -(-(o1 - o0) * itemsize // ALIGN) * ALIGN
        self.file_bytes = offset
        segments = {}
        for seg in self.layout.segments:
            segments.setdefault(seg.bucket, []).append(seg)
        for b in self.file_offsets:
            o0, o1 = self.offsets[b]
            chunk = aligned_empty(o1 - o0, self.dtype).zero_()
            for seg in segments.get(b, []):
                fill(seg.name, seg.param, chunk[seg.offset - o0:seg.offset - o0 + seg.numel],
                     seg.param_start)
            self._io(write=True, host=chunk, bucket_index=b)

    def _io(self, write: bool, host: torch.Tensor, bucket_index: int) -> None:
        offset = self.file_offsets[bucket_index]
        submit = self.aio.submit_write if write else self.aio.submit_read
        self.aio.wait(submit(host, self.path, offset))
        nbytes = host.numel() * host.element_size()
        if write:
            self.bytes_written += nbytes
        else:
            self.bytes_read += nbytes

    def _read_host(self, bucket) -> torch.Tensor:
        o0, o1 = self.offsets[bucket.index]
        host = aligned_empty(o1 - o0, self.dtype)
        self._io(write=False, host=host, bucket_index=bucket.index)
        return host

    def owned_chunk(self, bucket) -> torch.Tensor:
        if bucket.index == self.persistent_bucket:
            return super().owned_chunk(bucket)
        if self._dirty is not None and self._dirty[0] == bucket.index:
            host = self._dirty[1].clone()
        else:
            host = self._read_host(bucket)
        return host if self.device.type == "cpu" else host.to(self.device)

    def write(self, bucket, offset: int, values: torch.Tensor) -> None:
        if bucket.index == self.persistent_bucket:
            super().write(bucket, offset, values)
            return
        if self._dirty is None or self._dirty[0] != bucket.index:
            self.flush()
            self._dirty = (bucket.index, self._read_host(bucket))
        self._dirty[1][offset:offset + values.numel()].copy_(values)

    def flush(self) -> None:
        if self._dirty is not None:
            b, host = self._dirty
            self._dirty = None
            self._io(write=True, host=host, bucket_index=b)

    @property
    def nbytes(self) -> int:
        """Bytes resident between gathers: the persistent bucket only."""
        t = self.persist_buffer
        return 0 if t is None else t.numel() * t.element_size()

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.persist_buffer,) if t is not None]

    def close(self) -> None:
        """Stop the I/O threads and remove the swap files (the values are gone)."""
        self._dirty = None
        self.aio.close()
        shutil.rmtree(self.swap_dir, ignore_errors=True)


class NvmeZero3Optimizer(Zero3Optimizer, NvmeZeroOptimizer):
    """ZeRO-3 with the optimizer states on NVMe (``--zero-stage 3 --offload-optimizer nvme``),
    and the parameters too with ``storage_factory=swapped_params(...)``: ``Zero3Optimizer``'s
    layout, storage and gatherer, ``NvmeZeroOptimizer``'s streamed step and checkpoints."""


def swapped_params(opt_config, ps):
    """The ``storage_factory`` of ``--offload-param nvme`` for ``Zero3Optimizer``."""
    def build(layout, persistent_bucket, dtype, device, *, fill):
        return SwappedParams(layout, persistent_bucket, dtype, device, fill=fill,
                             nvme_path=opt_config.nvme_path, rank=ps.rank,
                             num_threads=opt_config.nvme_threads,
                             block_size=opt_config.nvme_block_size)
    return build


__all__ = ["NvmeZero3Optimizer", "SwappedParams", "swapped_params"]
