"""ZeRO stage 3: parameters partitioned over the data-parallel group, gathered per unit.

Parallelises parameters, gradients and optimizer states over ``ps.dp_group``. The model is cut
into units by a unit policy passed in (``zero3_units``); each unit is one or more buckets of
the flat layout, and dp rank r stores only chunk r of each (model dtype, ``PartitionedParams``)
plus its fp32 main copy and optimizer states. It is ``ZeroOptimizer`` with three parts
swapped: this layout, this parameter storage, and the unit gatherer's callbacks on the bucket
reducer; gradients use the owned-partition storage of stage 2.

* Forward: a unit is all-gathered just before a module that uses it runs, the next unit is
  prefetched asynchronously, and the full parameters are released after the module ran.
* Backward: gathered again before the module's backward (the previous unit is prefetched),
  gradients are reduce-scattered as in stage 2 and the unit released as soon as all its
  gradients have left.
* Parameters at or below ``--zero-param-persistence-threshold`` elements stay whole on every
  rank (one replicated bucket, stage-2 semantics: reduce-scatter, update, all-gather).
* Every collective carries an order check of (kind, bucket, sequence number): ranks that
  diverge fail at once with an error naming what each rank was doing, instead of hanging.
  On the ring the codes ride in its first barrier, on its thread (free for the main thread);
  other collectives are preceded by a tiny all-gather of them (``--no-zero3-order-check``
  skips both).

A model built on the ``meta`` device is materialised here directly in partitions: each owned
piece is drawn from the layout-invariant initialiser (seed, parameter name, element index), so
the full model never exists on one rank. ``GatheredParameters`` gathers parameters for user
code (like DeepSpeed's), optionally broadcasting changes made on one rank.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn

from megazero.data_parallel.layout import FlatLayout
from megazero.data_parallel.params import (
    collect_named_params,
    find_fragment,
    model_dtype,
    tied_across_stages,
)
from megazero.data_parallel.zero import ZeroOptimizer
from megazero.data_parallel.zero3_units import (
    Unit,
    UnitGatherer,
    UnitPolicy,
    ZeroOrderError,
    plan_units,
)
from megazero.distributed import comm
from megazero.tensor_parallel.initializers import fill_flat_partition, init_key
from megazero.tensor_parallel.meta import copy_meta, ensure_meta, meta_of, update_meta

__all__ = ["GatheredParameters", "Zero3Optimizer", "ZeroOrderError"]


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


def unit_layout(named, units: list[Unit], persistent: list[str], ps) -> FlatLayout:
    """One bucket per unit (its tied-embedding parameters each in a bucket of their own, so
    both stages holding them lay them out alike), then one replicated bucket of the
    persistent parameters; fills each unit's ``buckets``."""
    params = dict(named)
    buckets = []
    for unit in units:
        tied = [n for n in unit.param_names if tied_across_stages(params[n], ps)]
        groups = [[n] for n in tied] + [[n for n in unit.param_names if n not in tied]]
        for g in groups:
            if g:
                unit.buckets.append(len(buckets))
                buckets.append(g)
    if persistent:
        buckets.append(list(persistent))
    return FlatLayout(named, ps.dp_size, ps.dp_rank, buckets=buckets, shard=ps.dp_size > 1)


