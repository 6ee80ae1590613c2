"""ZeRO stage 3: parameters partitioned over the data-parallel group, gathered per unit.

Parallelises parameters, gradients and optimizer states over ``ps.dp_group``. The model is cut
into units (a transformer layer, the embedding, the final LayerNorm; any module with direct
parameters for other models). Each unit is one or more buckets of the flat layout; dp rank r
stores only chunk r of each (model dtype), plus its fp32 main copy and optimizer states.

* Forward: a unit is all-gathered just before a module that uses it runs (forward pre-hook),
  the next unit is prefetched asynchronously, and the full parameters are released after the
  module ran (forward hook).
* Backward: gathered again before the module's backward (backward pre-hook; the previous unit is
  prefetched), gradients are reduce-scattered as in stage 2 and the unit released as soon as
  all its gradients have left.
* Parameters at or below ``--zero-param-persistence-threshold`` elements stay whole on every
  rank (one replicated bucket, stage-2 semantics: reduce-scatter, update, all-gather).
* Every collective is preceded by a tiny all-gather of (kind, unit, sequence number): ranks
  that diverge (a rank skipping a unit, or running another one) fail at once with an error
  naming what each rank was doing, instead of hanging (``MEGAZERO_ZERO3_CHECK_ORDER=0`` skips
  it).

A model built on the ``meta`` device is materialised here directly in partitions: each owned
piece is drawn from the layout-invariant initialiser (seed, parameter name, element index), so
the full model never exists on one rank. ``GatheredParameters`` gathers parameters for user
code (like DeepSpeed's), optionally broadcasting changes made on one rank.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from megazero.data_parallel.layout import FlatLayout, param_numel
from megazero.data_parallel.params import collect_named_params, find_fragment, tied_across_stages
from megazero.data_parallel.zero import ZeroOptimizer
from megazero.data_parallel.zero3_gather import Unit, Zero3Gathering, ZeroOrderError
from megazero.distributed import comm
from megazero.tensor_parallel.initializers import fill_flat_partition, init_key
from megazero.tensor_parallel.meta import copy_meta, ensure_meta, meta_of, update_meta

__all__ = ["GatheredParameters", "Zero3Optimizer", "ZeroOrderError"]

def _units_of(model_chunks) -> list[tuple[str, list[nn.Module], nn.Module, int]]:
    """(name, user modules, owning module, chunk) of every unit, in forward order."""
    out = []
    for ci, chunk in enumerate(model_chunks):
        prefix = f"chunk{ci}." if len(model_chunks) > 1 else ""
        if hasattr(chunk, "zero3_units"):
            for path, users in chunk.zero3_units():
                out.append((prefix + path, users, chunk.get_submodule(path), ci))
        else:
            for path, mod in chunk.named_modules():
                if any(True for _ in mod.parameters(recurse=False)):
                    out.append((prefix + path, [mod], mod, ci))
    return out


def _replace_meta_params(model_chunks, device) -> set[int]:
    """Swap meta parameters for empty ones on ``device`` (same ``ParamMeta``, its local shape
    recorded); returns the ids of the new parameters."""
    replaced = set()
    for chunk in model_chunks:
        for mod in chunk.modules():
            for pname, p in list(mod._parameters.items()):
                if p is None or p.device.type != "meta":
                    continue
                new = nn.Parameter(torch.empty(0, dtype=p.dtype, device=device),
                                   requires_grad=p.requires_grad)
                ensure_meta(p)
                copy_meta(p, new)
                replaced.add(id(new))
                mod._parameters[pname] = new
    return replaced


class Zero3Optimizer(Zero3Gathering, ZeroOptimizer):
    """ZeRO-3 over ``model_chunks`` on ``ps.dp_group`` (see the module docstring)."""

    supported_stages = (3,)

    def __init__(self, model_chunks, opt_config, ps, *, lr_scheduler=None, seed: int = 0):
        self.seed = seed
        self.model_chunks = model_chunks
        self.prefetch = opt_config.zero_prefetch
        self.threshold = opt_config.zero_param_persistence_threshold
        self.check_order = os.environ.get("MEGAZERO_ZERO3_CHECK_ORDER", "1") != "0"
        self._seq = 0
        self._inflight: dict[int, tuple] = {}
        self._storages: dict[int, tuple] = {}  # data_ptr of gathered buffers -> (unit, bucket)
        self._buffers: list = []  # weak references to every gathered buffer (diagnostics)
        self._hook_stack: list = []
        self.live_bytes = self.peak_live_bytes = 0
        device = ps.device
        self._on_meta = _replace_meta_params(model_chunks, device)
        named = collect_named_params(model_chunks)
        for _, p in named:
            ensure_meta(p)  # records the local shape before the storage is partitioned away
        self._plan_units(named)
        super().__init__(model_chunks, opt_config, ps, lr_scheduler=lr_scheduler,
                         named_params=named)
        self._install_module_hooks()

    # ---- layout --------------------------------------------------------------------------
    def _plan_units(self, named):
        by_id = {id(p): n for n, p in named}
        self.units, self.persistent = [], []
        owner = {}
        for ui, (uname, users, module, ci) in enumerate(_units_of(self.model_chunks)):
            unit = Unit(ui, uname, users, ci)
            for p in module.parameters():
                name = by_id.get(id(p))
                if name is None or name in owner:
                    continue
                if param_numel(p) <= self.threshold:
                    self.persistent.append(name)
                else:
                    unit.param_names.append(name)
                owner[name] = unit
            self.units.append(unit)
        rest = [n for n, _ in named if n not in owner]  # params outside every unit
        self.persistent += rest
        self._unit_of_param = {n: u for n, u in owner.items() if n not in self.persistent}

    def _make_layout(self, named) -> FlatLayout:
        params = dict(named)
        buckets = []
        self._unit_of_bucket = {}
        for unit in self.units:
            tied = [n for n in unit.param_names if tied_across_stages(params[n], self.ps)]
            groups = [[n] for n in tied] + [[n for n in unit.param_names if n not in tied]]
            for g in groups:
                if g:
                    unit.buckets.append(len(buckets))
                    self._unit_of_bucket[len(buckets)] = unit
                    buckets.append(g)
        self._persistent_bucket = None
        if self.persistent:
            self._persistent_bucket = len(buckets)
            buckets.append(list(self.persistent))
        return FlatLayout(named, self.dp_size, self.dp_rank, buckets=buckets,
                          shard=self.dp_size > 1)

    def _target_device(self, named):
        return self.ps.device

    def _build_param_storage(self, named):
        lay = self.layout
        self.param_buffer = None  # no full buffer: see partition and persist_buffer
        self.part_offsets = lay.bucket_owned_offsets()
        self.partition = torch.zeros(lay.partition_numel, dtype=self.dtype, device=self.device)
        pb = self._persistent_bucket
        self.persist_buffer = None
        if pb is not None:
            b = lay.buckets[pb]
            self.persist_buffer = torch.zeros(b.numel, dtype=self.dtype, device=self.device)
        for seg in lay.segments:
            if seg.bucket == pb:
                continue
            dst = self.partition[seg.offset:seg.offset + seg.numel]
            self._fill_owned(seg.name, seg.param, dst, seg.param_start)
        if pb is not None:
            bucket = lay.buckets[pb]
            for pr in bucket.params:
                view = self.persist_buffer[pr.start - bucket.start:pr.end - bucket.start]
                self._fill_owned(pr.name, pr.param, view, 0)
                self._set_data(pr.param, view.view(meta_of(pr.param).local_shape))
        for unit in self.units:
            for name in unit.param_names:
                p = lay.ranges[name].param
                if self.dp_size > 1:
                    self._set_data(p, torch.empty(0, dtype=self.dtype, device=self.device))
        if self.dp_size == 1:  # nothing to gather: parameters are views of the partition
            for unit in self.units:
                self._materialize_unit(unit, [self._owned_model_chunk(lay.buckets[b])
                                              for b in unit.buckets])
        self._param_name = {id(pr.param): n for n, pr in lay.ranges.items()}
        for pr in lay.ranges.values():
            update_meta(pr.param, partitioned_by=self)

    def _fill_owned(self, name, param, dst, start):
        """Owned values of ``param`` from its data, or from the initialiser if on meta."""
        if id(param) in self._on_meta:
            meta = meta_of(param)
            if meta.init is None:
                raise ValueError(f"ZeRO-3: parameter {name} was built on the meta device "
                                 "without megazero init metadata; build it materialised")
            key = init_key(self.seed, name)
            fill_flat_partition(dst, meta.init, meta.shard, key, meta.local_shape, start)
        else:
            dst.copy_(param.data.reshape(-1)[start:start + dst.numel()])

    @staticmethod
    def _set_data(param, tensor):
        param.data = tensor

    def _owned_model_chunk(self, bucket) -> torch.Tensor:
        if bucket.index == self._persistent_bucket:
            c0, c1 = self.layout.owned_chunk(bucket)
            return self.persist_buffer[c0 - bucket.start:c1 - bucket.start]
        o0, o1 = self.part_offsets[bucket.index]
        return self.partition[o0:o1]

    def _replicated_buckets(self):
        pb = self._persistent_bucket
        return [self.layout.buckets[pb]] if pb is not None else []

    def _full_model_bucket(self, bucket) -> torch.Tensor:
        return self.persist_buffer

    def _on_bucket_reduced(self, bucket) -> None:
        unit = self._unit_of_bucket.get(bucket.index)
        if unit is None:
            return
        unit.reduced.add(bucket.index)
        if len(unit.reduced) == len(unit.buckets):
            unit.reduced.clear()
            self._release(unit)

    def _reduce_bucket(self, bucket, async_op: bool):
        self._check("reduce", bucket.index)
        super()._reduce_bucket(bucket, async_op)

    def _end_of_backward(self):
        super()._end_of_backward()
        self._drain_prefetch()
        for unit in self.units:
            unit.reduced.clear()
            unit.forward_uses = 0
            self._release(unit)

    @torch.no_grad()
    def step(self):
        result = super().step()
        self._drain_prefetch()
        for unit in self.units:  # gathered copies are stale after an update
            self._release(unit)
        return result

    # ---- user access ---------------------------------------------------------------------
    @contextlib.contextmanager
    def gathered(self, params=None, modifier_rank: int | None = None):
        """Gather the units holding ``params`` (all when None); every dp rank must enter.

        With ``modifier_rank`` (a dp rank), values changed there inside the block are
        broadcast on exit and written back into every rank's partition and fp32 main copy.
        """
        wanted = None if params is None else {self._param_name.get(id(p)) for p in params}
        units = [u for u in self.units if u.buckets and
                 (wanted is None or wanted & set(u.param_names))]
        for u in units:
            self._fetch(u, +1)
            u.pins += 1
        try:
            yield
        finally:
            if modifier_rank is not None:
                self._broadcast_back(units, modifier_rank)
            for u in units:
                u.pins -= 1
                self._release(u)

    def _broadcast_back(self, units, modifier_rank):
        src = self.ps.dp_ranks[modifier_rank]
        for u in units:
            for b in u.buckets:
                bucket = self.layout.buckets[b]
                full = torch.cat([self.layout.ranges[pr.name].param.data.reshape(-1)
                                  for pr in bucket.params])
                self._check("broadcast", b)
                comm.broadcast(full, src, self.dp_group)
                owned = self._owned_model_chunk(bucket)
                c0, c1 = self.layout.owned_chunk(bucket)
                real = min(c1, bucket.start + full.numel()) - c0
                if real > 0:
                    owned[:real].copy_(full[c0 - bucket.start:c0 - bucket.start + real])
        self.reload_model_params()

    def held_bytes(self) -> int:
        """Bytes of gathered buffers still alive, referenced by anyone (the optimizer, or a
        saved tensor that escaped the pack hook): measured, unlike ``live_bytes``."""
        self._buffers = [r for r in self._buffers if r() is not None]
        return sum(r().numel() * r().element_size() for r in self._buffers)

    def memory_report(self) -> dict:
        report = super().memory_report()
        nbytes = lambda t: 0 if t is None else t.numel() * t.element_size()  # noqa: E731
        report["params"] = nbytes(self.partition) + nbytes(self.persist_buffer)
        report["gathered_peak"] = self.peak_live_bytes
        return report

    def _owned_model_values(self, seg) -> torch.Tensor:
        bucket = self.layout.buckets[seg.bucket]
        return self._owned_model_chunk(bucket)[seg.chunk_offset:seg.chunk_offset + seg.numel]

    def sharded_state_dict(self, include_optimizer: bool = True) -> dict:
        """This rank's parameters (model dtype) and, optionally, optimizer fragments."""
        state = super().sharded_state_dict()
        for seg in self.layout.segments:
            for entry in state["fragments"][seg.name]:
                if entry["param_start"] == seg.param_start:
                    entry["model"] = self._owned_model_values(seg).clone()
                    if not include_optimizer:
                        for k in ["main", *self.rule.state_names]:
                            entry.pop(k, None)
        state["param_shapes"] = {n: list(meta_of(pr.param).local_shape)
                                 for n, pr in self.layout.ranges.items()}
        state["has_optimizer"] = include_optimizer
        return state

    def load_sharded_state_dict(self, state: dict, fragment_reader=None,
                                load_optimizer: bool = True) -> None:
        if load_optimizer:
            super().load_sharded_state_dict(state, fragment_reader)
        else:
            for seg in self.layout.segments:
                values = fragment_reader(seg.name, seg.param_start, seg.param_end) \
                    if fragment_reader is not None else find_fragment(state["fragments"], seg)
                self._owned_model_values(seg).copy_(values["model"])
            self.reload_model_params()
            if self.shard:
                self._all_gather_params()
        for unit in self.units:
            self._release(unit)


class GatheredParameters(contextlib.AbstractContextManager):
    """``with GatheredParameters(module.parameters(), modifier_rank=0): ...`` — the full
    values of ZeRO-3 parameters inside the block (a no-op for unpartitioned parameters)."""

    def __init__(self, params, modifier_rank: int | None = None):
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        owners = {id(meta_of(p).partitioned_by): meta_of(p).partitioned_by for p in params}
        owners.pop(id(None), None)
        self._ctxs = [opt.gathered(params, modifier_rank) for opt in owners.values()]

    def __enter__(self):
        for c in self._ctxs:
            c.__enter__()
        return self

    def __exit__(self, *exc):
        for c in reversed(self._ctxs):
            c.__exit__(*exc)
        return False
