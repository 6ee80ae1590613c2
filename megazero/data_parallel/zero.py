"""Data-parallel optimizer over flat buffers: plain DP (ZeRO-0) and ZeRO stages 1 and 2.

Parallelises the optimizer over the data-parallel group of the ``ParallelState`` passed in.

* Parameters of each dtype live in one flat buffer (``FlatLayout``), cut into buckets; each
  bucket is split into dp chunks and dp rank r owns chunk r (stages 1-2).
* Stage 0: gradients accumulate in a flat buffer, are all-reduced per bucket, and every rank
  updates everything (fp32 main copy for bf16/fp16 models).
* Stage 1: the full gradient buffer is reduce-scattered per bucket at the accumulation
  boundary; each rank keeps fp32 main params and optimizer states of its chunks only, updates
  them and all-gathers the new parameters.
* Stage 2: as stage 1, but each micro-batch's gradients are copied into a bucket as they become
  ready in backward (post-accumulate hooks), reduce-scattered, and only the owned slice is kept
  (accumulated across micro-batches); no full gradient buffer exists.

After the data-parallel reduction, gradients of sequence-parallel parameters are all-reduced
over tp and those of the word embedding tied across pipeline stages over the embedding group
(it sits alone in its bucket so both stages own the same slice). The global gradient norm
counts every element once (tp replicas and the tied copy excluded), overflow is agreed across
all ranks, and the step folds loss-scale, dp averaging and clipping into one factor.
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch

from megazero.data_parallel.layout import FlatLayout
from megazero.data_parallel.params import (
    all_reduce_list,
    collect_named_params,
    counted_in_norm,
    no_weight_decay,
    tied_across_stages,
)
from megazero.data_parallel.zero_state import ZeroCheckpointState
from megazero.distributed import comm
from megazero.distributed.parallel_state import ParallelState
from megazero.optim.grad_scaler import build_grad_scaler
from megazero.optim.rules import LambRule, SegmentView, build_rule
from megazero.tensor_parallel.meta import meta_of

logger = logging.getLogger(__name__)

__all__ = ["ZeroOptimizer", "collect_named_params", "no_weight_decay", "counted_in_norm",
           "tied_across_stages"]


class ZeroOptimizer(ZeroCheckpointState):
    """ZeRO stages 0-2 over ``model_chunks`` (``torch.nn.Module`` list) on ``ps.dp_group``."""

    supported_stages = (0, 1, 2)

    def __init__(self, model_chunks, opt_config, ps: ParallelState, *, lr_scheduler=None,
                 named_params=None):
        self.config, self.ps = opt_config, ps
        self.stage = opt_config.zero_stage
        if self.stage not in self.supported_stages:
            raise ValueError(f"{type(self).__name__} handles stages {self.supported_stages}, "
                             f"got {self.stage}")
        self.dp_group, self.dp_size, self.dp_rank = ps.dp_group, ps.dp_size, ps.dp_rank
        self.shard = self.stage > 0 and self.dp_size > 1
        self.overlap = opt_config.zero_overlap_comm
        self.lr_scheduler = lr_scheduler
        self.scaler = build_grad_scaler(opt_config)
        self.rule = build_rule(opt_config, ps)
        self.step_count = 0
        named = named_params or collect_named_params(model_chunks)
        if not named:
            raise ValueError("the model has no trainable parameters")
        self._build_buffers(named)
        self._in_no_sync = False
        self._pending = []  # async reductions in flight: (work, finish)
        self._callback_queued = False
        if self.stage >= 2 or self.overlap:
            self._register_hooks()
        self.zero_grad()

    # ---- buffers -------------------------------------------------------------------------
    def _build_buffers(self, named):
        dtypes = sorted({p.dtype for _, p in named}, key=str)
        if len(dtypes) != 1:
            raise ValueError(f"all trainable parameters must share one dtype, got {dtypes}")
        self.dtype = dtypes[0]
        self.low_precision = self.dtype != torch.float32
        self.device = self._target_device(named)
        self.layout = self._make_layout(named)
        lay = self.layout
        self._build_param_storage(named)
        self.grad_buffer = None
        if self.stage < 2:
            self.grad_buffer = torch.zeros(lay.numel, dtype=self.dtype, device=self.device)
        part = lay.partition_numel
        self.part_offsets = lay.bucket_owned_offsets()
        self.grad_partition = None
        if self.stage >= 2:
            self.grad_partition = torch.zeros(part, dtype=self.dtype, device=self.device)
        # fp32 main copy: for fp32 models the owned chunks of the parameter storage themselves;
        # with --cpu-offload a separate copy in (pinned, with CUDA) host memory.
        self.offload = self.config.cpu_offload
        host = torch.device("cpu") if self.offload else self.device
        pin = self.offload and self.device.type == "cuda"
        self.main_chunks = []
        for bucket in lay.buckets:
            chunk = self._owned_model_chunk(bucket)
            if self.offload:
                main = torch.empty(chunk.numel(), dtype=torch.float32, pin_memory=pin)
                main.copy_(chunk)
            else:
                main = chunk.float().clone() if self.low_precision else chunk
            self.main_chunks.append(main)
        self.state = {name: torch.zeros(part, dtype=torch.float32, device=host, pin_memory=pin)
                      for name in self.rule.state_names}
        self.grad_host = torch.zeros(part, dtype=torch.float32, pin_memory=pin) \
            if self.offload else None
        self.param_keys = {name: i for i, name in enumerate(lay.ranges)}
        self._views = self._segment_views()
        self._staging = {}
        self._ready = [0] * len(lay.buckets)

    def _target_device(self, named):
        return named[0][1].device

    def _make_layout(self, named) -> FlatLayout:
        ordered = list(reversed(named))  # backward order: last layers' grads are ready first
        tied = {n for n, p in named if tied_across_stages(p, self.ps)}
        return FlatLayout(ordered, self.dp_size, self.dp_rank,
                          bucket_size=self.config.zero_reduce_bucket_size, own_bucket=tied,
                          shard=self.shard)

    def _build_param_storage(self, named):
        """One flat buffer holding every parameter; parameters become views into it."""
        self.param_buffer = torch.zeros(self.layout.numel, dtype=self.dtype, device=self.device)
        for pr in self.layout.ranges.values():
            view = self.param_buffer[pr.start:pr.end]
            view.copy_(pr.param.data.reshape(-1))
            pr.param.data = view.view(pr.param.shape)

    def _owned_model_chunk(self, bucket) -> torch.Tensor:
        """Model-dtype storage of this rank's owned chunk of ``bucket``."""
        c0, c1 = self.layout.owned_chunk(bucket)
        return self.param_buffer[c0:c1]

    def _replicated_buckets(self):
        """Buckets whose full parameters every rank holds (all-gathered after the step)."""
        return self.layout.buckets

    def _owned_grad(self, seg) -> torch.Tensor:
        if self.stage >= 2:
            return self.grad_partition[seg.offset:seg.offset + seg.numel]
        return self.grad_buffer[seg.start:seg.end]

    def _segment_views(self) -> list[SegmentView]:
        views = []
        for seg in self.layout.segments:
            main = self.main_chunks[seg.bucket][seg.chunk_offset:seg.chunk_offset + seg.numel]
            model = self._owned_model_chunk(self.layout.buckets[seg.bucket])
            out = model[seg.chunk_offset:seg.chunk_offset + seg.numel] \
                if self.low_precision and not self.offload else None
            wd = 0.0 if no_weight_decay(seg.name, seg.param) else self.config.weight_decay
            state = {k: v[seg.offset:seg.offset + seg.numel] for k, v in self.state.items()}
            grad = self.grad_host[seg.offset:seg.offset + seg.numel] if self.offload \
                else self._owned_grad(seg)
            views.append(SegmentView(main, grad, out, wd, state, self.param_keys[seg.name]))
        return views

    # ---- gradient accumulation and reduction ---------------------------------------------
    def zero_grad(self) -> None:
        self._wait_pending()
        if self.grad_buffer is not None:
            self.grad_buffer.zero_()
            for pr in self.layout.ranges.values():
                pr.param.grad = self.grad_buffer[pr.start:pr.end].view(pr.param.shape)
        else:
            self.grad_partition.zero_()
            for pr in self.layout.ranges.values():
                pr.param.grad = None
        self._ready = [0] * len(self.layout.buckets)

    @contextlib.contextmanager
    def no_sync(self):
        """Micro-batches inside accumulate locally (stages 0-1); stage 2 reduces anyway."""
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    def _register_hooks(self):
        self._hook_handles = []
        for pr in self.layout.ranges.values():
            h = pr.param.register_post_accumulate_grad_hook(
                lambda p, pr=pr: self._on_grad_ready(pr))
            self._hook_handles.append(h)

    def _on_grad_ready(self, pr):
        if self.stage < 2 and self._in_no_sync:
            return
        if self._ready[pr.bucket] < 0:  # bucket already reduced in this backward
            return
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        bucket = self.layout.buckets[pr.bucket]
        if self.stage >= 2:
            staging = self._staging.get(bucket.index)
            if staging is None:
                staging = torch.zeros(bucket.numel, dtype=self.dtype, device=pr.param.device)
                self._staging[bucket.index] = staging
            off = pr.start - bucket.start
            staging[off:off + pr.numel].copy_(pr.param.grad.reshape(-1))
            pr.param.grad = None  # free: only the owned slice is kept
        self._ready[bucket.index] += 1
        if self._ready[bucket.index] == len(bucket.params):
            self._reduce_bucket(bucket, async_op=self.overlap)

    def _end_of_backward(self):
        self._callback_queued = False
        if self.stage >= 2:  # buckets whose params did not all get gradients: reduce anyway
            for bucket in self.layout.buckets:
                if 0 < self._ready[bucket.index] < len(bucket.params):
                    self._reduce_bucket(bucket, async_op=False)
            self._ready = [0] * len(self.layout.buckets)

    def _reduce_bucket(self, bucket, async_op: bool):
        self._ready[bucket.index] = -len(bucket.params)  # reduced; ignore late hooks
        if self.stage == 0 or not self.shard:
            view = self.grad_buffer[bucket.start:bucket.end] if self.stage < 2 \
                else self._staging.pop(bucket.index)
            work = comm.all_reduce(view, self.dp_group, async_op=async_op)
            finish = None if self.stage < 2 else self._accumulate_owned(bucket, view)
        else:
            src = self.grad_buffer[bucket.start:bucket.end] if self.stage == 1 \
                else self._staging.pop(bucket.index)
            c0, c1 = self.layout.owned_chunk(bucket)
            out = torch.empty(c1 - c0, dtype=self.dtype, device=src.device)
            work = comm.reduce_scatter_into(out, src, self.dp_group, async_op=async_op,
                                            overwrite_input=True)
            if self.stage == 1:
                finish = lambda c0=c0, c1=c1, out=out: self.grad_buffer[c0:c1].copy_(out)
            else:
                finish = self._accumulate_owned(bucket, out)
        if work is not None and async_op:
            self._pending.append((work, finish))
        elif finish is not None:
            finish()
        self._on_bucket_reduced(bucket)

    def _on_bucket_reduced(self, bucket) -> None:
        """Called once a bucket's gradients have left (stage 3 releases its parameters)."""

    def _accumulate_owned(self, bucket, reduced):
        """Stage 2: add the bucket's reduced chunk into the owned gradient partition."""
        o0, o1 = self.part_offsets[bucket.index]
        return lambda: self.grad_partition[o0:o1].add_(reduced)

    def _wait_pending(self):
        for work, finish in self._pending:
            work.wait()
            if finish is not None:
                finish()
        self._pending = []

    def finish_grad_sync(self) -> None:
        """Complete the data-parallel reduction, then the tp and embedding-group syncs."""
        if self.stage < 2:
            for bucket in self.layout.buckets:
                if self._ready[bucket.index] >= 0:  # not reduced by a hook yet
                    self._reduce_bucket(bucket, async_op=False)
        self._wait_pending()
        self._ready = [0] * len(self.layout.buckets)
        self._sync_sequence_parallel_and_tied()

    def _sync_sequence_parallel_and_tied(self):
        ps = self.ps
        if ps.tp_size > 1:
            grads = [self._owned_grad(s) for s in self.layout.segments
                     if meta_of(s.param).sequence_parallel]
            all_reduce_list(grads, ps.tp_group)
        if ps.pp_size > 1:
            grads = [self._owned_grad(s) for s in self.layout.segments
                     if tied_across_stages(s.param, ps)]
            if grads:
                all_reduce_list(grads, ps.embedding_group)

    # ---- the step --------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def grad_norm_sq(self) -> float:
        """Sum of squares of the reduced (still scaled) gradients, over the whole model."""
        grads = [g for s in self.layout.segments
                 if counted_in_norm(s.param, self.ps) and (g := self._owned_grad(s)).numel() > 0]
        local = torch.zeros(1, dtype=torch.float64)
        if grads:
            norms = torch._foreach_norm([g.float() for g in grads]) if self.low_precision \
                else torch._foreach_norm(grads)
            local += torch.stack(norms).double().pow(2).sum()
        comm.all_reduce(local, self.ps.mp_group)
        if self.shard:
            comm.all_reduce(local, self.dp_group)
        return float(local.item())

    @torch.no_grad()
    def step(self) -> tuple[bool, float | None, int]:
        """Returns (update successful, grad norm, number of skipped steps so far delta)."""
        divisor = self.scaler.scale * self.dp_size
        sumsq = self.grad_norm_sq()
        grad_norm = math.sqrt(sumsq) / divisor if math.isfinite(sumsq) else float("nan")
        found_inf = not math.isfinite(sumsq)
        self.scaler.update(found_inf)
        if found_inf:
            return False, grad_norm, 1
        clip = self.config.clip_grad
        coeff = 1.0
        if clip > 0:
            c = clip / (grad_norm + 1e-6)
            coeff = c if c < 1.0 else 1.0
        lr = self.lr_scheduler.get_lr() if self.lr_scheduler is not None else self.config.lr
        self.step_count += 1
        kwargs = {}
        if isinstance(self.rule, LambRule):
            kwargs = self._lamb_kwargs()
        if self.offload:
            self._grads_to_host()
        self.rule.apply(self._views, step=self.step_count, lr=lr, grad_scale=coeff / divisor,
                        **kwargs)
        if self.offload:
            self._params_from_host()
        if self.shard:
            self._all_gather_params()
        return True, grad_norm, 0

    def _grads_to_host(self):
        """--cpu-offload: this rank's reduced gradients (model dtype) -> fp32 host buffer."""
        for bucket, (o0, o1) in zip(self.layout.buckets, self.part_offsets):
            if self.stage >= 2:
                src = self.grad_partition[o0:o1]
            else:
                c0, c1 = self.layout.owned_chunk(bucket)
                src = self.grad_buffer[c0:c1]
            self.grad_host[o0:o1].copy_(src, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _params_from_host(self):
        """--cpu-offload: updated fp32 main values -> the model's parameters (its dtype)."""
        for bucket, main in zip(self.layout.buckets, self.main_chunks):
            self._owned_model_chunk(bucket).copy_(main, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _lamb_kwargs(self):
        flags = torch.zeros(len(self.param_keys), dtype=torch.bool)
        for name, key in self.param_keys.items():
            flags[key] = meta_of(self.layout.ranges[name].param).tensor_parallel
        return {"num_params": len(self.param_keys), "tp_sharded": flags}

    def _full_model_bucket(self, bucket) -> torch.Tensor:
        return self.param_buffer[bucket.start:bucket.end]

    def _all_gather_params(self):
        works = []
        for bucket in self._replicated_buckets():
            full = self._full_model_bucket(bucket)
            src = self._owned_model_chunk(bucket)  # updated in place by the rule
            works.append(comm.all_gather_into(full, src, self.dp_group,
                                              async_op=self.overlap))
        for w in works:
            if w is not None and self.overlap:
                w.wait()

    # ---- reports and checkpoints ----------------------------------------------------------
    def memory_report(self) -> dict:
        nbytes = lambda t: 0 if t is None else t.numel() * t.element_size()  # noqa: E731
        main = sum(nbytes(m) for m in self.main_chunks) \
            if self.low_precision or self.offload else 0
        states = sum(nbytes(t) for t in self.state.values())
        report = {"params": nbytes(self.param_buffer),
                  "grads": nbytes(self.grad_buffer) + nbytes(self.grad_partition),
                  "main_params": 0 if self.offload else main,
                  "optimizer_states": 0 if self.offload else states}
        if self.offload:  # host memory, off the accelerator
            report.update(host_main_params=main, host_optimizer_states=states,
                          host_grads=nbytes(self.grad_host))
        return report
