"""ZeRO-3 gathering: all-gather a unit's parameters over the dp group when a module needs them.

Part of ``Zero3Optimizer`` (see ``zero3.py``), over ``ps.dp_group``: the gather before a unit's
users run (forward and backward pre-hooks), asynchronous prefetch of the neighbouring unit,
release after the unit's last user, the accounting of gathered bytes, the order check that
turns diverging ranks into an error, and the saved-tensor hooks that keep autograd from
holding gathered buffers between forward and backward.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from megazero.distributed import comm
from megazero.tensor_parallel.meta import meta_of


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


@dataclass
class _PackedView:
    """A saved tensor that was a view of a gathered parameter buffer."""

    unit: Unit
    bucket: int
    shape: tuple
    stride: tuple
    offset: int
    requires_grad: bool


class ZeroOrderError(RuntimeError):
    """Data-parallel ranks issued ZeRO-3 collectives in different orders."""


class Zero3Gathering:
    """Mixin of ``Zero3Optimizer``: uses its layout, units, dp group and buffers."""

    def _check(self, kind: str, index: int):
        if not self.check_order or self.dp_size == 1:
            return
        self._seq += 1
        codes = {"gather": 1, "prefetch": 1, "reduce": 2, "broadcast": 3}
        mine = torch.tensor([codes[kind], index, self._seq], dtype=torch.int64)
        everyone = torch.empty(3 * self.dp_size, dtype=torch.int64)
        comm.all_gather_into(everyone, mine, self.dp_group)
        rows = everyone.view(self.dp_size, 3)
        if not bool((rows == rows[0]).all()):
            names = {1: "all-gather", 2: "reduce-scatter", 3: "broadcast"}
            desc = "; ".join(f"dp rank {r}: {names.get(int(k), k)} of bucket {int(b)} "
                             f"(collective #{int(s)})" for r, (k, b, s) in enumerate(rows))
            raise ZeroOrderError("ZeRO-3 ranks diverged: data-parallel ranks issue "
                                 f"collectives in different orders ({desc}). Every rank "
                                 "must run the same modules in the same order.")

    def _start_gather(self, b: int, async_op: bool):
        bucket = self.layout.buckets[b]
        self._check("gather", b)
        full = torch.empty(bucket.numel, dtype=self.dtype, device=self.device)
        self._account(bucket.numel)
        self._buffers.append(weakref.ref(full))
        work = comm.all_gather_into(full, self._owned_model_chunk(bucket), self.dp_group,
                                    async_op=async_op)
        return full, work

    def _fetch(self, unit: Unit, direction: int = 1, prefetch: bool = True):
        if unit.gathered or self.dp_size == 1:
            return
        fulls = []
        for b in unit.buckets:
            if b in self._inflight:
                full, work = self._inflight.pop(b)
                if work is not None:
                    work.wait()
            else:
                full, _ = self._start_gather(b, async_op=False)
            fulls.append(full)
        self._materialize_unit(unit, fulls)
        nxt = unit.index + direction
        if self.prefetch and prefetch and 0 <= nxt < len(self.units) \
                and self.units[nxt].chunk == unit.chunk:
            self._prefetch(self.units[nxt])

    def _prefetch(self, unit: Unit):
        if unit.gathered:
            return
        for b in unit.buckets:
            if b not in self._inflight:
                self._inflight[b] = self._start_gather(b, async_op=True)

    def _drain_prefetch(self):
        for b, (_, work) in list(self._inflight.items()):
            if work is not None:
                work.wait()
            self._account(-self.layout.buckets[b].numel)
        self._inflight.clear()

    def _account(self, numel: int):
        self.live_bytes += numel * self._itemsize
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)

    def _materialize_unit(self, unit: Unit, fulls):
        for b, full in zip(unit.buckets, fulls):
            bucket = self.layout.buckets[b]
            for pr in bucket.params:
                view = full[pr.start - bucket.start:pr.end - bucket.start]
                self._set_data(pr.param, view.view(meta_of(pr.param).local_shape))
            unit.fulls[b] = full
            self._storages[full.untyped_storage().data_ptr()] = (unit, b)
        unit.gathered = True
        unit.forward_uses = 0

    def _release(self, unit: Unit):
        if not unit.gathered or unit.pins > 0 or self.dp_size == 1:
            return
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        for b in unit.buckets:
            for pr in self.layout.buckets[b].params:
                self._set_data(pr.param, empty)
            self._account(-self.layout.buckets[b].numel)
            full = unit.fulls.pop(b, None)
            if full is not None:
                self._storages.pop(full.untyped_storage().data_ptr(), None)
        unit.gathered = False

    def _install_module_hooks(self):
        self._itemsize = torch.empty(0, dtype=self.dtype).element_size()
        for unit in self.units:
            if not unit.buckets:
                continue
            for i, mod in enumerate(unit.users):
                # Only a unit's first user prefetches the neighbour (the tied output layer
                # runs long after the embedding and must not pull layer 0 in again).
                first = i == 0
                mod.register_forward_pre_hook(
                    lambda m, a, u=unit, f=first: self._fetch(u, +1, prefetch=f))
                mod.register_forward_hook(lambda m, a, o, u=unit: self._after_forward(u))
                mod.register_full_backward_pre_hook(
                    lambda m, g, u=unit, f=first: self._fetch(u, -1, prefetch=f))
        # Autograd saves views of gathered parameters (F.linear keeps weight.t()); stored as
        # is they would keep every gathered buffer alive until backward. Saved tensors that
        # live in a gathered buffer are packed as (unit, bucket, view geometry) instead and
        # rebuilt from the buffer gathered again before the module's backward.
        for chunk in self.model_chunks:
            chunk.register_forward_pre_hook(lambda m, a: self._enter_saved_hooks())
            chunk.register_forward_hook(lambda m, a, o: self._exit_saved_hooks())

    def _after_forward(self, unit: Unit):
        """Release after the unit's last user in this forward (the tied embedding is used by
        the embedding and again by the output layer: keep it, gathering it twice costs more
        communication than holding it)."""
        unit.forward_uses += 1
        if unit.forward_uses >= len(unit.users):
            self._release(unit)

    def _enter_saved_hooks(self):
        if self.dp_size == 1 or not torch.is_grad_enabled():
            self._hook_stack.append(None)
            return
        ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        ctx.__enter__()
        self._hook_stack.append(ctx)

    def _exit_saved_hooks(self):
        ctx = self._hook_stack.pop() if self._hook_stack else None
        if ctx is not None:
            ctx.__exit__(None, None, None)

    def _pack(self, t: torch.Tensor):
        if t.device.type == "meta" or t.layout != torch.strided:
            return t
        entry = self._storages.get(t.untyped_storage().data_ptr())
        if entry is None:
            return t
        unit, b = entry
        return _PackedView(unit, b, tuple(t.shape), t.stride(), t.storage_offset(),
                           t.requires_grad)

    def _unpack(self, packed):
        if not isinstance(packed, _PackedView):
            return packed
        unit = packed.unit
        if not unit.gathered:  # backward reached it before its module's pre-hook: gather
            self._fetch(unit, -1, prefetch=False)
        full = unit.fulls[packed.bucket]
        return full.as_strided(packed.shape, packed.stride, packed.offset)
