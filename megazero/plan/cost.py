"""Predicted step time of a layout: FLOPs at a calibrated fraction of peak, memory-bound
ops by bytes, collectives by ring cost on the link their group spans, and the pipeline.

Per micro-batch and pipeline stage (b: micro-batch, s: sequence, h: hidden, t: tp, a:
heads, e: bytes per element), per transformer layer:

* GEMMs: qkv ``[bs, h] x [h, 3h/t]``, projection ``[bs, h/t] x [h/t, h]``, MLP
  ``[bs, h] x [h, f/t]`` and ``[bs, f/t] x [f/t, h]``; attention ``a/t`` x b batched
  ``[s, d] x [d, s]`` and ``[s, s] x [s, d]`` (d = h/a). Each runs at
  ``peak x gemm_max / (1 + k/M + k/K + k/N)`` (k = ``gemm_half_dim``): large GEMMs reach
  ``gemm_max`` of peak, a thin dimension (h/t, the head size) costs efficiency. Backward is
  twice the forward FLOPs; full recompute adds one forward, selective the attention core.
* memory-bound kernels (norms, bias-dropout-add, GELU, softmax and dropout over ``a s^2 b / t``
  when the attention is not fused): bytes at ``hbm x hbm_bandwidth``; backward twice.
* tensor parallel: the layer's collectives as ``collectives.layer_tp_ops`` has them, 2
  all-reduces forward and 2 backward of ``b s h e`` bytes (an all-gather and a
  reduce-scatter in place of each with sequence parallelism: the same bytes), 2 more with
  full recompute; ring cost ``2 (t-1)/t bytes / bw + 2 (t-1) latency`` on NVLink. (The
  embedding's, output layer's and loss's are left to ``blocking_calls``.)

The pipeline (``pp`` stages, ``m`` micro-batches, ``v`` chunks per stage) takes
``(m + (p-1)/v) x`` the slowest stage's forward+backward (the 1F1B / interleaved bubble),
plus point-to-point exchanges of ``b s h e`` (divided by t with sequence parallelism) per
micro-batch. Data-parallel gradient reduction (all-reduce, or reduce-scatter and
all-gather for ZeRO 1-3, ZeRO-3's parameter gathers; bytes from the stage's parameter count,
not the exact padded buckets ``collectives`` counts) runs on the link the dp group spans;
where the runtime overlaps it (``Runtime``), only the part longer than the backward it hides
behind is exposed. The optimizer step streams its partition's bytes through HBM (through
host memory and PCIe with CPU offload).

On a CPU machine whose ranks share the cores (``System.ranks_share_cores``) three host costs
join: each layer's and micro-batch's operator overhead (``layer_overhead``,
``recompute_overhead``, ``microbatch_overhead``: CPU time, stretched by the ranks per core
like the compute); with more ranks than cores, every blocking collective and pipeline
exchange costs ``sync_cost`` for its group size (the peer it waits for is often
descheduled): ``blocking_calls``, the calls ``collectives.predicted_collectives`` predicts
for the fullest stage, which tests/test_plan_collectives.py holds equal to what the dry run
records (tp: per layer, the embedding, the output layer and the loss's two all-reduces, the
sp gradients; pp: the exchanges the schedule posts; dp: per bucket or ZeRO-3 unit as the
optimizer reduces and gathers, order checks, loss and norm; mp and embedding groups); and a
pipeline's bubble shrinks, since a waiting stage leaves its core to another rank (absorbed
entirely at twice as many ranks as cores).

``Runtime.compute_scale`` stretches the device's compute (GEMMs, attention, memory-bound
kernels, the loss, the optimizer step on the device) by megazero's measured runtime factor
(``megazero_runtime``: SYSTEM.json's calibrated ``megazero_runtime``). Communication is not
scaled: the factor is fitted to one-GPU steps, which issue no collectives, so nothing
measured says megazero's are slower than modelled; the bubble and the window that hides
data-parallel communication follow from the stretched compute.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megazero.config import ModelConfig
from megazero.distributed.comm import RING_MIN_BYTES
from megazero.plan.collectives import allreduce_equivalents, blocking_calls_of, layer_tp_ops
from megazero.plan.layout import Job, Layout
from megazero.plan.system import System


@dataclass(frozen=True)
class Runtime:
    """What the training runtime does, as far as time goes. ``megazero`` by default; the
    published Megatron runs are reproduced with their own (``published.py``)."""

    name: str = "megazero"
    grad_bytes: int | None = None  # bytes per gradient element reduced; None: model dtype
    dp_overlap: bool = True  # gradient reduction overlapped with the backward
    fused_attention: bool = True  # attention core fused (no s^2 tensors through HBM)
    optimizer_bytes: int = 28  # bytes per owned element the update streams
    p2p_overlap: bool = True  # interleaved schedule: exchanges hidden behind compute
    # device compute time / the Megatron-2021-level prediction (megazero's measured factor)
    compute_scale: float = 1.0


MEGAZERO = Runtime()


def megazero_runtime(system: System) -> Runtime:
    """megazero's runtime on ``system``: ``MEGAZERO`` with the calibrated factor of its
    ``megazero_runtime`` when it has one (Megatron-2021-level compute otherwise)."""
    mr = system.megazero_runtime
    if mr is None or not mr.calibrated:
        return MEGAZERO
    return Runtime(name=f"megazero ({mr.variant}, measured)", compute_scale=mr.factor)
# share of an overlapped collective that cannot hide (the first gather and the last bucket's
# reduction have nothing to overlap with)
OVERLAP_LOSS = 0.125


@dataclass
class StepTime:
    """Seconds of one step, by part (``total`` is the prediction)."""

    total: float = 0.0
    compute: float = 0.0  # slowest stage's forward+backward of all its micro-batches
    bubble: float = 0.0
    tp_comm: float = 0.0  # per step, on the critical path (inside compute)
    pp_comm: float = 0.0
    dp_comm: float = 0.0  # whole duration of the dp collectives
    dp_exposed: float = 0.0
    optimizer: float = 0.0
    overhead: float = 0.0
    sync: float = 0.0  # blocking calls waiting for descheduled peers (ranks > cores)
    model_flops: float = 0.0  # per step, whole job, without recompute (MFU's numerator)
    hardware_flops: float = 0.0  # with recompute
    parts: dict = field(default_factory=dict)

    @property
    def bubble_fraction(self) -> float:
        return self.bubble / self.total if self.total else 0.0


def gemm_efficiency(system: System, m: float, k: float, n: float) -> float:
    e = system.efficiency
    d = e.gemm_half_dim
    return e.gemm_max / (1.0 + d / m + d / k + d / n)


def gemm_time(system: System, peak: float, m: float, k: float, n: float,
              count: float = 1.0) -> float:
    return count * 2.0 * m * k * n / (peak * gemm_efficiency(system, m, k, n))


def ring_time(link, nbytes: float, n: int, kind: str, eff: float) -> float:
    """Ring all-reduce (``ar``), reduce-scatter or all-gather (``rs``/``ag``) of ``nbytes``
    (the full buffer) over ``n`` ranks."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    steps = 2 * (n - 1) if kind == "ar" else (n - 1)
    return steps / n * nbytes / (link.bandwidth * eff) + steps * link.latency