class PartitionedParams:
    """This rank's chunk of every unit bucket (one flat ``partition``) and the persistent
    bucket whole (``persist_buffer``); unit parameters hold no storage until gathered.

    ``owned_chunk(bucket)`` is this rank's chunk (here a view; ``write``/``flush`` are how
    the optimizer and checkpoint loads change it, so that a storage in files
    (``nvme_params.SwappedParams``) can stand in)."""

    swapped = False  # unit chunks live in this object (the gatherer may keep views at dp 1)

    def __init__(self, layout: FlatLayout, persistent_bucket: int | None, dtype, device, *,
                 fill):
        self.layout, self.persistent_bucket = layout, persistent_bucket
        self.dtype, self.device = dtype, device
        self.offsets = layout.bucket_owned_offsets()
        pb = persistent_bucket
        self.persist_buffer = None
        if pb is not None:
            b = layout.buckets[pb]
            self.persist_buffer = torch.zeros(b.numel, dtype=dtype, device=device)
        self._store_units(fill)
        if pb is not None:
            bucket = layout.buckets[pb]
            for pr in bucket.params:
                view = self.persist_buffer[pr.start - bucket.start:pr.end - bucket.start]
                fill(pr.name, pr.param, view, 0)
                pr.param.data = view.view(meta_of(pr.param).local_shape)
        if layout.dp_size > 1 or self.swapped:
            empty = torch.empty(0, dtype=dtype, device=device)
            for bucket in layout.buckets:
                if bucket.index != pb:
                    for pr in bucket.params:
                        pr.param.data = empty

    def _store_units(self, fill) -> None:
        """This rank's chunks of the unit buckets, back to back in ``partition``."""
        self.partition = torch.zeros(self.layout.partition_numel, dtype=self.dtype,
                                     device=self.device)
        for seg in self.layout.segments:
            if seg.bucket != self.persistent_bucket:
                fill(seg.name, seg.param, self.partition[seg.offset:seg.offset + seg.numel],
                     seg.param_start)

    def owned_chunk(self, bucket) -> torch.Tensor:
        if bucket.index == self.persistent_bucket:
            c0, c1 = self.layout.owned_chunk(bucket)
            return self.persist_buffer[c0 - bucket.start:c1 - bucket.start]
        o0, o1 = self.offsets[bucket.index]
        return self.partition[o0:o1]

    def write(self, bucket, offset: int, values: torch.Tensor) -> None:
        """Owned chunk of ``bucket``, elements [offset, offset + numel) = ``values``."""
        self.owned_chunk(bucket)[offset:offset + values.numel()].copy_(values,
                                                                         non_blocking=True)

    def flush(self) -> None:
        """Writes are complete (a storage in files writes back what it holds)."""

    def replicated_buckets(self):
        pb = self.persistent_bucket
        return [self.layout.buckets[pb]] if pb is not None else []

    def full_bucket(self, bucket) -> torch.Tensor:
        return self.persist_buffer

    @property
    def nbytes(self) -> int:
        nbytes = lambda t: 0 if t is None else t.numel() * t.element_size()  # noqa: E731
        return nbytes(self.partition) + nbytes(self.persist_buffer)

    def tensors(self) -> list[torch.Tensor]:
        """The storages this rank keeps between gathers (memory accounting)."""
        return [t for t in (self.partition, self.persist_buffer) if t is not None]


