"""Published Megatron-LM throughputs on A100-80GB, the layouts they ran at, and the planner's
predictions of them (``fit.py`` fits the A100's efficiency constants to these rows).

``NARAYANAN_2021``: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM" (arXiv 2104.04473), Table 1: GPT models of 1.7B to 1T
parameters on Selene, vocabulary 51,200, sequence 2048, full activation recomputation;
per-GPU throughput in TFLOP/s by their eq. (3), ``96 B s l h^2 (1 + s/6h + V/16lh)`` FLOPs
per iteration. Read from the table as NVIDIA/Megatron-LM's README shows it
(``images/cases_april2021.png``, commit 50a4b5f, 2021-04-08: shapes, model-parallel size,
GPUs, batch, TFLOP/s); its parameter column equals eq. (2) on the shapes of ``models.py``.
The layouts (tp, pp, micro-batch, interleaving, the data-parallel wrapper, fp16) are the
authors' own script for the table, ``examples/sc21/run_table_1.sh`` (commit de7dc40,
2021-08-10): ``DDP=torch`` (PyTorch DDP, the all-reduce overlapped with the backward) for
1.7B-18B, ``DDP=local`` (all-reduce after the backward) from 39B on.

``KORTHIKANTI_2022``: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models" (arXiv 2205.05198), Table 5: seconds per iteration of 22B to 1T,
data-parallel size 1, with full recomputation and with sequence parallelism plus selective
recomputation ("present work"). The paper's text was not available to check: the times and
the layouts of its Table 3 (micro-batch, interleaving) are read from Calculon's validation
data (calculon-ai/calculon commit caa4b11, ``calculon/llm/validation.py`` ``seqsel_tab5`` and
``validation/seqsel/tab5/*.json``), a secondary source. The four "present work" times
reproduce the MFU table of Megatron-LM's README (commit 2e90a342, 41.5 / 51.4 / 56.0 /
56.3 %); the four full-recompute times rest on Calculon alone.

Each row is predicted with the runtime of the time (``runtime``: gradients reduced in fp32,
overlapped only under PyTorch DDP, the softmax over ``a s^2`` scores through HBM, pipeline
exchanges not overlapped) at two layouts: the one the run used (``published_layout``: what
the fit and its held-out errors use) and the one the planner recommends among
``candidate_layouts`` (what a user planning the job would get: ``predict``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megazero.plan.cost import Runtime, step_time
from megazero.plan.layout import Job, Layout
from megazero.plan.models import named_model
from megazero.plan.system import System

MEGATRON_2021 = Runtime(name="megatron-2021", grad_bytes=4, dp_overlap=False,
                        fused_attention=False, optimizer_bytes=36, p2p_overlap=False)
SC21 = "NVIDIA/Megatron-LM examples/sc21/run_table_1.sh @de7dc40"
CALCULON = "calculon-ai/calculon validation/seqsel/tab5 @caa4b11"


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
    paper: str = ""  # "narayanan-2021" (TFLOP/s per GPU) or "korthikanti-2022" (seconds)
    source: str = ""  # where the figure is read (table and row)
    micro_batch: int = 1  # the run's own layout (``layout_source``)
    virtual: int = 1
    ddp_overlap: bool = False  # PyTorch DDP: the all-reduce overlapped with the backward
    dtype: str = "bf16"
    layout_source: str = ""

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


def _narayanan(model, tp, pp, gpus, batch, tflops, mb, v, torch_ddp, lines) -> PublishedRun:
    size = model.split("-")[1].upper()
    return PublishedRun(model, tp, pp, gpus, batch, tflops, paper="narayanan-2021",
                        source=f"Narayanan et al. 2021 Table 1, row {size} (Megatron-LM "
                               "README, images/cases_april2021.png @50a4b5f)",
                        micro_batch=mb, virtual=v, ddp_overlap=torch_ddp, dtype="fp16",
                        layout_source=f"{SC21}, lines {lines}")


# (model, tp, pp, GPUs, batch, TFLOP/s per GPU, micro-batch, interleave, DDP=torch, lines)
NARAYANAN_2021 = [
    _narayanan("megatron-1.7b", 1, 1, 32, 512, 137, 16, 1, True, "14-24"),
    _narayanan("megatron-3.6b", 2, 1, 64, 512, 138, 16, 1, True, "25-35"),
    _narayanan("megatron-7.5b", 4, 1, 128, 512, 142, 16, 1, True, "36-46"),
    _narayanan("megatron-18b", 8, 1, 256, 1024, 135, 8, 1, True, "47-57"),
    _narayanan("megatron-39b", 8, 2, 512, 1536, 138, 4, 1, False, "58-68"),
    _narayanan("megatron-76b", 8, 4, 1024, 1792, 140, 2, 3, False, "69-79"),
    _narayanan("megatron-145b", 8, 8, 1536, 2304, 148, 2, 2, False, "80-90"),
    _narayanan("megatron-310b", 8, 16, 1920, 2160, 155, 1, 2, False, "91-101"),
    _narayanan("megatron-530b", 8, 35, 2520, 2520, 163, 1, 3, False, "102-112"),
    _narayanan("megatron-1t", 8, 64, 3072, 3072, 163, 1, 1, False, "113-123"),
]


def _korthikanti(model, tp, pp, gpus, batch, seconds, present_work, mb, v) -> PublishedRun:
    size = {"megatron-22b": "22B", "gpt3-175b": "175B"}.get(model,
                                                            model.split("-")[1].upper())
    note = "sp + selective" if present_work else "full recompute"
    return PublishedRun(model, tp, pp, gpus, batch, seconds,
                        "selective" if present_work else "full", present_work, note,
                        paper="korthikanti-2022",
                        source=f"Korthikanti et al. 2022 Table 5, row {size}, {note} "
                               "(as calculon/llm/validation.py seqsel_tab5 @caa4b11)",
                        micro_batch=mb, virtual=v,
                        layout_source=f"{CALCULON} (secondary: the paper's Table 3)")


# (model, tp, pp, GPUs, batch, seconds per iteration, sp + selective, micro-batch, interleave)
KORTHIKANTI_2022 = [
    _korthikanti("megatron-22b", 8, 1, 8, 4, 1.42, False, 4, 1),
    _korthikanti("megatron-22b", 8, 1, 8, 4, 1.10, True, 4, 1),
    _korthikanti("gpt3-175b", 8, 8, 64, 64, 18.13, False, 1, 3),
    _korthikanti("gpt3-175b", 8, 8, 64, 64, 13.75, True, 1, 3),
    _korthikanti("megatron-530b", 8, 35, 280, 280, 49.05, False, 1, 3),
    _korthikanti("megatron-530b", 8, 35, 280, 280, 37.83, True, 1, 3),
    _korthikanti("megatron-1t", 8, 64, 512, 512, 94.42, False, 1, 1),
    _korthikanti("megatron-1t", 8, 64, 512, 512, 71.49, True, 1, 1),
]

ROWS = NARAYANAN_2021 + KORTHIKANTI_2022


def narayanan_flops(run: PublishedRun) -> float:
    """Eq. (3) of Narayanan et al.: FLOPs per iteration, recomputation included."""
    m = named_model(run.model)
    B, s, L, h, V = run.batch, m.seq_length, m.num_layers, m.hidden_size, m.vocab_size
    return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


def metric(run: PublishedRun, seconds: float) -> float:
    """What the paper published, from seconds per iteration: TFLOP/s per GPU (Narayanan)
    or the seconds themselves (Korthikanti)."""
    if run.paper == "narayanan-2021":
        return narayanan_flops(run) / seconds / run.gpus / 1e12
    return seconds


def runtime(run: PublishedRun) -> Runtime:
    """Megatron-LM's runtime of the time, with the run's data-parallel wrapper."""
    return dataclasses.replace(MEGATRON_2021, dp_overlap=run.ddp_overlap)


def job(run: PublishedRun) -> Job:
    return Job(named_model(run.model), run.gpus, run.batch, run.dtype)


def published_layout(run: PublishedRun) -> Layout:
    return Layout(run.tp, run.pp, run.dp, run.micro_batch, run.virtual, 0, run.sp,
                  run.recompute)


def candidate_layouts(run: PublishedRun, max_micro_batch: int = 16,
                      max_virtual: int = 8) -> list[Layout]:
    """The published tp/pp/dp/recompute with every micro-batch and interleaving the planner
    would consider for the job (its defaults: micro-batch up to 16, up to 8 chunks)."""
    m = named_model(run.model)
    out = []
    for b in range(1, max_micro_batch + 1):
        if run.batch % (b * run.dp):
            continue
        mbs = run.batch // (b * run.dp)
        for v in range(1, max_virtual + 1):
            if v > 1 and (run.pp == 1 or m.num_layers % (run.pp * v) or mbs % run.pp):
                continue
            out.append(Layout(run.tp, run.pp, run.dp, b, v, 0, run.sp, run.recompute))
    return out


def predict_published(run: PublishedRun, system: System) -> tuple[float, float]:
    """(predicted metric, seconds per iteration) at the layout the run used."""
    t = step_time(job(run), published_layout(run), system, runtime(run)).total
    return metric(run, t), t


def predict(run: PublishedRun, system: System, fits=None) -> tuple[float, Layout, float]:
    """(predicted metric, recommended layout, seconds per iteration): the planner's
    recommendation, the fastest of ``candidate_layouts`` that ``fits(job, layout)``
    (memory) allows."""
    best = None
    for lay in candidate_layouts(run):
        if fits is not None and not fits(job(run), lay):
            continue
        t = step_time(job(run), lay, system, runtime(run)).total
        if best is None or t < best[0]:
            best = (t, lay)
    if best is None:
        raise ValueError(f"no candidate layout of {run.model} fits")
    t, lay = best
    return metric(run, t), lay, t