def model_flops_per_step(m: ModelConfig, global_batch: int, recompute: str = "none") -> float:
    """FLOPs of one step over the whole job: forward and backward of every GEMM and the
    attention, the logits; full recompute adds a forward of the layers (Narayanan et al.
    eq. 3: 96 B s l h^2 (1 + s/6h + V/16lh)), selective the attention core."""
    h, s, L, V = m.hidden_size, m.seq_length, m.num_layers, m.vocab_size
    f = m.ffn_hidden_size or 4 * h
    qkv = (m.num_attention_heads + 2 * m.kv_heads) * m.head_dim
    gemm = 2 * s * (h * qkv + h * h + h * f * (3 if m.swiglu else 2))  # per sequence, fwd
    attn = 4 * s * s * h
    logits = 2 * s * h * V
    fwd = L * (gemm + attn)
    extra = {"none": 0, "selective": L * attn, "full": fwd}[recompute]
    return global_batch * (3 * fwd + extra + 3 * logits)


def _layer_parts(m: ModelConfig, lay: Layout, job: Job, system: System, rt: Runtime,
                 peak: float) -> dict:
    """Seconds of one layer for one micro-batch: forward, backward, recompute, tp comm."""
    b, s, h, t = lay.micro_batch, m.seq_length, m.hidden_size, lay.tp
    e = job.elem_bytes
    a, d = m.num_attention_heads, m.head_dim
    f = m.ffn_hidden_size or 4 * h
    qkv = (a + 2 * m.kv_heads) * d
    bs = b * s
    fc1 = f * (2 if m.swiglu else 1)
    c = rt.compute_scale
    gemm = c * (gemm_time(system, peak, bs, h, qkv / t) + gemm_time(system, peak, bs, h / t, h)
                + gemm_time(system, peak, bs, h, fc1 / t) + gemm_time(system, peak, bs, f / t, h))
    attn = c * gemm_time(system, peak, s, d, s, count=2 * b * a / t)
    # a CPU rank streams memory with its share of a core, as it multiplies (and at the
    # runtime's measured pace)
    hbm = system.hbm_bandwidth * system.efficiency.hbm * system.compute_share(job.world) / c
    sp_div = t if lay.sp else 1
    elem = (4 * e + 2 * (3 * e + 1)) * bs * h / sp_div  # norms, bias-dropout-add x2
    elem += (2 * e * fc1 / t + 6 * e * h / t) * bs  # bias+GELU, qkv split copies
    # on a CPU, torch's only fused attention kernel (flash) takes no dropout: with the
    # default attention dropout the core runs unfused (scores, softmax, mask through memory)
    fused = rt.fused_attention and not system.ranks_share_cores
    core_bytes = 0.0 if fused else (4 * e + 1) * a * s * s * b / t
    fwd_mem = (elem + core_bytes) / hbm
    link = system.group_link(1, t)
    eff = system.efficiency.network
    one = ring_time(link, bs * h * e, t, "ar", eff)  # an all-reduce (or AG + RS)
    # the layer's tp collectives (collectives.layer_tp_ops), in all-reduces of [s, b, h]
    ops = {k: allreduce_equivalents(v) for k, v in layer_tp_ops(lay).items()}
    fwd = gemm + attn + fwd_mem
    recompute = {"none": 0.0, "selective": attn + core_bytes / hbm,
                 "full": fwd + ops["recompute"] * one}[lay.recompute]
    return {"fwd": fwd + ops["fwd"] * one, "bwd": 2 * fwd + ops["bwd"] * one + recompute,
            "tp": (ops["fwd"] + ops["bwd"] + ops["recompute"]) * one}


