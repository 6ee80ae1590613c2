"""ZeRO-3 units and their gathering over the dp group.

A unit is a set of parameters gathered together (a transformer layer, the embedding) and
the modules that need them. Which units a model has is a *unit policy*, passed in by whoever
knows the model: ``policy(chunk) -> [(module path, [modules that use its parameters])]``
(``megazero.model.gpt2.gpt_zero3_units`` for GPT-2). Without one, every module with direct
parameters is a unit of its own (``modules_with_params``).

``UnitGatherer`` all-gathers a unit over ``dp_group`` just before one of its modules runs
(forward and backward pre-hooks), prefetches the neighbouring unit asynchronously, releases
the full parameters after the unit's last user (or once all its gradients left in backward),
accounts the gathered bytes, turns diverging ranks into an error (each collective carries an
order check of (kind, bucket, sequence number): compared on the ring's thread in its first
barrier where the ring carries it, else by a tiny all-gather before it), and keeps autograd
from holding gathered buffers between forward and backward (saved-tensor hooks that store a
view's geometry instead of the view).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from megazero.data_parallel.layout import FlatLayout
from megazero.distributed import comm
from megazero.distributed.order import CollectiveOrderError, OrderCheck
from megazero.tensor_parallel.meta import meta_of

UnitPolicy = Callable[[nn.Module], list[tuple[str, list[nn.Module]]]]


def modules_with_params(chunk: nn.Module) -> list[tuple[str, list[nn.Module]]]:
    """The default unit policy: each module holding parameters directly, used by itself."""
    return [(path, [mod]) for path, mod in chunk.named_modules()
            if any(True for _ in mod.parameters(recurse=False))]


@dataclass
class Unit:
    index: int
    name: str
    users: list
    chunk: int = 0
    param_names: list = field(default_factory=list)
    buckets: list = field(default_factory=list)
    gathered: bool = False
    pins: int = 0
    reduced: set = field(default_factory=set)
    fulls: dict = field(default_factory=dict)  # bucket -> gathered full buffer
    forward_uses: int = 0  # users that ran their forward since the unit was gathered


def plan_units(model_chunks, named, policy: UnitPolicy | None, threshold: int):
    """(units in forward order, names of persistent parameters): parameters at or below
    ``threshold`` elements, and those outside every unit, stay whole on every rank."""
    policy = policy or modules_with_params
    by_id = {id(p): n for n, p in named}
    units, persistent, owner = [], [], set()
    for ci, chunk in enumerate(model_chunks):
        prefix = f"chunk{ci}." if len(model_chunks) > 1 else ""
        for path, users in policy(chunk):
            unit = Unit(len(units), prefix + path, users, ci)
            for p in chunk.get_submodule(path).parameters():
                name = by_id.get(id(p))
                if name is None or name in owner:
                    continue
                owner.add(name)
                if meta_of(p).numel <= threshold:
                    persistent.append(name)
                else:
                    unit.param_names.append(name)
            units.append(unit)
    persistent += [n for n, _ in named if n not in owner]
    return units, persistent


@dataclass
class _PackedView:
    """A saved tensor that was a view of a gathered parameter buffer."""

    unit: Unit
    bucket: int
    shape: tuple
    stride: tuple
    offset: int  # elements from the start of the gathered buffer


class ZeroOrderError(CollectiveOrderError):
    """Data-parallel ranks issued ZeRO-3 collectives in different orders."""


_CODES = {"gather": 1, "prefetch": 1, "reduce": 2, "broadcast": 3}
_NAMES = {1: "all-gather", 2: "reduce-scatter", 3: "broadcast"}


def _diverged(seen: dict) -> ZeroOrderError:
    """The error of an order check that disagreed: what each rank it heard was doing."""
    desc = "; ".join(f"dp rank {r}: {_NAMES.get(k, k)} of bucket {b} (collective #{s})"
                     for r, (k, b, s) in sorted(seen.items()))
    return ZeroOrderError("ZeRO-3 ranks diverged: data-parallel ranks issue collectives in "
                          f"different orders ({desc}). Every rank must run the same modules "
                          "in the same order.")


class UnitGatherer:
    """Gathers and releases ``units`` of a partitioned parameter storage over ``dp_group``.

    ``owned_chunk(bucket)`` gives this rank's stored chunk of a bucket; parameters get the
    gathered values through ``param.data`` (views of one full buffer per bucket).
    """

    def __init__(self, layout: FlatLayout, units: list[Unit], owned_chunk, dp_group, *,
                 dtype: torch.dtype, device: torch.device, prefetch: bool, check_order: bool,
                 max_live: int | None = None, prefetch_numel: int | None = None,
                 resident: bool = True):
        self.layout, self.units, self.owned_chunk = layout, units, owned_chunk
        self.dp_group, self.dp_size = dp_group, comm.group_size(dp_group)
        # At dp 1 the parameters stay views of the owned chunks (nothing to gather), unless
        # the chunks are read from files (``resident=False``: --offload-param nvme)
        self.resident = resident and self.dp_size == 1
        self.dtype, self.device = dtype, device
        self.prefetch, self.check_order = prefetch, check_order
        self.max_live = max_live  # elements gathered beyond which nothing is prefetched
        # elements of the units ahead kept prefetched; None: the next unit only
        self.prefetch_numel = prefetch_numel
        self.itemsize = torch.empty(0, dtype=dtype).element_size()
        # Buffers are made from this prototype (``new_empty``): gathers also run in module
        # backward hooks, where a fake tensor (the dry run) carries its mode and a factory
        # call might not.
        self.proto = torch.empty(0, dtype=dtype, device=device)
        self.seq = 0  # collectives issued (order check)
        self.inflight: dict[int, tuple] = {}  # bucket -> (full buffer, work) of prefetches
        self.storages: dict[int, tuple] = {}  # storage key of gathered buffers -> (unit, bucket)
        self.buffers: list = []  # weak references to every gathered buffer (diagnostics)
        self.hook_stack: list = []
        self.live_bytes = self.peak_live_bytes = 0

    # ---- order check ---------------------------------------------------------------------
    def order(self, kind: str, index: int) -> OrderCheck | None:
        """The order check the next collective carries (``comm``: exchanged on the ring's
        thread inside its first barrier, else a blocking all-gather before it)."""
        if not self.check_order or self.dp_size == 1:
            return None
        self.seq += 1
        return OrderCheck((_CODES[kind], index, self.seq), _diverged)

    # ---- gather and release --------------------------------------------------------------
    def _start_gather(self, b: int, async_op: bool):
        bucket = self.layout.buckets[b]
        order = self.order("gather", b)
        self._account(bucket.numel)
        if self.dp_size == 1:  # the chunk read from its file is the bucket
            full = self.owned_chunk(bucket)[:bucket.numel]
            self.buffers.append(weakref.ref(full))
            return full, None
        full = self.proto.new_empty(bucket.numel)
        self.buffers.append(weakref.ref(full))
        work = comm.all_gather_into(full, self.owned_chunk(bucket), self.dp_group,
                                    async_op=async_op, order=order)
        return full, work

    def fetch(self, unit: Unit, direction: int = 1, prefetch: bool = True) -> None:
        if unit.gathered or self.resident:
            return
        fulls = []
        for b in unit.buckets:
            if b in self.inflight:
                full, work = self.inflight.pop(b)
                if work is not None:
                    work.wait()
            else:
                full, _ = self._start_gather(b, async_op=False)
            fulls.append(full)
        self.materialize(unit, fulls)
        if self.prefetch and prefetch:
            for ahead in self._ahead(unit, direction):
                self._prefetch(ahead)

    def _ahead(self, unit: Unit, direction: int) -> list[Unit]:
        """The units to have in flight after ``unit``: the next one (``prefetch_numel``
        None), else the following units of its chunk while their elements sum to at most
        ``prefetch_numel`` (DeepSpeed's stage3_prefetch_bucket_size); each within
        ``max_live``."""
        out, numel, nxt = [], 0, unit.index + direction
        while 0 <= nxt < len(self.units) and self.units[nxt].chunk == unit.chunk:
            cand = self.units[nxt]
            numel += sum(self.layout.buckets[b].numel for b in cand.buckets)
            if self.prefetch_numel is not None and numel > self.prefetch_numel \
                    or not self._fits(cand):
                break
            out.append(cand)
            if self.prefetch_numel is None:
                break
            nxt += direction
        return out

    def _fits(self, unit: Unit) -> bool:
        """Whether gathering ``unit`` too keeps the live elements within ``max_live``."""
        if self.max_live is None:
            return True
        extra = sum(self.layout.buckets[b].numel for b in unit.buckets if b not in self.inflight)
        return self.live_bytes // self.itemsize + extra <= self.max_live

    def _prefetch(self, unit: Unit) -> None:
        if unit.gathered:
            return
        for b in unit.buckets:
            if b not in self.inflight:
                self.inflight[b] = self._start_gather(b, async_op=True)

    def drain_prefetch(self) -> None:
        for b, (_, work) in list(self.inflight.items()):
            if work is not None:
                work.wait()
            self._account(-self.layout.buckets[b].numel)
        self.inflight.clear()

    def _account(self, numel: int) -> None:
        self.live_bytes += numel * self.itemsize
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)

    def materialize(self, unit: Unit, fulls) -> None:
        """Point the unit's parameters at views of ``fulls`` (one buffer per bucket)."""
        for b, full in zip(unit.buckets, fulls):
            bucket = self.layout.buckets[b]
            for pr in bucket.params:
                view = full[pr.start - bucket.start:pr.end - bucket.start]
                pr.param.data = view.view(meta_of(pr.param).local_shape)
            unit.fulls[b] = full
            self.storages[_storage_key(full)] = (unit, b)
        unit.gathered = True
        unit.forward_uses = 0

    def release(self, unit: Unit) -> None:
        if not unit.gathered or unit.pins > 0 or self.resident:
            return
        empty = self.proto.new_empty(0)
        for b in unit.buckets:
            for pr in self.layout.buckets[b].params:
                pr.param.data = empty
            self._account(-self.layout.buckets[b].numel)
            full = unit.fulls.pop(b, None)
            if full is not None:
                self.storages.pop(_storage_key(full), None)
        unit.gathered = False

    def release_all(self) -> None:
        for unit in self.units:
            self.release(unit)

    # ---- callbacks of the bucket reducer -------------------------------------------------
    def before_reduce(self, bucket) -> OrderCheck | None:
        return self.order("reduce", bucket.index)

    def after_reduce(self, bucket, unit_of_bucket: dict) -> None:
        """Release a unit as soon as all its buckets' gradients have left."""
        unit = unit_of_bucket.get(bucket.index)
        if unit is None:
            return
        unit.reduced.add(bucket.index)
        if len(unit.reduced) == len(unit.buckets):
            unit.reduced.clear()
            self.release(unit)

    def end_of_backward(self) -> None:
        self.drain_prefetch()
        for unit in self.units:
            unit.reduced.clear()
            unit.forward_uses = 0
            self.release(unit)

    # ---- module and autograd hooks -------------------------------------------------------
    def install(self, model_chunks) -> None:
        for unit in self.units:
            if not unit.buckets:
                continue
            for i, mod in enumerate(unit.users):
                # Only a unit's first user prefetches the neighbour (the tied output layer
                # runs long after the embedding and must not pull layer 0 in again).
                first = i == 0
                mod.register_forward_pre_hook(
                    lambda m, a, u=unit, f=first: self.fetch(u, +1, prefetch=f))
                mod.register_forward_hook(lambda m, a, o, u=unit: self._after_forward(u))
                mod.register_full_backward_pre_hook(
                    lambda m, g, u=unit, f=first: self.fetch(u, -1, prefetch=f))
        # Autograd saves views of gathered parameters (F.linear keeps weight.t()); stored as
        # is they would keep every gathered buffer alive until backward. Saved tensors that
        # live in a gathered buffer are packed as (unit, bucket, view geometry) instead and
        # rebuilt from the buffer gathered again before the module's backward.
        for chunk in model_chunks:
            chunk.register_forward_pre_hook(lambda m, a: self._enter_saved_hooks())
            chunk.register_forward_hook(lambda m, a, o: self._exit_saved_hooks())

    def _after_forward(self, unit: Unit) -> None:
        """Release after the unit's last user in this forward (the tied embedding is used by
        the embedding and again by the output layer: keep it, gathering it twice costs more
        communication than holding it)."""
        unit.forward_uses += 1
        if unit.forward_uses >= len(unit.users):
            self.release(unit)

    def _enter_saved_hooks(self) -> None:
        if self.resident or not torch.is_grad_enabled():
            self.hook_stack.append(None)
            return
        ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        ctx.__enter__()
        self.hook_stack.append(ctx)

    def _exit_saved_hooks(self) -> None:
        ctx = self.hook_stack.pop() if self.hook_stack else None
        if ctx is not None:
            ctx.__exit__(None, None, None)

    def _pack(self, t: torch.Tensor):
        if t.device.type == "meta" or t.layout != torch.strided:
            return t
        entry = self.storages.get(_storage_key(t))
        if entry is None:
            return t
        unit, b = entry
        # the offset from the buffer's own start: a buffer gathered again may begin elsewhere
        # in its storage (a chunk read from a swap file sits at an aligned address inside)
        offset = t.storage_offset() - unit.fulls[b].storage_offset()
        return _PackedView(unit, b, tuple(t.shape), t.stride(), offset)

    def _unpack(self, packed):
        if not isinstance(packed, _PackedView):
            return packed
        unit = packed.unit
        if not unit.gathered:  # backward reached it before its module's pre-hook: gather
            self.fetch(unit, -1, prefetch=False)
        full = unit.fulls[packed.bucket]
        return full.as_strided(packed.shape, packed.stride,
                               full.storage_offset() + packed.offset)

    def held_bytes(self) -> int:
        """Bytes of gathered buffers still alive, referenced by anyone (the optimizer, or a
        saved tensor that escaped the pack hook): measured, unlike ``live_bytes``."""
        self.buffers = [r for r in self.buffers if r() is not None]
        return sum(r().numel() * r().element_size() for r in self.buffers)


def _storage_key(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage while it lives (the storage object's address: unlike the
    data pointer it is distinct for storages without memory, as fake tensors' are)."""
    return t.untyped_storage()._cdata
