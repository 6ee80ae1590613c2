"""Layout-invariant parameter initialisation and shard metadata.

Each element of a full (logical, unpadded) weight gets its value from a counter-based random
generator keyed by (seed, parameter name) and the element's flat index in the full tensor:
splitmix64 of the counter gives two uniforms, Box-Muller turns them into a normal. Any slice
of the full tensor (a tensor-parallel shard, a ZeRO-3 flat partition, a pipeline stage's
layers) can therefore be drawn on its own, without materialising the full weight, and is the
same whatever the tp/pp/dp split. Nothing here communicates.

``ShardInfo`` (in every parameter's ``ParamMeta``, see ``meta``) records the full shape and
which slice a local tensor holds; checkpoints store it so any layout can be reassembled.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from megazero.distributed.device import is_fake
from megazero.tensor_parallel.meta import (  # noqa: F401 - re-exported: the init spec types
    InitSpec,
    ShardInfo,
    init_normal,
    init_ones,
    init_zeros,
    meta_of,
    replicated,
)

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


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
    """Fill ``tensor`` (a local shard described by ``shard``) in place; padding gets zeros.
    A fake tensor (the dry run) has no values to fill: it is returned as it is."""
    if is_fake(tensor):
        return tensor
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
    """Fill a 1-D slice ``[start, start + flat.numel())`` of a local tensor's flat view. A
    fake one (the dry run) has no values: nothing is drawn (nor would the fake-tensor mode
    reach the drawing threads)."""
    if is_fake(flat):
        return flat
    if spec.kind == "normal" and flat.numel() > _CHUNK:
        # chunks are independent (counter-based): drawn by torch's intra-op thread count of
        # threads (numpy releases the GIL), the same values whatever the count
        def fill(off: int) -> None:
            n = min(_CHUNK, flat.numel() - off)
            fill_flat_partition(flat[off:off + n], spec, shard, key, local_shape, start + off)

        offsets = range(0, flat.numel(), _CHUNK)
        threads = min(torch.get_num_threads(), len(offsets))
        if threads <= 1:
            for off in offsets:
                fill(off)
        else:
            with ThreadPoolExecutor(threads, thread_name_prefix="megazero-init") as pool:
                list(pool.map(fill, offsets))
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


def draw_key() -> int:
    """A key from torch's default generator: the same on every rank seeded alike (drawn on a
    real tensor, also inside the dry run's fake-tensor mode)."""
    with unset_fake_temporarily():
        return int(torch.randint(0, 2**62, (1,)).item())


def initialize_parameters(module: torch.nn.Module, seed: int, prefix: str = "") -> None:
    """(Re)initialise every parameter whose ``ParamMeta`` has an ``init`` from (seed, name).

    Names must not depend on the parallel layout (megazero's GPT model keys layers by global
    index), then the same seed gives the same full model for any split.
    """
    for name, param in module.named_parameters(prefix=prefix.rstrip(".")):
        meta = meta_of(param)
        if meta.init is None or param.device.type == "meta":
            continue
        fill_shard(param.data, meta.init, meta.shard, init_key(seed, name))
