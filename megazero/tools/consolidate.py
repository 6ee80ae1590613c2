"""Full tensors of a checkpoint saved at any layout, in one process without process groups.

Thin wrapper of ``megazero.checkpoint.CheckpointReader``: each parameter is rebuilt from
the saved cells and ZeRO fragments, padding removed; pipeline stages hold disjoint parameters
(the tied embedding is taken once). Used by ``zero_to_fp32`` and the checkpoint tool.
"""

from __future__ import annotations

import torch

from megazero.checkpoint.reader import CheckpointReader


def consolidate(root: str, iteration=None, kind: str | None = None,
                dtype: torch.dtype | None = torch.float32) -> dict[str, torch.Tensor]:
    """A full state dict: fp32 main values when the optimizer was saved, else model values."""
    reader = CheckpointReader(root, iteration)
    if kind is None:
        kind = "main" if reader.has_optimizer() else "model"
    out = {}
    for name in reader.param_names():
        t = reader.full_tensor(name, kind)
        out[name] = t.to(dtype) if dtype is not None else t
    return out


__all__ = ["CheckpointReader", "consolidate"]
