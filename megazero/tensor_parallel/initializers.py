"""Layout-invariant parameter initialisation and shard metadata.

Each element of a full (logical, unpadded) weight gets its value from a counter-based random
generator keyed by (seed, parameter name) and the element's flat index in the full tensor:
splitmix64 of the counter gives two uniforms, Box-Muller turns them into a normal. Any slice
of the full tensor (a tensor-parallel shard, a ZeRO-3 flat partition, a pipeline stage's
layers) can therefore be drawn on its own, without materialising the full weight, and is the
same whatever the tp/pp/dp split. Nothing here communicates.

``ShardInfo`` (attribute ``mz_shard`` on every parameter) records the full shape and which
slice a local tensor holds; checkpoints store it so any layout can be reassembled.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


@dataclass(frozen=True)
class InitSpec:
    """How to fill a parameter: normal(0, std), zeros or ones."""

    kind: str = "normal"
    std: float = 0.02


def init_normal(std: float) -> InitSpec:
    return InitSpec("normal", float(std))


def init_zeros() -> InitSpec:
    return InitSpec("zeros", 0.0)


def init_ones() -> InitSpec:
    return InitSpec("ones", 0.0)


@dataclass(frozen=True)
class ShardInfo:
    """Which slice of a logical full tensor a local tensor holds.

    ``dim`` is the partitioned dimension (``None``: the local tensor is the full tensor).
    Along ``dim`` the local tensor holds logical entries ``[start, start + length)`` first and
    padding after them (the local size along ``dim`` may exceed ``length``, e.g. a padded
    vocabulary shard). ``full_shape`` is the logical shape without padding.
    """

    full_shape: tuple[int, ...]
    dim: int | None = None
    start: int = 0
    length: int | None = None

    def logical_length(self) -> int:
        if self.dim is None:
            return 0
        return self.full_shape[self.dim] if self.length is None else self.length

    def to_dict(self) -> dict:
        return {"full_shape": list(self.full_shape), "dim": self.dim, "start": self.start,
                "length": self.logical_length() if self.dim is not None else None}

    @classmethod
    def from_dict(cls, d: dict) -> ShardInfo:
        return cls(tuple(d["full_shape"]), d["dim"], d["start"], d["length"])


def replicated(shape) -> ShardInfo:
    return ShardInfo(tuple(int(s) for s in shape), None, 0, None)


def init_key(seed: int, name: str) -> int:
    """A stable 64-bit key for (seed, parameter name), independent of Python's hash seed."""
    digest = hashlib.blake2b(f"{int(seed)}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _splitmix(counter: np.ndarray, key: int) -> np.ndarray:
    """splitmix64 of ``key + counter * golden`` (in place on a fresh array)."""
    with np.errstate(over="ignore"):
        z = counter * _GOLDEN
        z += np.uint64(key)
        z ^= z >> np.uint64(30)
        z *= _M1
        z ^= z >> np.uint64(27)
        z *= _M2
        z ^= z >> np.uint64(31)
        return z


def normal_at(key: int, flat_index: np.ndarray) -> np.ndarray:
    """Standard normals (float64) for the given flat indices of the keyed full tensor."""
    idx2 = flat_index.astype(np.uint64)
    idx2 *= np.uint64(2)
    scale = 1.0 / 9007199254740992.0  # 2**-53
    u1 = (_splitmix(idx2, key) >> np.uint64(11)).astype(np.float64)
    u1 += 0.5
    u1 *= scale
    idx2 += np.uint64(1)
    u2 = (_splitmix(idx2, key) >> np.uint64(11)).astype(np.float64)
    u2 *= 2.0 * np.pi * scale
    np.log(u1, out=u1)
    u1 *= -2.0
    np.sqrt(u1, out=u1)
    np.cos(u2, out=u2)
    u1 *= u2
    return u1


def _global_flat_index(local_shape, shard: ShardInfo, local_flat: np.ndarray | None = None):
    """Global flat index of each local element (``-1`` for padding), in local flat order.

    ``local_flat`` restricts to some local flat positions (a ZeRO-3 partition); default all.
    """
    local_shape = tuple(int(s) for s in local_shape)
    full = shard.full_shape
    ndim = len(full)
    if local_flat is None:
        local_flat = np.arange(int(np.prod(local_shape, dtype=np.int64)), dtype=np.int64)
    if ndim == 0:
        return np.zeros_like(local_flat)
    inner = int(np.prod(full[1:], dtype=np.int64))
    if shard.dim is None or (shard.dim == 0 and tuple(local_shape[1:]) == tuple(full[1:])):
        # rows of the full tensor, contiguous: a shift of the flat index (padding after)
        start = 0 if shard.dim is None else shard.start
        length = full[0] if shard.dim is None else shard.logical_length()
        gidx = local_flat + start * inner
        gidx[local_flat >= length * inner] = -1
        return gidx
    coords = np.unravel_index(local_flat, local_shape)
    gidx = np.zeros(local_flat.shape, dtype=np.int64)
    valid = np.ones(local_flat.shape, dtype=bool)
    stride = 1
    for d in range(ndim - 1, -1, -1):
        c = coords[d].astype(np.int64)
        if shard.dim == d:
            valid &= c < shard.logical_length()
            c = c + shard.start
        else:
            valid &= c < full[d]
        gidx += c * stride
        stride *= full[d]
    gidx[~valid] = -1
    return gidx


def fill_shard(tensor: torch.Tensor, spec: InitSpec, shard: ShardInfo, key: int) -> torch.Tensor:
    """Fill ``tensor`` (a local shard described by ``shard``) in place; padding gets zeros."""
    flat = tensor.view(-1) if tensor.is_contiguous() else torch.empty(tensor.numel(),
                                                                        dtype=tensor.dtype)
    fill_flat_partition(flat, spec, shard, key, tensor.shape, 0)
    if flat.data_ptr() != tensor.data_ptr() or tensor.numel() == 0:
        with torch.no_grad():
            tensor.copy_(flat.view(tensor.shape))
    return tensor


_CHUNK = 1 << 20  # elements drawn at a time: bounds the temporaries (~40 MB)


def fill_flat_partition(flat: torch.Tensor, spec: InitSpec, shard: ShardInfo, key: int,
                        local_shape, start: int) -> torch.Tensor:
    """Fill a 1-D slice ``[start, start + flat.numel())`` of a local tensor's flat view."""
    if spec.kind == "normal" and flat.numel() > _CHUNK:
        for off in range(0, flat.numel(), _CHUNK):
            n = min(_CHUNK, flat.numel() - off)
            fill_flat_partition(flat[off:off + n], spec, shard, key, local_shape, start + off)
        return flat
    positions = np.arange(start, start + flat.numel(), dtype=np.int64)
    if spec.kind in ("zeros", "ones"):
        with torch.no_grad():
            flat.fill_(0.0 if spec.kind == "zeros" else 1.0)
        if spec.kind == "ones" and shard.dim is not None:
            gidx = _global_flat_index(local_shape, shard, positions)
            with torch.no_grad():
                flat[torch.from_numpy(gidx < 0)] = 0.0
        return flat
    gidx = _global_flat_index(local_shape, shard, positions)
    values = normal_at(key, np.maximum(gidx, 0))
    values *= spec.std
    values[gidx < 0] = 0.0
    with torch.no_grad():
        flat.copy_(torch.from_numpy(values).to(dtype=flat.dtype, device=flat.device))
    return flat


def set_param_meta(param: torch.nn.Parameter, spec: InitSpec, shard: ShardInfo,
                   *, tensor_model_parallel: bool) -> None:
    """Attach init spec and shard info (plus Megatron's attribute names) to a parameter."""
    param.mz_init = spec
    param.mz_shard = shard
    param.tensor_model_parallel = tensor_model_parallel
    param.partition_dim = shard.dim if tensor_model_parallel else -1
    param.partition_stride = 1


def draw_key() -> int:
    """A key from torch's default generator: the same on every rank seeded alike."""
    return int(torch.randint(0, 2**62, (1,)).item())


def initialize_parameters(module: torch.nn.Module, seed: int, prefix: str = "") -> None:
    """(Re)initialise every parameter carrying ``mz_init`` from (seed, its name).

    Names must not depend on the parallel layout (megazero's GPT model keys layers by global
    index), then the same seed gives the same full model for any split.
    """
    for name, param in module.named_parameters(prefix=prefix.rstrip(".")):
        spec = getattr(param, "mz_init", None)
        shard = getattr(param, "mz_shard", None)
        if spec is None or shard is None or param.device.type == "meta":
            continue
        fill_shard(param.data, spec, shard, init_key(seed, getattr(param, "mz_name", name)))
