"""DeepSpeed ZeRO-1/2 driver of ``bench_peers.py``: its ``ds-zero1`` and ``ds-zero2`` contenders.

``build_deepspeed(stage, model, args)`` wraps the megazero ``GPTModel`` that bench_peers built
(so the initial weights are the same as every other contender's) in a ``DeepSpeedEngine``
configured as the benchmark's protocol says: ZeRO stage 1 or 2, fp32 (no fp16/bf16, so no loss
scaling), ``gradient_clipping`` 0, one micro-batch of ``args.micro_batch`` sequences per step
(``gradient_accumulation_steps`` 1), every other ZeRO setting at DeepSpeed's default (so
``overlap_comm`` is off for stages 1-2, ``contiguous_gradients`` on, ``reduce_bucket_size`` and
``allgather_bucket_size`` 5e8 elements). The client optimizer is ``torch.optim.AdamW`` (lr
``args.lr``, betas 0.9/0.999, eps 1e-8, weight decay 0, ``fused=True`` where torch has a fused
kernel for the model's device: CPU and CUDA do); DeepSpeed wraps it in its
``DeepSpeedZeroOptimizer``, which points the AdamW's param group at this rank's flat fp32
partition. The data-parallel group is the default process group (bench_peers' gloo group,
which DeepSpeed adopts as it is).

It returns ``(engine, DeepSpeedOpt)``: the engine is called like the megazero model
(``engine(tokens, positions, None, labels=labels)`` returns the per-token losses), and
``DeepSpeedOpt`` has the methods bench_peers calls, mapped onto DeepSpeed's training loop:

* ``zero_grad()``: ``engine.zero_grad()`` (``engine.step()`` already cleared them);
* ``backward(loss)``: ``engine.backward(loss)``, DeepSpeed's own backward: autograd, the
  gradient hooks of ZeRO (stage 2 reduces its buckets as backward fills them) and the
  epilogue that finishes the reduction (stage 1 reduces everything there). So, like DDP's and
  FSDP2's, the gradient reduction shows in the backward phase;
* ``finish_grad_sync()``: nothing (the reduction finished inside ``backward``);
* ``step()``: ``engine.step()``: the AdamW step on the fp32 partition, the copy back into the
  flat parameter buffer and its all-gather, then DeepSpeed's ``zero_grad``;
* ``memory_report()``: the bytes of DeepSpeed's real tensors on this rank, each storage once:
  ``params`` (the flat parameter buffers the model's parameters are views of), ``grads`` (the
  gradient storage alive now: parameter grads and their ``grad_accum``, the averaged gradient
  partitions, ``grads_in_partition``, the fp32 partition's grad), ``main_params`` (the flat
  fp32 partitions: DeepSpeed keeps this separate copy of its partition even in fp32),
  ``optimizer_states`` (the client AdamW's state tensors, not its scalar ``step``) and
  ``ipg_buffers`` (the contiguous-gradient buckets of the reduction: a buffer, like megazero's
  staging slots). DeepSpeed allocates its gradient storage in every backward (a bucket of
  ``reduce_bucket_size`` elements, 2 GB in fp32, that the parameters' grads are views of;
  on the CPU only its used pages become resident) and frees it by the end of the step, so
  after a step ``grads`` and ``ipg_buffers`` are 0. ``grads_peak`` (the gradients' own
  bytes) and ``ipg_buffers_peak`` (the buckets' allocated bytes) count them in the first
  backward, when DeepSpeed's epilogue releases the bucket (the reduced partition built,
  nothing freed yet); bench_peers adds no ``*_peak`` key to what the process holds.

bench_peers' step calls ``loss.backward()``; with this driver it calls the contender's
``backward(loss)`` when it has one (``DeepSpeedOpt.backward``), so that the backward is
DeepSpeed's documented ``engine.backward(loss)``, timed as the backward phase. (DeepSpeed
0.19 also accepts a plain ``loss.backward()`` on a ZeRO engine, running the same epilogue
from an autograd callback, with bit-identical results; older releases need
``engine.backward``, and without it they skip the gradient reduction.)

DeepSpeed on the CPU: ``DS_ACCELERATOR=cpu`` (set here when the model is on the CPU, before
``deepspeed`` is first imported) selects its CPU accelerator, whose communication backend is
gloo when oneCCL's bindings are not installed. That accelerator is a "synchronized device"
without streams, so ``overlap_comm`` (off by default for stages 1-2 anyway) could not overlap
anything. Each bucket is reduced by an all-reduce of the whole bucket
(``use_multi_rank_bucket_allreduce``, on by default), after which every rank keeps its
partition. An ``ImportError`` of deepspeed (it is not a megazero dependency), or a DeepSpeed
accelerator that does not match the model's device, raises ``DeepSpeedUnavailable`` (an
``ImportError``), which bench_peers turns into a SKIP with the reason.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings

import torch
import torch.distributed as dist

BETAS, EPS = (0.9, 0.999), 1e-8


class DeepSpeedUnavailable(ImportError):
    """DeepSpeed cannot be imported (or not for this device): the contender is skipped."""


def _import_deepspeed(device: torch.device):
    """``deepspeed``, its accelerator selected for ``device`` before its first import."""
    wanted = device.type
    os.environ.setdefault("DS_ACCELERATOR", wanted)
    try:
        import deepspeed
        from deepspeed.accelerator import get_accelerator
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken install failing at import
        raise DeepSpeedUnavailable(f"deepspeed not importable ({type(e).__name__}: {e})") from e
    name = get_accelerator().device_name()
    if name != wanted:
        raise DeepSpeedUnavailable(f"deepspeed's accelerator is {name!r} but the model is on "
                                   f"{device} (DS_ACCELERATOR={os.environ['DS_ACCELERATOR']})")
    for log in ("DeepSpeed", "deepspeed"):  # its INFO lines on every rank and step
        logging.getLogger(log).setLevel(logging.WARNING)
    return deepspeed


def _config(stage: int, args) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": args.micro_batch * dist.get_world_size(),
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},  # overlap_comm etc.: DeepSpeed's defaults
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def build_deepspeed(stage: int, model: torch.nn.Module, args):
    """``(engine, optimizer-like)`` of DeepSpeed ZeRO ``stage`` (1 or 2) over ``model``."""
    if stage not in (1, 2):
        raise ValueError(f"ZeRO stage {stage}: this driver runs stages 1 and 2")
    device = next(model.parameters()).device
    deepspeed = _import_deepspeed(device)
    if not dist.is_initialized():
        raise RuntimeError("build_deepspeed expects torch.distributed to be initialised")
    # DeepSpeed's engine insists on LOCAL_RANK (its launchers set it); bench_peers spawns every
    # rank on this host, so the local rank is the rank
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    # adopts the existing (gloo) default group: init_process_group is not called again. On the
    # CPU accelerator this JIT-builds (once per machine, cached) and loads DeepSpeed's shared-
    # memory all-reduce, used by its inference_all_reduce only (and only with LOCAL_SIZE set),
    # and announces it with a print: sent to stderr, off bench_peers' table
    with contextlib.redirect_stdout(sys.stderr):
        deepspeed.init_distributed(dist.get_backend())
    # the client optimizer: torch's AdamW, which DeepSpeed wraps in its DeepSpeedZeroOptimizer
    # (so no DeepSpeed optimizer op is JIT-built)
    client = _adamw(list(model.parameters()), args.lr)
    # DeepSpeed all-gathers with the torch.distributed name that torch now deprecates
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated",
                            category=FutureWarning)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=client,
                                                   config=_config(stage, args),
                                                   dist_init_required=False)
    return engine, DeepSpeedOpt(engine, optimizer, client)


def _adamw(params, lr: float) -> torch.optim.AdamW:
    """AdamW with the fused kernel where torch has one for the device (CPU: torch >= 2.4)."""
    try:
        return torch.optim.AdamW(params, lr=lr, betas=BETAS, eps=EPS, weight_decay=0.0,
                                 fused=True)
    except RuntimeError:  # fused=True on a device torch has no fused AdamW for
        return torch.optim.AdamW(params, lr=lr, betas=BETAS, eps=EPS, weight_decay=0.0)


def _storages(tensors) -> dict[int, int]:
    """{storage address: bytes} of the tensors (None and non-tensors ignored)."""
    out = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            if s.nbytes():
                out[s.data_ptr()] = s.nbytes()
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _flat(x):
    """The tensors in ``x``: a tensor, or nested lists / tuples / dicts of them."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _flat(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _flat(v)