def _head_parts(m: ModelConfig, lay: Layout, job: Job, system: System, rt: Runtime,
                peak: float) -> dict:
    """Seconds of the output layer and loss (last stage) for one micro-batch."""
    b, s, h, t = lay.micro_batch, m.seq_length, m.hidden_size, lay.tp
    V = m.vocab_size
    c = rt.compute_scale
    logits = c * gemm_time(system, peak, b * s, h, V / t)
    hbm = system.hbm_bandwidth * system.efficiency.hbm * system.compute_share(job.world) / c
    loss = 3 * 4 * b * s * V / t / hbm  # fp32 softmax cross-entropy, read/write
    return {"fwd": logits + loss, "bwd": 2 * logits + loss}


def step_time(job: Job, lay: Layout, system: System, rt: Runtime = MEGAZERO) -> StepTime:
    m = job.model
    share = system.compute_share(job.world)
    peak = system.peak(job.dtype) * share
    out = StepTime()
    mb = lay.microbatches(job.global_batch)
    layers_per_stage = m.num_layers // lay.pp
    layer = _layer_parts(m, lay, job, system, rt, peak)
    head = _head_parts(m, lay, job, system, rt, peak)
    e = job.elem_bytes
    # per micro-batch, per stage: the last stage carries the head
    stage_fwd = layers_per_stage * layer["fwd"] + head["fwd"] * (1 if lay.pp > 1 else 1)
    stage_bwd = layers_per_stage * layer["bwd"] + head["bwd"]
    # pipeline exchanges of one micro-batch, each way (scatter/gather over tp with sp)
    p2p = 0.0
    if lay.pp > 1:
        link = system.intra_node if job.world <= system.gpus_per_node else system.inter_node
        nbytes = lay.micro_batch * m.seq_length * m.hidden_size * e / (lay.tp if lay.sp else 1)
        p2p = nbytes / (link.bandwidth * system.efficiency.network) + link.latency
        if lay.virtual > 1 and rt.p2p_overlap:
            p2p *= 0.25  # most exchanges are in flight during the next chunk's compute
        else:
            p2p *= 2  # send and receive not hidden: forward and backward each
    # host work per micro-batch: CPU time, stretched like the compute where ranks share cores
    host = system.microbatch_overhead + layers_per_stage * (
        system.layer_overhead + (system.recompute_overhead if lay.recompute == "full"
                                 else 0.0))
    per_mb = stage_fwd + stage_bwd + p2p + host / share
    out.compute = mb * per_mb
    out.bubble = (lay.pp - 1) / lay.virtual * per_mb if lay.pp > 1 else 0.0
    if system.ranks_share_cores and system.cores and job.world > system.cores:
        # a stage waiting in the bubble leaves its core to another rank: with twice as many
        # ranks as cores the bubble is absorbed (linearly in between)
        out.bubble *= max(0.0, min(1.0, 2 * system.cores / job.world - 1))
    out.tp_comm = mb * layers_per_stage * layer["tp"]
    out.pp_comm = mb * p2p
    # data parallel: this stage's gradients (and ZeRO's parameter gathers)
    stage_params = _stage_param_elems(m, lay)
    dp_link = system.group_link(lay.tp, lay.dp)
    eff = system.efficiency.network
    g = rt.grad_bytes or e
    window = 0.0  # the compute an overlapped dp collective hides behind
    if lay.dp > 1:
        if lay.zero == 0:
            reduce = ring_time(dp_link, stage_params * g, lay.dp, "ar", eff)
            gather = 0.0
        else:
            reduce = ring_time(dp_link, stage_params * g, lay.dp, "rs", eff)
            gather = ring_time(dp_link, stage_params * e, lay.dp, "ag", eff)
        if lay.zero >= 2:
            reduce *= mb  # reduced at every micro-batch
        if lay.zero == 3:
            gather *= 2 * mb  # every unit gathered for forward and backward
        out.dp_comm = reduce + gather
        if rt.dp_overlap:
            # one link carries reductions and gathers: together they hide behind the
            # compute they overlap (the last micro-batch's backward and the next step's
            # first forward for ZeRO 0-1; every micro-batch for ZeRO 2-3), less what must
            # precede or follow it (the last bucket, the first unit: OVERLAP_LOSS)
            window = stage_bwd + (stage_fwd if gather else 0.0)
            if lay.zero >= 2:
                window = mb * (stage_bwd + (stage_fwd if lay.zero == 3 else 0.0)) + \
                    (stage_fwd if lay.zero == 2 else 0.0)
            busy = reduce + gather
            out.dp_exposed = max(busy * OVERLAP_LOSS, busy - window * (1 - OVERLAP_LOSS))
        else:
            out.dp_exposed = reduce + gather
    owned = stage_params / (lay.dp if lay.zero >= 1 else 1)
    if lay.offload:
        host = getattr(system, "host_bandwidth", 0.0) or 100e9
        pcie = 25e9
        out.optimizer = owned * rt.optimizer_bytes / host + owned * 2 * e / pcie
    else:
        out.optimizer = rt.compute_scale * owned * rt.optimizer_bytes / (
            system.hbm_bandwidth * system.efficiency.hbm * share)
    out.overhead = system.step_overhead
    # counted only where they cost anything (ranks outnumbering the cores they share)
    charged = system.sync_cost and system.ranks_share_cores and system.cores and \
        job.world > system.cores
    calls = blocking_calls(job, lay) if charged else {}
    out.sync = sum(n * system.call_cost(job.world, g) for g, n in calls.items())
    out.total = out.compute + out.bubble + out.dp_exposed + out.optimizer + out.overhead + \
        out.sync
    out.model_flops = model_flops_per_step(m, job.global_batch)
    out.hardware_flops = model_flops_per_step(m, job.global_batch, lay.recompute)
    out.parts = {"layer": layer, "head": head, "p2p": p2p, "per_microbatch": per_mb,
                 "calls": calls, "compute_scale": rt.compute_scale,
                 "dp_window": window}
    return out


def blocking_calls(job: Job, lay: Layout) -> dict:
    """Blocking collectives and exchanges per step by group size (``"p2p"``: pipeline
    exchanges, each posted and waited as one) of the stage that issues the most (first,
    middle or last): every call ``collectives.predicted_collectives`` predicts for it, the
    collectives the dry run records (tests/test_plan_collectives.py). ZeRO-3's order checks
    of buffers from ``comm.RING_MIN_BYTES`` ride on the ring (gloo's default ``auto``
    policy, when it picks the ring); smaller ones are a blocking all-gather each."""
    return blocking_calls_of(job, lay, ring_min_bytes=RING_MIN_BYTES)


def _stage_param_elems(m: ModelConfig, lay: Layout) -> float:
    """Parameters of the largest stage (per tp rank): its layers, plus the embedding."""
    h = m.hidden_size
    f = m.ffn_hidden_size or 4 * h
    qkv = (m.num_attention_heads + 2 * m.kv_heads) * m.head_dim
    layer = (h * qkv + h * h + h * f * (3 if m.swiglu else 2)) / lay.tp + 6 * h
    emb = m.vocab_size * h / lay.tp
    return m.num_layers // lay.pp * layer + emb
