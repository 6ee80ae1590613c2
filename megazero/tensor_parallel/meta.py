"""The parameter-metadata contract: how a parameter is initialised, sharded, tied, partitioned.

Every megazero layer attaches one frozen ``ParamMeta`` to each parameter it creates
(``set_meta``); every other part (the data-parallel optimizers, gradient finalisation,
checkpoints, resharding, the offline tools) learns about a parameter only through
``meta_of``. This is Megatron's ``_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS`` idea made one typed
object instead of loose attributes, with a check against setting it twice: a layer that
re-annotates a parameter by accident fails at once; ``update_meta`` is the deliberate way to
change a field later (the model marks its tied word embedding, ZeRO-3 records that it holds a
parameter's partitions).

A parameter without metadata (a plain ``torch.nn`` layer in a user's model) reads as
replicated over tp, not initialised by megazero, of its current shape. Nothing here
communicates.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

_ATTR = "_mz_meta"  # the one attribute megazero sets on a parameter


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


class ParamMetaError(ValueError):
    """Metadata set twice, or inconsistent with the parameter it describes."""


@dataclass(frozen=True)
class ParamMeta:
    """What megazero knows about one parameter (frozen; replace with ``update_meta``).

    ``shard``: the full logical shape and the slice this rank's tensor holds.
    ``local_shape``: this rank's tensor (padding included), kept when ZeRO-3 frees the storage.
    ``init``: how it is drawn from (seed, name); None when megazero does not initialise it.
    ``tensor_parallel``: split over the tp group (Megatron's tensor-model-parallel).
    ``sequence_parallel``: replicated over tp, but each tp rank's gradient is partial (it saw
    its part of the sequence): all-reduced over tp by gradient finalisation.
    ``tied_embedding``: the word embedding held by the first and the last pipeline stage,
    gradient all-reduced over the embedding group; ``shared_embedding``: the last stage's
    copy of it (counted once in norms).
    ``partitioned_by``: a weak reference to the ZeRO-3 optimizer holding this parameter's dp
    partitions, if any.
    """

    shard: ShardInfo
    local_shape: tuple[int, ...]
    init: InitSpec | None = None
    tensor_parallel: bool = False
    sequence_parallel: bool = False
    tied_embedding: bool = False
    shared_embedding: bool = False
    partitioned_by: object = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "local_shape", tuple(int(s) for s in self.local_shape))
        if len(self.local_shape) != len(self.shard.full_shape):
            raise ParamMetaError(f"local shape {self.local_shape} and full shape "
                                 f"{self.shard.full_shape} differ in rank")
        if self.shared_embedding and not self.tied_embedding:
            raise ParamMetaError("shared_embedding (the last stage's copy) needs "
                                 "tied_embedding")

    @property
    def partition_dim(self) -> int:
        """The tp-partitioned dimension, -1 when replicated (Megatron's ``partition_dim``)."""
        return self.shard.dim if self.tensor_parallel and self.shard.dim is not None else -1

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    @classmethod
    def replicated(cls, shape, **fields) -> ParamMeta:
        """A parameter replicated over tp (its full tensor on every rank)."""
        return cls(shard=replicated(shape), local_shape=tuple(shape), **fields)

    def to_dict(self) -> dict:
        """What checkpoints store per tensor (``param_meta``): slice and local shape."""
        return {"local_shape": list(self.local_shape), **self.shard.to_dict()}


def has_meta(param: torch.Tensor) -> bool:
    return getattr(param, _ATTR, None) is not None


def set_meta(param: torch.Tensor, meta: ParamMeta) -> ParamMeta:
    """Attach ``meta`` to a freshly created parameter; setting it twice is an error."""
    if has_meta(param):
        raise ParamMetaError(f"parameter of shape {tuple(param.shape)} already has metadata "
                             f"({getattr(param, _ATTR)}); use update_meta to change it")
    if param.numel() > 0 and tuple(param.shape) != meta.local_shape:
        raise ParamMetaError(f"metadata says local shape {meta.local_shape}, the parameter "
                             f"has {tuple(param.shape)}")
    setattr(param, _ATTR, meta)
    return meta


def meta_of(param: torch.Tensor) -> ParamMeta:
    """The parameter's metadata; replicated, uninitialised and of its shape when unset."""
    meta = getattr(param, _ATTR, None)
    return meta if meta is not None else ParamMeta.replicated(param.shape)


def ensure_meta(param: torch.Tensor) -> ParamMeta:
    """``meta_of``, recorded on the parameter (before its storage may be freed)."""
    if not has_meta(param):
        set_meta(param, ParamMeta.replicated(param.shape))
    return meta_of(param)


def update_meta(param: torch.Tensor, **changes) -> ParamMeta:
    """Replace fields of the parameter's metadata (recorded first when unset)."""
    meta = dataclasses.replace(ensure_meta(param), **changes)
    setattr(param, _ATTR, meta)
    return meta


def copy_meta(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Give ``dst`` (a parameter replacing ``src``) ``src``'s metadata."""
    if has_meta(src):
        setattr(dst, _ATTR, meta_of(src))


__all__ = ["InitSpec", "ShardInfo", "init_normal", "init_ones", "init_zeros", "replicated",
           "ParamMeta", "ParamMetaError", "copy_meta", "ensure_meta", "has_meta", "meta_of",
           "set_meta", "update_meta"]
