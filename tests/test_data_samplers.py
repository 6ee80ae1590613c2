"""Pretraining sampler: dp sharding, resume from consumed_samples, and the data loader."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megazero.data.samplers import MegatronPretrainingSampler, build_pretraining_data_loader


class Toy(torch.utils.data.Dataset):
    def __init__(self, n, s=4):
        self.n, self.s = n, s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"text": np.arange(i, i + self.s + 1, dtype=np.int64)}


def megatron_batches(total, consumed, mb, rank, dp, drop_last=True):
    """Megatron's sampler loop, typed independently."""
    out, batch = [], []
    for idx in range(consumed, total):
        batch.append(idx)
        if len(batch) == mb * dp:
            out.append(batch[rank * mb:(rank + 1) * mb])
            batch = []
    if batch and not drop_last:
        out.append(batch[rank * mb:(rank + 1) * mb])
    return [b for b in out if b]


@pytest.mark.parametrize("total,consumed,mb,dp", [(100, 0, 2, 2), (103, 7, 3, 4), (50, 49, 1, 1),
                                                   (64, 10, 4, 1)])
@pytest.mark.parametrize("drop_last", [True, False])
def test_matches_megatron(total, consumed, mb, dp, drop_last):
    for rank in range(dp):
        sampler = MegatronPretrainingSampler(total, consumed, mb, rank, dp, drop_last)
        got = list(sampler)
        assert got == megatron_batches(total, consumed, mb, rank, dp, drop_last)
        assert len(sampler) == len(got)


def test_global_steps_are_consecutive_and_resume_exactly():
    total, mb, dp = 200, 2, 3
    steps = [list(zip(*[MegatronPretrainingSampler(total, 0, mb, r, dp) for r in range(dp)]))]
    flat = [i for step in steps[0] for part in step for i in part]
    assert flat == list(range(len(flat)))  # rank r's slice of step k: k*mb*dp + r*mb + [0, mb)
    for consumed in (0, 6, 60, 192):
        resumed = [i for step in zip(*[MegatronPretrainingSampler(total, consumed, mb, r, dp)
                                       for r in range(dp)]) for part in step for i in part]
        assert resumed == flat[consumed:]
    # resuming with another dp size continues with the same samples too
    resumed = [i for step in zip(*[MegatronPretrainingSampler(total, 60, 3, r, 2)
                                   for r in range(2)]) for part in step for i in part]
    assert resumed == list(range(60, 60 + len(resumed)))


def test_errors():
    with pytest.raises(ValueError, match="no sample to consume"):
        MegatronPretrainingSampler(0, 0, 1, 0, 1)
    with pytest.raises(ValueError, match="no samples left to consume: consumed_samples=10"):
        MegatronPretrainingSampler(10, 10, 1, 0, 1)
    with pytest.raises(ValueError, match=r"data_parallel_rank 2 must be in \[0, 2\)"):
        MegatronPretrainingSampler(10, 0, 1, 2, 2)
    with pytest.raises(ValueError, match="--micro-batch-size"):
        MegatronPretrainingSampler(10, 0, 0, 0, 1)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_data_loader(num_workers):
    assert build_pretraining_data_loader(None, 0, 2, 0, 1) is None
    loader = build_pretraining_data_loader(Toy(40), 8, 2, 1, 2, num_workers=num_workers)
    batches = list(loader)
    assert len(batches) == len(loader) == 8
    first = batches[0]["text"]
    assert first.dtype == torch.int64 and first.shape == (2, 5)
    torch.testing.assert_close(first[:, 0], torch.tensor([10, 11]))  # 8 + rank 1 * mb 2
