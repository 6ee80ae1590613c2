"""One candidate layout of a training job, and the command line that launches it.

A ``Layout`` fixes every choice the planner makes: tensor, pipeline and data parallel
sizes, virtual pipeline stages, ZeRO stage, micro-batch, sequence parallelism, recompute
granularity and CPU offload. ``Job`` is what is given: the model, the global batch, the
number of ranks. ``command`` writes the ``pretrain_gpt2.py`` flags that run the layout.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from megazero.config import ModelConfig

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Job:
    model: ModelConfig
    world: int  # ranks (GPUs)
    global_batch: int  # sequences per step
    dtype: str = "bf16"  # compute dtype: bf16 | fp16 | fp32

    @property
    def seq(self) -> int:
        return self.model.seq_length

    @property
    def elem_bytes(self) -> int:
        return 4 if self.dtype == "fp32" else 2


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    micro_batch: int
    virtual: int = 1  # model chunks per pipeline rank (1: plain 1F1B)
    zero: int = 0
    sp: bool = False
    recompute: str = "none"  # none | selective | full
    offload: bool = False

    def microbatches(self, global_batch: int) -> int:
        return global_batch // (self.micro_batch * self.dp)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def short(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}" + (f"v{self.virtual}" if self.virtual > 1
                                                   else ""), f"dp{self.dp}", f"z{self.zero}",
                 f"mb{self.micro_batch}"]
        if self.sp:
            parts.append("sp")
        if self.recompute != "none":
            parts.append({"selective": "rc-sel", "full": "rc-full"}[self.recompute])
        if self.offload:
            parts.append("off")
        return " ".join(parts)


def model_flags(m: ModelConfig) -> list[str]:
    flags = ["--num-layers", m.num_layers, "--hidden-size", m.hidden_size,
             "--num-attention-heads", m.num_attention_heads, "--seq-length", m.seq_length,
             "--max-position-embeddings", max(m.max_position_embeddings or 0, m.seq_length)]
    if m.ffn_hidden_size and m.ffn_hidden_size != 4 * m.hidden_size and not m.swiglu:
        flags += ["--ffn-hidden-size", m.ffn_hidden_size]
    if m.swiglu:
        flags += ["--swiglu"]
    if m.num_query_groups:
        flags += ["--group-query-attention", "--num-query-groups", m.num_query_groups]
    if m.position_embedding_type != "learned_absolute":
        flags += ["--position-embedding-type", m.position_embedding_type]
    if m.normalization != "LayerNorm":
        flags += ["--normalization", m.normalization]
    if m.untie_embeddings_and_output_weights:
        flags += ["--untie-embeddings-and-output-weights"]
    if not m.add_bias_linear:
        flags += ["--disable-bias-linear"]
    return [str(f) for f in flags]


def layout_flags(layout: Layout, job: Job) -> list[str]:
    flags = ["--tensor-model-parallel-size", layout.tp,
             "--pipeline-model-parallel-size", layout.pp,
             "--micro-batch-size", layout.micro_batch,
             "--global-batch-size", job.global_batch]
    if layout.virtual > 1:
        flags += ["--num-layers-per-virtual-pipeline-stage",
                  job.model.num_layers // (layout.pp * layout.virtual)]
    if layout.sp:
        flags += ["--sequence-parallel"]
    if layout.recompute == "full":
        flags += ["--recompute-granularity", "full"]
    elif layout.recompute == "selective":
        flags += ["--recompute-granularity", "selective"]
    if layout.zero:
        flags += ["--zero-stage", layout.zero]
    if layout.offload:
        flags += ["--cpu-offload"]
    if job.dtype in ("bf16", "fp16"):
        flags += [f"--{job.dtype}"]
    return [str(f) for f in flags]


def command(layout: Layout, job: Job, *, nodes: int | None = None,
            gpus_per_node: int | None = None, extra: list[str] | None = None) -> str:
    """The launch line: ``torchrun`` with the rank count, then ``pretrain_gpt2.py`` flags."""
    per_node = min(gpus_per_node or job.world, job.world)
    nnodes = nodes or max(1, job.world // per_node)
    launcher = ["torchrun", f"--nproc-per-node={per_node}"]
    if nnodes > 1:
        launcher += [f"--nnodes={nnodes}", "--rdzv-backend=c10d",
                     "--rdzv-endpoint=$MASTER_ADDR:29500"]
    argv = launcher + ["pretrain_gpt2.py"] + model_flags(job.model) + \
        layout_flags(layout, job) + list(extra or [])
    return " ".join(a if a.startswith("$") or "$MASTER" in a else shlex.quote(a)
                    for a in argv)
