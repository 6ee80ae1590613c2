"""Published Megatron-LM throughputs and the planner's predictions of them.

``NARAYANAN_2021``: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM" (arXiv 2104.04473), Table 1: GPT models of 1.7B to 1T
parameters on Selene (A100-80GB), vocabulary 51,200, sequence 2048, with activation
recomputation; per-GPU throughput in TFLOP/s by their eq. (3),
``96 B s l h^2 (1 + s/6h + V/16lh)`` FLOPs per iteration. The same table is the "weak
scaling" figure of NVIDIA/Megatron-LM's README (April 2021).

``KORTHIKANTI_2022``: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models" (arXiv 2205.05198), Tables 3 and 5: 22B to 1T on A100-80GB, data-parallel
size 1; iteration seconds with full recomputation and with sequence parallelism plus
selective recomputation ("present work"; MFU 41.5 / 51.4 / 56.0 / 56.3 %, the Megatron-LM
README's MFU table).

The runs are reproduced at their published tp/pp/dp, batch and recompute; the planner
chooses what the papers leave open (micro-batch, interleaving) as it would for a user, with
the runtime of the time (``MEGATRON_2021``: gradients all-reduced in fp32 after the
backward, fused softmax over ``a s^2`` scores in HBM, no overlap of pipeline exchanges).
"""

from __future__ import annotations

from dataclasses import dataclass

from megazero.plan.cost import Runtime, step_time
from megazero.plan.layout import Job, Layout
from megazero.plan.models import named_model
from megazero.plan.system import System

MEGATRON_2021 = Runtime(name="megatron-2021", grad_bytes=4, dp_overlap=False,
                        fused_attention=False, optimizer_bytes=36, p2p_overlap=False)


@dataclass(frozen=True)
class PublishedRun:
    model: str  # planner model name
    tp: int
    pp: int
    gpus: int
    batch: int
    published: float  # TFLOP/s per GPU (Narayanan) or seconds per iteration (Korthikanti)
    recompute: str = "full"
    sp: bool = False
    note: str = ""

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


# Narayanan et al. 2021, Table 1: (model, tp, pp, GPUs, batch, TFLOP/s per GPU)
NARAYANAN_2021 = [
    PublishedRun("megatron-1.7b", 1, 1, 32, 512, 137),
    PublishedRun("megatron-3.6b", 2, 1, 64, 512, 138),
    PublishedRun("megatron-7.5b", 4, 1, 128, 512, 142),
    PublishedRun("megatron-18b", 8, 1, 256, 1024, 135),
    PublishedRun("megatron-39b", 8, 2, 512, 1536, 138),
    PublishedRun("megatron-76b", 8, 4, 1024, 1792, 140),
    PublishedRun("megatron-145b", 8, 8, 1536, 2304, 148),
    PublishedRun("megatron-310b", 8, 16, 1920, 2160, 155),
    PublishedRun("megatron-530b", 8, 35, 2520, 2520, 163),
    PublishedRun("megatron-1t", 8, 64, 3072, 3072, 163),
]

# Korthikanti et al. 2022, Tables 3 and 5: seconds per iteration (dp = 1)
KORTHIKANTI_2022 = [
    PublishedRun("megatron-22b", 8, 1, 8, 4, 1.42, "full", False, "full recompute"),
    PublishedRun("megatron-22b", 8, 1, 8, 4, 1.10, "selective", True, "sp + selective"),
    PublishedRun("gpt3-175b", 8, 8, 64, 64, 18.13, "full", False, "full recompute"),
    PublishedRun("gpt3-175b", 8, 8, 64, 64, 13.75, "selective", True, "sp + selective"),
    PublishedRun("megatron-530b", 8, 35, 280, 280, 49.05, "full", False, "full recompute"),
    PublishedRun("megatron-530b", 8, 35, 280, 280, 37.83, "selective", True,
                 "sp + selective"),
    PublishedRun("megatron-1t", 8, 64, 512, 512, 94.42, "full", False, "full recompute"),
    PublishedRun("megatron-1t", 8, 64, 512, 512, 71.49, "selective", True, "sp + selective"),
]


def narayanan_flops(run: PublishedRun) -> float:
    """Eq. (3) of Narayanan et al.: FLOPs per iteration, recomputation included."""
    m = named_model(run.model)
    B, s, L, h, V = run.batch, m.seq_length, m.num_layers, m.hidden_size, m.vocab_size
    return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


def candidate_layouts(run: PublishedRun, micro_batches=(1, 2, 4, 8)) -> list[Layout]:
    """The published tp/pp/dp/recompute with each micro-batch and interleaving the batch and
    layers allow (what the papers leave open)."""
    m = named_model(run.model)
    out = []
    for b in micro_batches:
        if run.batch % (b * run.dp):
            continue
        mbs = run.batch // (b * run.dp)
        for v in (1, 2, 3, 4):
            if v > 1 and (run.pp == 1 or m.num_layers % (run.pp * v) or mbs % run.pp):
                continue
            out.append(Layout(run.tp, run.pp, run.dp, b, v, 0, run.sp, run.recompute))
    return out


def predict(run: PublishedRun, system: System, fits=None) -> tuple[float, Layout, float]:
    """(predicted metric, chosen layout, predicted seconds per iteration): the fastest of
    ``candidate_layouts`` that ``fits(job, layout)`` (memory) allows."""
    m = named_model(run.model)
    job = Job(m, run.gpus, run.batch, "bf16")
    best = None
    for lay in candidate_layouts(run):
        if fits is not None and not fits(job, lay):
            continue
        t = step_time(job, lay, system, MEGATRON_2021).total
        if best is None or t < best[0]:
            best = (t, lay)
    if best is None:
        raise ValueError(f"no candidate layout of {run.model} fits")
    t, lay = best
    metric = narayanan_flops(run) / t / run.gpus / 1e12 if run in NARAYANAN_2021 else t
    return metric, lay, t
