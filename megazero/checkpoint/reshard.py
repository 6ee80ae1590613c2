"""Reassemble full tensors from shards, and cut them for another layout.

Every parameter's ``ParamMeta`` carries a ``ShardInfo`` (full logical shape, partitioned dim,
which slice this tensor holds; padding after the slice). Checkpoints store it per tensor as
``param_meta``.
``assemble`` builds the full tensor from any set of pieces; ``cut`` takes a new layout's local
shard (with padding re-applied) from a full tensor. Nothing here communicates.
"""

from __future__ import annotations

import torch

from megazero.tensor_parallel.meta import ShardInfo


def local_slice(shard: ShardInfo | dict):
    """(dim, start, length) of the logical slice a local tensor holds (dim None: whole)."""
    if isinstance(shard, dict):
        shard = ShardInfo.from_dict(shard)
    if shard.dim is None:
        return None, 0, None
    return shard.dim, shard.start, shard.logical_length()


def assemble(pieces: list[tuple[torch.Tensor, dict | ShardInfo]], dtype=None) -> torch.Tensor:
    """The full logical tensor from (local tensor, shard info) pieces covering it."""
    if not pieces:
        raise ValueError("no pieces to assemble")
    first = pieces[0][1]
    info = ShardInfo.from_dict(first) if isinstance(first, dict) else first
    full_shape = tuple(info.full_shape)
    dtype = dtype or pieces[0][0].dtype
    if info.dim is None:
        return pieces[0][0].detach().to(dtype).reshape(full_shape).clone()
    full = torch.empty(full_shape, dtype=dtype)
    covered = 0
    for tensor, shard in pieces:
        dim, start, length = local_slice(shard)
        if length == 0:
            continue
        src = tensor.detach().narrow(dim, 0, length)
        full.narrow(dim, start, length).copy_(src)
        covered += length
    if covered != full_shape[info.dim]:
        raise ValueError(f"shards cover {covered} of {full_shape[info.dim]} entries along "
                         f"dim {info.dim}")
    return full


def cut(full: torch.Tensor, shard: ShardInfo, local_shape) -> torch.Tensor:
    """This layout's local tensor of ``local_shape`` from the full tensor (zero padding)."""
    if shard.dim is None:
        return full.reshape(local_shape).clone()
    out = torch.zeros(local_shape, dtype=full.dtype)
    length = shard.logical_length()
    if length:
        out.narrow(shard.dim, 0, length).copy_(full.narrow(shard.dim, shard.start, length))
    return out