class DeepSpeedOpt:
    """bench_peers' optimizer interface over a ``DeepSpeedEngine`` (see the module docstring)."""

    def __init__(self, engine, zero, client_optimizer):
        self.engine, self.zero, self.client = engine, zero, client_optimizer
        self._peaks = {}
        # Instrumentation, once: DeepSpeed frees its gradient storage (the contiguous-gradient
        # bucket the parameters' grads are views of, the averaged partitions) in its ZeRO
        # epilogue and step, so a report taken after a step cannot see it. It is counted when
        # the first backward's epilogue releases the bucket (the reduced partition built,
        # nothing freed yet); then DeepSpeed's own method is back.
        zero._release_ipg_buffers = self._count_then_release

    def _count_then_release(self):
        del self.zero._release_ipg_buffers  # the class's method again
        tensors = self._tensors()
        bucket = tensors["ipg_buffers"]
        in_bucket = sum(_nbytes(p.grad) for p in self.engine.module.parameters()
                        if p.grad is not None and p.grad.untyped_storage().data_ptr() in bucket)
        self._peaks = {"grads_peak": sum(tensors["grads"].values()) + in_bucket,
                       "ipg_buffers_peak": sum(bucket.values())}
        self.zero._release_ipg_buffers()

    def zero_grad(self):
        self.engine.zero_grad()

    def backward(self, loss):
        self.engine.backward(loss)

    def finish_grad_sync(self):
        pass

    def step(self):
        self.engine.step()

    def _tensors(self) -> dict[str, dict[int, int]]:
        """{category: {storage address: bytes}}, each storage in the first category that
        holds it (params, main_params, optimizer_states, ipg_buffers, grads)."""
        zero, params = self.zero, list(self.engine.module.parameters())
        found = {
            "params": _storages([*params, *zero.bit16_groups_flat]),
            "main_params": _storages(zero.single_partition_of_fp32_groups),
            "optimizer_states": _storages(
                v for st in self.client.state.values() for v in st.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0),
            "ipg_buffers": _storages([  # ipg_buckets in 0.19, ipg_buffer in older releases
                *(t for bucket in getattr(zero, "ipg_buckets", {}).values()
                  for t in bucket.buffer),
                *(getattr(zero, "ipg_buffer", None) or [])]),
            "grads": _storages([
                *(p.grad for p in params),
                *(getattr(p, "grad_accum", None) for p in params),
                *_flat(getattr(zero, "averaged_gradients", None)),
                *_flat(getattr(zero, "all_grad_tensors", None)),
                *_flat(getattr(zero, "grads_in_partition", None)),
                *(m.grad for m in zero.single_partition_of_fp32_groups)]),
        }
        seen = set()
        for storages in found.values():
            for ptr in list(storages):
                if ptr in seen:
                    del storages[ptr]
                seen.add(ptr)
        return found

    def memory_report(self) -> dict:
        report = {k: sum(v.values()) for k, v in self._tensors().items()}
        report.update(self._peaks)
        return report
