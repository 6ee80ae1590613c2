"""Helpers shared by the tests (run inside worker ranks)."""

from __future__ import annotations

import torch

from megazero.distributed import comm


def gather_along(shard: torch.Tensor, dim: int, group) -> torch.Tensor:
    """All-gather tensor shards along ``dim`` over ``group`` (concatenated in rank order)."""
    n = comm.group_size(group)
    if n == 1:
        return shard.detach().clone()
    parts = [torch.empty_like(shard) for _ in range(n)]
    torch.distributed.all_gather(parts, shard.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def assert_close(actual, expected, rtol=1e-5, atol=1e-6, what=""):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol,
                               msg=lambda m: f"{what}: {m}")


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
