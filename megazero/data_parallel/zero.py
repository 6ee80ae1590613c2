"""Data-parallel optimizer over flat buffers: plain DP (ZeRO-0) and ZeRO stages 1 and 2.

Parallelises the optimizer over the data-parallel group of the ``ParallelState`` passed in,
by composition of four parts:

* the layout (``FlatLayout``): parameters of one dtype back to back in buckets, each bucket
  split into dp chunks; dp rank r owns chunk r of every bucket (stages 1-2; stage 0 owns
  everything);
* the parameter storage (``FlatParams``): one flat buffer the parameters are views of, whose
  owned chunks the step updates and all-gathers (ZeRO-3 brings its partitioned storage);
* the gradient storage (``grads``): the full buffer (stages 0-1: accumulate, reduce once) or
  the owned partition (stages 2-3: reduce each bucket as backward fills it), reduced bucket by
  bucket by the ``BucketReducer`` and finalised over tp and the embedding group
  (``finalize``);
* the update rule (``optim.rules``) on fp32 segments of the owned partition, with fp32 main
  values (a copy for bf16/fp16 models, the parameter storage itself for fp32), optimizer
  states of the owned partition only, and the loss scaler.

The step computes the global gradient norm (every element once), agrees on overflow, folds
loss scale, dp averaging and clipping into one factor, applies the rule and all-gathers the
updated parameters (``param_sync``: by default during the next forward). ``--cpu-offload``
keeps main values and states in host memory. Separate fp32 main copies and optimizer states
are allocated at the first step (or load), like torch's optimizers: the setup's peak does not
carry them.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from megazero.data_parallel.finalize import finalize_model_grads, grad_norm_sq, step_scalars
from megazero.data_parallel.grads import grad_storage
from megazero.data_parallel.layout import FlatLayout, FlatParams, default_bucket_size
from megazero.data_parallel.param_sync import ParamGather
from megazero.data_parallel.params import (
    collect_named_params,
    find_fragment,
    model_dtype,
    no_weight_decay,
    tied_across_stages,
)
from megazero.data_parallel.reducer import BucketReducer
from megazero.distributed import comm
from megazero.distributed.device import host_values, synchronize
from megazero.distributed.parallel_state import ParallelState
from megazero.optim.grad_scaler import build_grad_scaler
from megazero.optim.rules import ParamTable, SegmentView, build_rule, describe_rule
from megazero.tensor_parallel.meta import meta_of

logger = logging.getLogger(__name__)


def bucketed_layout(named, ps: ParallelState, opt_config, shard: bool) -> FlatLayout:
    """Stages 0-2: greedy buckets of ``--zero-reduce-bucket-size`` elements (default: from
    the model size) in backward order (the last layers' gradients are ready first); the tied
    embedding alone in its bucket."""
    ordered = list(reversed(named))
    tied = {n for n, p in named if tied_across_stages(p, ps)}
    size = opt_config.zero_reduce_bucket_size
    if size is None:
        size = default_bucket_size(sum(meta_of(p).numel for _, p in named), ps.dp_size)
    return FlatLayout(ordered, ps.dp_size, ps.dp_rank, bucket_size=size, own_bucket=tied,
                      shard=shard)


class ZeroOptimizer:
    """ZeRO stages 0-2 over ``model_chunks`` (``torch.nn.Module`` list) on ``ps.dp_group``.

    ZeRO-3 (``zero3.Zero3Optimizer``) passes its own ``layout``, ``params`` storage and
    reducer callbacks; nothing here is overridden.
    """

    def __init__(self, model_chunks, opt_config, ps: ParallelState, *, lr_scheduler=None,
                 named_params=None, layout: FlatLayout | None = None, params=None,
                 device: torch.device | None = None, reducer_hooks: dict | None = None,
                 unit_policy=None):
        self.config, self.ps = opt_config, ps
        self.stage = opt_config.zero_stage
        if layout is None and self.stage == 3:
            raise ValueError("ZeroOptimizer lays out stages 0-2; ZeRO-3 is Zero3Optimizer "
                             "(data_parallel.build_optimizer picks it)")
        self.dp_group, self.dp_size, self.dp_rank = ps.dp_group, ps.dp_size, ps.dp_rank
        self.shard = self.stage > 0 and self.dp_size > 1
        self.overlap = opt_config.overlap_grad_reduce
        self.lr_scheduler = lr_scheduler
        self.scaler = build_grad_scaler(opt_config, device=device if device is not None
                                        else ps.device)
        self.rule = build_rule(opt_config, ps)
        self.step_count = 0
        self._steps = None  # [] fp32 on the device: successful steps, when counted there
        named = named_params or collect_named_params(model_chunks)
        if not named:
            raise ValueError("the model has no trainable parameters")
        self.dtype = model_dtype(named)
        self.low_precision = self.dtype != torch.float32
        self.device = device if device is not None else named[0][1].device
        self.layout = layout or bucketed_layout(named, ps, opt_config, self.shard)
        self.params = params or FlatParams(self.layout, self.dtype, self.device)
        self.grads = grad_storage(self.stage, self.layout, self.dtype, self.device)
        self.part_offsets = self.layout.bucket_owned_offsets()
        self.offload = self.config.cpu_offload
        self.main_chunks, self.state, self.grad_host = [], {}, None
        self._views: list[SegmentView] | None = None  # built with the states (first step)
        self._keys = {name: i for i, name in enumerate(self.layout.ranges)}
        self.param_table = ParamTable(len(self._keys), torch.tensor(
            [meta_of(self.layout.ranges[n].param).tensor_parallel for n in self._keys],
            dtype=torch.bool))
        self.reducer = BucketReducer(self.layout, self.grads, self.dp_group,
                                     overlap=self.overlap, **(reducer_hooks or {}))
        self.param_gather = ParamGather(
            self.layout, self.params, self.dp_group,
            model_chunks if layout is None else None, unit_policy,
            overlap=opt_config.overlap_param_gather)
        self.zero_grad()

    # ---- fp32 main values and optimizer states of the owned partition --------------------
    @property
    def views(self) -> list[SegmentView]:
        """The segments the update rule works on; allocates main values and states."""
        if self._views is None:
            self._build_main_and_states()
            self._views = self._segment_views(self._keys)
        return self._views

    def build_states(self) -> None:
        """Allocate the fp32 main values and optimizer states now instead of at the first
        step (the dry run measures the steady state from its first iteration on)."""
        self.views  # noqa: B018 - the property allocates

    def _build_main_and_states(self) -> None:
        """fp32 main copy: for fp32 models the owned chunks of the parameter storage
        themselves; with --cpu-offload a separate copy in (pinned, with CUDA) host memory."""
        host = torch.device("cpu") if self.offload else self.device
        pin = self.offload and self.device.type == "cuda"
        self.main_chunks = []
        for bucket in self.layout.buckets:
            chunk = self.params.owned_chunk(bucket)
            if self.offload:
                main = torch.empty(chunk.numel(), dtype=torch.float32, pin_memory=pin)
                main.copy_(chunk)
            else:
                main = chunk.float().clone() if self.low_precision else chunk
            self.main_chunks.append(main)
        part = self.layout.partition_numel
        self.state = {name: torch.zeros(part, dtype=torch.float32, device=host, pin_memory=pin)
                      for name in self.rule.state_names}
        self.grad_host = torch.zeros(part, dtype=torch.float32, pin_memory=pin) \
            if self.offload else None

    def _segment_views(self, keys: dict) -> list[SegmentView]:
        views = []
        for seg in self.layout.segments:
            main = self.main_chunks[seg.bucket][seg.chunk_offset:seg.chunk_offset + seg.numel]
            model = self.params.owned_chunk(self.layout.buckets[seg.bucket])
            out = model[seg.chunk_offset:seg.chunk_offset + seg.numel] \
                if self.low_precision and not self.offload else None
            wd = 0.0 if no_weight_decay(seg.name, seg.param) else self.config.weight_decay
            state = {k: v[seg.offset:seg.offset + seg.numel] for k, v in self.state.items()}
            grad = self.grad_host[seg.offset:seg.offset + seg.numel] if self.offload \
                else self.grads.owned(seg)
            views.append(SegmentView(main, grad, out, wd, state, keys[seg.name]))
        return views

    # ---- gradients -----------------------------------------------------------------------
    def zero_grad(self) -> None:
        self.reducer.wait()
        self.param_gather.wait_all()
        self.grads.zero()
        self.reducer.reset()

    @contextlib.contextmanager
    def no_sync(self):
        """Micro-batches inside accumulate locally (stages 0-1); stages 2-3 reduce anyway."""
        self.reducer.in_no_sync = True
        try:
            yield
        finally:
            self.reducer.in_no_sync = False

    def finish_grad_sync(self) -> None:
        """Complete the data-parallel reduction, then the tp and embedding-group syncs."""
        if not self.grads.reduces_every_microbatch:
            self.reducer.reduce_remaining()
        self.reducer.wait()
        self.reducer.reset()
        finalize_model_grads(self.layout.segments, self.grads.owned, self.ps)

    def describe(self) -> str:
        """The update that runs, in words (the "Using ... optimizer" log line)."""
        return describe_rule(self.rule, torch.device("cpu") if self.offload else self.device)

    # ---- the step --------------------------------------------------------------------------
    @property
    def loss_scale(self):
        """The loss multiplier: a float, or fp16's dynamic scale (a 0-dim device tensor)."""
        return self.scaler.scale

    def grad_norm_sq(self) -> torch.Tensor:
        """Sum of squares of the reduced (still scaled) gradients, over the whole model
        (float64 ``[1]`` on the device)."""
        return grad_norm_sq(self.layout.segments, self.grads.owned, self.ps,
                            sharded=self.shard, low_precision=self.low_precision)

    @property
    def scalars_on_device(self) -> bool:
        """Whether the step keeps its scalars (overflow, norm, clip factor, step count) on the
        device: the update rule takes them there (Adam on a GPU), the states are not
        offloaded. Then a step never waits for the device."""
        takes = getattr(self.rule, "takes_device_scalars", None)
        return not self.offload and takes is not None and takes(self.device)

    @torch.no_grad()
    def step(self) -> tuple:
        """(update successful, grad norm, skipped): 0-dim device tensors when the scalars stay
        on the device (``scalars_on_device``), else host values read once."""
        found_inf, grad_norm, factor = step_scalars(
            self.grad_norm_sq(), self.scaler.scale, self.dp_size, self.config.clip_grad)
        self.scaler.update(found_inf)
        lr = self.lr_scheduler.get_lr() if self.lr_scheduler is not None else self.config.lr
        if self.scalars_on_device:
            if self._steps is None:
                self._steps = torch.full((), float(self.step_count), dtype=torch.float32,
                                         device=self.device)
            self._steps += (~found_inf).reshape(())  # the kernel skips on found_inf
            self._update(lr, factor, skip=found_inf)
            if self.shard:
                self._all_gather_params()
            return (~found_inf).reshape(()), grad_norm.reshape(()), found_inf.reshape(())
        inf, norm, factor = host_values(torch.cat([found_inf.double(), grad_norm, factor]))
        if inf:
            return False, norm, 1
        self.step_count += 1
        self._update(lr, factor)
        if self.shard:
            self._all_gather_params()
        return True, norm, 0

    def steps_done(self) -> int:
        """Successful steps so far (a host read when they are counted on the device)."""
        if self._steps is None:
            return self.step_count
        return int(host_values(self._steps)[0])

    def _set_steps(self, steps: int) -> None:
        self.step_count = steps
        self._steps = None  # re-made from step_count at the next device step

    def _update(self, lr: float, grad_scale, skip=None) -> None:
        """The update rule over this rank's partition (fp32 main values, states, model copy);
        ``grad_scale`` and ``skip`` are device tensors when the scalars stay there."""
        views = self.views
        if self.offload:
            self._grads_to_host()
        step = self._steps if skip is not None else self.step_count
        self.rule.apply(views, step=step, lr=lr, grad_scale=grad_scale,
                        params=self.param_table, skip=skip)
        if self.offload:
            self._params_from_host()

    def _grads_to_host(self):
        """--cpu-offload: this rank's reduced gradients (model dtype) -> fp32 host buffer."""
        for bucket, (o0, o1) in zip(self.layout.buckets, self.part_offsets):
            self.grad_host[o0:o1].copy_(self.grads.owned_chunk(bucket), non_blocking=True)
        synchronize(self.device)

    def _params_from_host(self):
        """--cpu-offload: updated fp32 main values -> the model's parameters (its dtype)."""
        for bucket, main in zip(self.layout.buckets, self.main_chunks):
            self.params.write(bucket, 0, main)
        self.params.flush()
        synchronize(self.device)

    def _all_gather_params(self):
        self.param_gather.start()

    def finish_param_sync(self) -> None:
        """Complete the all-gathers of updated parameters still in flight."""
        self.param_gather.wait_all()

    # ---- reports and checkpoints ----------------------------------------------------------
    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors ``memory_report`` counts, by category (``params``, ``grads``,
        ``main_params``, ``optimizer_states``; ``host_grads`` with --cpu-offload): what a
        memory tracker tags as model states."""
        separate_main = self.low_precision or self.offload
        tensors = {"params": self.params.tensors(), "grads": self.grads.tensors(),
                   "main_params": list(self.main_chunks) if separate_main else [],
                   "optimizer_states": list(self.state.values())}
        if self.offload:
            tensors["grads"] = tensors["grads"] + [self.grad_host]
        return tensors

    def memory_report(self) -> dict:
        nbytes = lambda t: 0 if t is None else t.numel() * t.element_size()  # noqa: E731
        main = sum(nbytes(m) for m in self.main_chunks) \
            if self.low_precision or self.offload else 0
        states = sum(nbytes(t) for t in self.state.values())
        report = {"params": self.params.nbytes, "grads": self.grads.nbytes,
                  "main_params": 0 if self.offload else main,
                  "optimizer_states": 0 if self.offload else states,
                  # buffers of the reduction: staging slots, the ring's receive buffer and segments
                  "staging": self.grads.staging_nbytes,
                  "comm_buffers": comm.communicator_of(self.dp_group).buffer_bytes(
                      self.dp_group) if self.dp_size > 1 else 0,
                  # the ring's shared-memory segments (ranks on one host): shared pages
                  "shared_comm_buffers": comm.communicator_of(self.dp_group)
                  .shared_buffer_bytes(self.dp_group) if self.dp_size > 1 else 0}
        if self.offload:  # host memory, off the accelerator
            report.update(host_main_params=main, host_optimizer_states=states,
                          host_grads=nbytes(self.grad_host))
        return report

    def sharded_state_dict(self) -> dict:
        """This rank's optimizer state as per-parameter fragments (``[param_start,
        param_end)`` of each parameter's flat elements: fp32 main values and states), so a
        checkpoint can be read back at another dp size or stage as well as its own."""
        fragments = {}
        for seg, view in zip(self.layout.segments, self.views):
            entry = {"param_start": seg.param_start, "param_end": seg.param_end,
                     "main": view.main.clone()}
            for k in self.rule.state_names:
                entry[k] = view.state[k].clone()
            fragments.setdefault(seg.name, []).append(entry)
        return {"zero_stage": self.stage, "step": self.steps_done(),
                "scaler": self.scaler.state_dict(), "fragments": fragments,
                "state_names": list(self.rule.state_names)}

    def load_sharded_state_dict(self, state: dict, fragment_reader=None) -> None:
        """Load fragments saved by ``sharded_state_dict``, or read each segment's values
        through ``fragment_reader(name, start, end)`` (a checkpoint at any layout)."""
        self._set_steps(int(state["step"]))
        self.scaler.load_state_dict(state["scaler"])
        frags = state.get("fragments", {})
        self.param_gather.wait_all()
        for seg, view in zip(self.layout.segments, self.views):
            if fragment_reader is not None:
                values = fragment_reader(seg.name, seg.param_start, seg.param_end)
            else:
                values = find_fragment(frags, seg)
            view.main.copy_(values["main"])
            for k in self.rule.state_names:
                view.state[k].copy_(values[k])
            if view.model_out is not None:
                view.model_out.copy_(view.main)
        if self.offload:
            self._params_from_host()
        if self.shard:
            self._all_gather_params()

    def reload_model_params(self) -> None:
        """Refresh fp32 main values from the (just loaded) model parameters."""
        if self._views is None:  # not built yet: they are copied from the parameters then
            return
        if self.offload:
            for bucket, main in zip(self.layout.buckets, self.main_chunks):
                main.copy_(self.params.owned_chunk(bucket))
            return
        for view in self._views:
            if view.model_out is not None:
                view.main.copy_(view.model_out)