class Zero3Optimizer(ZeroOptimizer):
    """ZeRO-3 over ``model_chunks`` on ``ps.dp_group`` (see the module docstring).

    ``unit_policy(chunk)`` gives the units (default: every module with direct parameters);
    ``seed`` initialises parameters built on the meta device, keyed by their names;
    ``storage_factory`` builds the parameter storage (default ``PartitionedParams``; in files:
    ``nvme_params.SwappedParams``).
    """

    def __init__(self, model_chunks, opt_config, ps, *, lr_scheduler=None, seed: int = 0,
                 unit_policy: UnitPolicy | None = None, storage_factory=None):
        on_meta = _replace_meta_params(model_chunks, ps.device)
        named = collect_named_params(model_chunks)
        for _, p in named:
            ensure_meta(p)  # records the local shape before the storage is partitioned away
        dtype = model_dtype(named)
        units, persistent = plan_units(model_chunks, named, unit_policy,
                                       opt_config.zero_param_persistence_threshold)
        layout = unit_layout(named, units, persistent, ps)
        unit_of_bucket = {b: u for u in units for b in u.buckets}
        pb = len(layout.buckets) - 1 if persistent else None

        def fill(name, param, dst, start):
            """Owned values of ``param`` from its data, or from the initialiser if on meta."""
            if id(param) in on_meta:
                meta = meta_of(param)
                if meta.init is None:
                    raise ValueError(f"ZeRO-3: parameter {name} was built on the meta device "
                                     "without megazero init metadata; build it materialised")
                fill_flat_partition(dst, meta.init, meta.shard, init_key(seed, name),
                                    meta.local_shape, start)
            else:
                dst.copy_(param.data.reshape(-1)[start:start + dst.numel()])

        storage = (storage_factory or PartitionedParams)(layout, pb, dtype, ps.device, fill=fill)
        gatherer = UnitGatherer(layout, units, storage.owned_chunk, ps.dp_group, dtype=dtype,
                                device=ps.device, prefetch=opt_config.zero_prefetch,
                                max_live=opt_config.zero_max_live_parameters,
                                prefetch_numel=opt_config.zero_prefetch_bucket_size,
                                check_order=opt_config.zero3_order_check,
                                resident=not storage.swapped)
        if gatherer.resident:  # nothing to gather: parameters are views of the partition
            for unit in units:
                gatherer.materialize(unit, [storage.owned_chunk(layout.buckets[b])
                                            for b in unit.buckets])
        hooks = dict(before_reduce=gatherer.before_reduce,
                     after_reduce=lambda b: gatherer.after_reduce(b, unit_of_bucket),
                     end_of_backward=gatherer.end_of_backward)
        super().__init__(model_chunks, opt_config, ps, lr_scheduler=lr_scheduler,
                         named_params=named, layout=layout, params=storage, device=ps.device,
                         reducer_hooks=hooks)
        self.units, self.gatherer = units, gatherer
        if storage.swapped:  # the swap files go with the optimizer (the model's hooks may
            weakref.finalize(self, storage.close)  # keep the storage itself a while longer)
        self._param_name = {id(pr.param): n for n, pr in layout.ranges.items()}
        # Weakly: the parameters must not keep their optimizer (and its process groups)
        # alive; torch does not traverse a parameter's attributes for garbage collection
        # while autograd also holds it, so a strong back-reference is a leak.
        for pr in layout.ranges.values():
            update_meta(pr.param, partitioned_by=weakref.ref(self))
        self.gatherer.install(model_chunks)

    @property
    def live_bytes(self) -> int:
        return self.gatherer.live_bytes

    def held_bytes(self) -> int:
        return self.gatherer.held_bytes()

    @torch.no_grad()
    def step(self):
        result = super().step()
        self.gatherer.drain_prefetch()
        self.gatherer.release_all()  # gathered copies are stale after an update
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
            self.gatherer.fetch(u, +1)
            u.pins += 1
        try:
            yield
        finally:
            if modifier_rank is not None:
                self._broadcast_back(units, modifier_rank)
            for u in units:
                u.pins -= 1
                self.gatherer.release(u)

    def _broadcast_back(self, units, modifier_rank):
        src = self.ps.dp_ranks[modifier_rank]
        for u in units:
            for b in u.buckets:
                bucket = self.layout.buckets[b]
                full = torch.cat([self.layout.ranges[pr.name].param.data.reshape(-1)
                                  for pr in bucket.params])
                check = self.gatherer.order("broadcast", b)
                if check is not None:  # broadcasts never run on the ring: check first
                    comm.communicator_of(self.dp_group).check_order(self.dp_group, check, full)
                comm.broadcast(full, src, self.dp_group)
                c0, c1 = self.layout.owned_chunk(bucket)
                real = min(c1, bucket.start + full.numel()) - c0
                if real > 0:
                    self.params.write(bucket, 0, full[c0 - bucket.start:c0 - bucket.start + real])
        self.params.flush()
        self.reload_model_params()

    # ---- reports and checkpoints ---------------------------------------------------------
    def memory_report(self) -> dict:
        report = super().memory_report()
        report["gathered"] = self.gatherer.held_bytes()  # full units alive now
        report["gathered_peak"] = self.gatherer.peak_live_bytes
        if self.params.swapped:  # --offload-param nvme: the unit chunks are in a file
            report["nvme_param_bytes"] = self.params.file_bytes
        return report

    def _owned_model_values(self, seg) -> torch.Tensor:
        bucket = self.layout.buckets[seg.bucket]
        return self.params.owned_chunk(bucket)[seg.chunk_offset:seg.chunk_offset + seg.numel]

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
                self.params.write(self.layout.buckets[seg.bucket], seg.chunk_offset,
                                  values["model"])
            self.params.flush()
            self.reload_model_params()
            if self.shard:
                self._all_gather_params()
        self.gatherer.release_all()


class GatheredParameters(contextlib.AbstractContextManager):
    """``with GatheredParameters(module.parameters(), modifier_rank=0): ...`` — the full
    values of ZeRO-3 parameters inside the block (a no-op for unpartitioned parameters)."""

    def __init__(self, params, modifier_rank: int | None = None):
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        owners = {}
        for p in params:
            ref = meta_of(p).partitioned_by
            if ref is None:
                continue
            opt = ref()
            if opt is None:
                raise RuntimeError("GatheredParameters: a ZeRO-3 parameter's optimizer was "
                                   "released; its full value is gone with it")
            owners[id(opt)] = opt
        self._ctxs = [opt.gathered(params, modifier_rank) for opt in owners.values()]

    def __enter__(self):
        for c in self._ctxs:
            c.__enter__()
        return self

    def __exit__(self, *exc):
        for c in reversed(self._ctxs):
            c.__exit__(*exc)
        return False
