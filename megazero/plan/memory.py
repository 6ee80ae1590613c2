"""Memory of one rank for a layout: model states exactly, activations from dry-run
calibrated coefficients, and the headroom the planner keeps.

Model states (parameters, gradients, fp32 main parameters, optimizer states) come from
megazero's own partition arithmetic: the rank's model chunks are built on the meta device
with offline process groups (``tools.offline.offline_parallel_state``: the local shapes a
run at that layout creates) and laid out by the optimizer's own functions
(``data_parallel.zero.bucketed_layout`` for ZeRO 0-2; ``zero3_units.plan_units`` and
``zero3.unit_layout`` for ZeRO-3). Bytes follow what the optimizer allocates
(``ZeroOptimizer.state_tensors``): the flat parameter buffer (ZeRO-3: the owned partition
and the persistent bucket), the gradient buffer (full for ZeRO 0-1, the owned partition for
2-3), fp32 main values of the owned partition (none apart for fp32 models), one fp32 tensor
per state of the update rule (Adam: 2). The dry run measures the same allocations and equals
a real gloo run byte for byte (``tests/test_dryrun.py``); ``tests/test_plan_memory.py``
checks these figures against real gloo runs.

Activations per layer and micro-batch are ``A s b h + B s b h / t + C a s^2 b / t`` bytes
(``A`` folds into ``B`` with sequence parallelism), coefficients per class (sequence
parallel, recompute, fused attention, dropout, dtype) fitted to dry runs of one and two
layers (``calibrate_activations``; cached in ``activations.json``). Korthikanti et al.
Table 2 has A = 10, B = 24, C = 5 (no recompute), B = 34 with sp, A = 10, B = 24, C = 0
selective, 2 s b h full recompute. The schedule keeps ``in_flight`` micro-batches (1F1B:
``min(p - r, m)`` on stage r; interleaved: Megatron's warmup count) per stage.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass, field

import torch

from megazero.config import ModelConfig, OptimizerConfig
from megazero.data_parallel.zero import bucketed_layout
from megazero.data_parallel.zero3 import unit_layout
from megazero.data_parallel.zero3_units import plan_units
from megazero.model import build_gpt_model_chunks, gpt_zero3_units
from megazero.plan.activations import ActivationModel
from megazero.plan.layout import Job, Layout
from megazero.tensor_parallel.meta import ensure_meta
from megazero.tools.offline import offline_parallel_state

logger = logging.getLogger(__name__)

GiB = 1 << 30
# Reserved beyond the tensors a run holds: the caching allocator's fragmentation, the CUDA
# context, NCCL and cuBLAS workspaces. The planner refuses a layout whose predicted peak is
# above (1 - HEADROOM_FRACTION) x memory - HEADROOM_BYTES.
HEADROOM_FRACTION = 0.10
HEADROOM_BYTES = 2 * GiB


@dataclass
class RankMemory:
    """Bytes of one rank (the fullest pipeline stage), by kind."""

    params: int = 0
    grads: int = 0
    main_params: int = 0
    optimizer_states: int = 0
    host: int = 0  # CPU offload: main values, states and fp32 gradients in host memory
    activations: int = 0  # what the forward passes in flight keep
    transient: int = 0  # the largest working set on top (backward, recompute, gathers)
    stage: int = 0  # pipeline rank these figures are for
    by_stage: dict = field(default_factory=dict)

    @property
    def states(self) -> int:
        return self.params + self.grads + self.main_params + self.optimizer_states

    @property
    def peak(self) -> int:
        return self.states + self.activations + self.transient


def _opt_config(lay: Layout) -> OptimizerConfig:
    return OptimizerConfig(zero_stage=lay.zero, cpu_offload=lay.offload)


@functools.lru_cache(maxsize=4096)
def _stage_named(model_key: tuple, tp: int, pp: int, virtual: int, pp_rank: int, dp: int):
    """The named parameters of (tp rank 0, ``pp_rank``) and its chunks, built on meta."""
    model = ModelConfig(**dict(model_key))
    ps = offline_parallel_state(tp, 0, pp, pp_rank, dp, 0, virtual if virtual > 1 else None)
    chunks = build_gpt_model_chunks(model, ps, device="meta")
    named = []
    seen = set()
    for c in chunks:
        for n, p in c.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                ensure_meta(p)
                named.append((n, p))
    return ps, chunks, named


def model_key(m: ModelConfig) -> tuple:
    return tuple(sorted(dataclasses.asdict(m).items()))


def model_state_bytes(job: Job, lay: Layout, pp_rank: int) -> dict:
    """Bytes the optimizer allocates on pipeline rank ``pp_rank`` (any tp and dp rank):
    ``params``, ``grads``, ``main_params``, ``optimizer_states`` on the device, ``host``
    (CPU offload) and ``staging`` (ZeRO 2-3's gradient slots, part of the working set)."""
    model = _with_dtype(job)
    ps, chunks, named = _stage_named(model_key(model), lay.tp, lay.pp, lay.virtual, pp_rank,
                                     lay.dp)
    opt = _opt_config(lay)
    e = job.elem_bytes
    n_states = 2  # Adam's exp_avg and exp_avg_sq (the default rule)
    if lay.zero == 3:
        units, persistent = plan_units(chunks, named, gpt_zero3_units,
                                       opt.zero_param_persistence_threshold)
        layout = unit_layout(named, units, persistent, ps)
        persist = layout.buckets[-1].numel if persistent else 0
        params = (layout.partition_numel + persist) * e
        grads = layout.partition_numel * e
    else:
        shard = lay.zero > 0 and lay.dp > 1
        layout = bucketed_layout(named, ps, opt, shard)
        params = layout.numel * e
        grads = (layout.numel if lay.zero < 2 else layout.partition_numel) * e
    part = layout.partition_numel
    # ZeRO 2-3 stage each bucket's gradients in reused slots of the largest bucket's size:
    # one being reduced while the next micro-batch fills another (grads.SlotPool)
    staging = 2 * max((b.numel for b in layout.buckets), default=0) * e \
        if lay.zero >= 2 and lay.dp > 1 else 0
    separate_main = e != 4 or lay.offload
    main = part * 4 if separate_main else 0
    states = n_states * part * 4
    if lay.offload:
        return {"params": params, "grads": grads, "main_params": 0, "optimizer_states": 0,
                "host": main + states + part * 4, "staging": staging}
    return {"params": params, "grads": grads, "main_params": main,
            "optimizer_states": states, "host": 0, "staging": staging}


def _with_dtype(job: Job) -> ModelConfig:
    dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[job.dtype]
    return dataclasses.replace(job.model, params_dtype=dtype)


def in_flight(lay: Layout, microbatches: int, pp_rank: int) -> float:
    """Layer-microbatches of activations stage ``pp_rank`` holds at most, in units of one
    chunk's layers (1F1B: min(p - r, m); interleaved: Megatron's warmup + 1 chunks)."""
    p, v, m = lay.pp, lay.virtual, microbatches
    if p == 1:
        return 1
    if v == 1:
        return min(p - pp_rank, m)
    total = m * v
    if m == p:
        return total
    return min((p - pp_rank - 1) * 2 + (v - 1) * p + 1, total)


def stage_ranks(pp: int) -> list[int]:
    """Pipeline ranks whose memory can differ: the first, a middle one, the last."""
    return sorted({0, pp // 2, pp - 1})


def rank_memory(job: Job, lay: Layout, acts: ActivationModel,
                stages: list[int] | None = None) -> RankMemory:
    """The fullest stage's memory (by predicted peak) among ``stages`` (default: first,
    middle, last)."""
    m = job.model
    mbs = lay.microbatches(job.global_batch)
    layers_per_chunk = m.num_layers // (lay.pp * lay.virtual)
    per_layer = acts.layer_bytes(job, lay)
    best = None
    for r in stages if stages is not None else stage_ranks(lay.pp):
        st = model_state_bytes(job, lay, r)
        act = in_flight(lay, mbs, r) * layers_per_chunk * per_layer
        first, last = r == 0, r == lay.pp - 1
        act += acts.edge_bytes(job, lay, first=first, last=last) * min(
            in_flight(lay, mbs, r), mbs)
        transient = acts.transient_bytes(job, lay, last=last, stage_params=st["params"],
                                         layers_per_stage=layers_per_chunk * lay.virtual)
        transient += st["staging"]
        mem = RankMemory(st["params"], st["grads"], st["main_params"], st["optimizer_states"],
                         st["host"], int(act), int(transient), r)
        if best is None or mem.peak > best.peak:
            best = mem
        best.by_stage[r] = mem.peak
    return best


def usable_bytes(device_bytes: float, headroom_fraction: float = HEADROOM_FRACTION,
                 headroom_bytes: float = HEADROOM_BYTES) -> float:
    """Device bytes the tensors of a layout may take (the rest is headroom)."""
    return device_bytes * (1 - headroom_fraction) - headroom_bytes


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
