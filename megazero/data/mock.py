"""``--mock-data``: deterministic random token sequences, no files (tests and benchmarks)."""

from __future__ import annotations

import numpy as np
import torch


class MockGPTDataset(torch.utils.data.Dataset):
    """Sample i: ``seq_length + 1`` tokens drawn from a generator seeded by (seed, i)."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int):
        self.num_samples, self.seq_length = num_samples, seq_length
        self.vocab_size, self.seed = vocab_size, seed

    def __len__(self):
        return self.num_samples

    def __getitem__(self, idx):
        rng = np.random.default_rng([self.seed, int(idx)])
        text = rng.integers(0, self.vocab_size - 1, size=self.seq_length + 1, dtype=np.int64)
        return {"text": text}
