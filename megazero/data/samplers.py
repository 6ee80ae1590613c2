"""Pretraining batch sampler driven by ``consumed_samples`` and sharded over data-parallel ranks.

Megatron's ``MegatronPretrainingSampler``: the dataset is read in order from index
``consumed_samples``; each step of ``micro_batch_size * dp_size`` consecutive indices is split
into ``dp_size`` contiguous slices, rank ``r`` taking slice ``r``. Example, micro-batch 2, dp 2,
consumed 0: rank 0 gets [0, 1], [4, 5], ...; rank 1 gets [2, 3], [6, 7], .... A run resumed
with ``consumed_samples = N`` (the count saved in the checkpoint) continues with exactly the
samples ``N, N+1, ...`` whatever the dp size. Samples are already shuffled by the GPT dataset's
``shuffle_idx``, so the sampler need not shuffle. Data knows dp rank and size only as integers.
"""

from __future__ import annotations

import torch


class MegatronPretrainingSampler:
    """Yields this dp rank's list of dataset indices for each micro-batch."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True):
        if total_samples <= 0:
            raise ValueError(f"no sample to consume: the dataset has {total_samples} samples")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(f"no samples left to consume: consumed_samples={consumed_samples}, "
                             f"dataset size {total_samples}")
        if micro_batch_size <= 0:
            raise ValueError(f"--micro-batch-size must be > 0, got {micro_batch_size}")
        if data_parallel_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} must be in "
                             f"[0, {data_parallel_size})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.drop_last = drop_last
        self.step = micro_batch_size * data_parallel_size

    def __len__(self) -> int:
        """Number of micro-batches this rank yields."""
        remaining = self.total_samples - self.consumed_samples
        full = remaining // self.step
        if self.drop_last:
            return full
        rest = remaining - full * self.step
        return full + int(rest > self.data_parallel_rank * self.micro_batch_size)

    def _slice(self, start: int, stop: int) -> list[int]:
        lo = start + self.data_parallel_rank * self.micro_batch_size
        return list(range(lo, min(lo + self.micro_batch_size, stop)))

    def __iter__(self):
        start = self.consumed_samples
        while start + self.step <= self.total_samples:
            yield self._slice(start, start + self.step)
            start += self.step
        if start < self.total_samples and not self.drop_last:
            batch = self._slice(start, self.total_samples)
            if batch:
                yield batch


def build_pretraining_data_loader(dataset, consumed_samples: int, micro_batch_size: int,
                                  dp_rank: int, dp_size: int, num_workers: int = 0,
                                  drop_last: bool = True):
    """DataLoader yielding ``{"text": LongTensor[b, s+1]}`` for this dp rank (None for None)."""
    if dataset is None:
        return None
    sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                         dp_rank, dp_size, drop_last=drop_last)
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                       pin_memory=torch.cuda.is_available(),
                                       persistent_workers=num_workers > 0)
