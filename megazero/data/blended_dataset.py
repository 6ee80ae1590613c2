"""Blends of several datasets (``--data-path 0.3 A 0.7 B``), with Megatron's greedy blending.

``parse_data_prefix`` reads the ``--data-path`` list: one prefix, or weight/prefix pairs. For a
blend, the weights are normalised and each dataset is asked for
``ceil(weight * n * 1.005)`` samples of each split (0.5% slack, as Megatron, so the greedy
blend never runs a dataset dry). ``BlendedDataset`` then lays out ``size`` samples: sample
``i`` comes from the dataset that lags its weight the most so far
(``megazero.data.helpers.build_blending_indices``), and is that dataset's next sample.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from megazero.data.helpers import build_blending_indices

logger = logging.getLogger(__name__)


def parse_data_prefix(data_prefix: list[str], train_valid_test_num_samples):
    """``(prefixes, weights, per-dataset [train, valid, test] sample counts)``."""
    items = [str(x) for x in data_prefix]
    if not items:
        raise ValueError("--data-path is empty")
    if len(items) == 1:
        return items, [1.0], [[int(n) for n in train_valid_test_num_samples]]
    if len(items) % 2:
        raise ValueError(f"--data-path must be one prefix or weight/prefix pairs "
                         f"('0.3 A 0.7 B'), got {len(items)} items: {' '.join(items)}")
    weights, prefixes = [], []
    for w, p in zip(items[0::2], items[1::2]):
        try:
            weight = float(w)
        except ValueError:
            raise ValueError(f"--data-path: weight {w!r} (before {p!r}) is not a number; "
                             "expected '0.3 A 0.7 B'") from None
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"--data-path: weight of {p!r} must be >= 0, got {w!r}")
        weights.append(weight)
        prefixes.append(p.strip())
    total = sum(weights)
    if total <= 0:
        raise ValueError(f"--data-path: the weights must have a positive sum, got {weights}")
    weights = [w / total for w in weights]
    per_dataset = [[int(math.ceil(n * w * 1.005)) for n in train_valid_test_num_samples]
                   for w in weights]
    return prefixes, weights, per_dataset


class BlendedDataset(torch.utils.data.Dataset):
    """``size`` samples drawn from ``datasets`` in proportion to ``weights`` (greedy)."""

    def __init__(self, datasets, weights, size: int, *, use_cpp: bool | None = None):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        if len(datasets) > 255:
            raise ValueError(f"at most 255 datasets can be blended, got {len(datasets)}")
        weights = np.asarray(weights, dtype=np.float64)
        if np.any(weights < 0) or weights.sum() <= 0:
            raise ValueError(f"blending weights must be >= 0 with a positive sum, got {weights}")
        self.datasets = list(datasets)
        self.weights = weights / weights.sum()
        self.size = int(size)
        self.dataset_index, self.dataset_sample_index = build_blending_indices(
            self.weights, self.size, use_cpp=use_cpp)
        counts = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for i, (count, ds) in enumerate(zip(counts, self.datasets)):
            if count > len(ds):
                raise ValueError(f"blend needs {count} samples from dataset {i} "
                                 f"({getattr(ds, 'name', '')}), which has only {len(ds)}")
        logger.info(" > blended dataset: %d samples from %d datasets, weights %s, counts %s",
                    self.size, len(self.datasets), np.round(self.weights, 4).tolist(),
                    counts.tolist())

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx):
        idx = int(idx)
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for a blend of {self.size} samples")
        return self.datasets[self.dataset_index[idx]][int(self.dataset_sample_index[idx])]
