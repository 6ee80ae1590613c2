"""Flags of the model and the parallel layout (``ModelConfig``, ``ParallelConfig``), and
``FlagGroup``, the argument group whose flags store into a config dataclass's fields (their
defaults read from those fields). Part of ``megazero.arguments``' parser."""

from __future__ import annotations

from megazero.config import ModelConfig, ParallelConfig
from megazero.config.checks import field_default


class FlagGroup:
    """An argument group whose flags store into fields of config dataclass ``cls``; the
    destination is the flag's name (``--hidden-size`` -> ``hidden_size``) unless ``field``
    says, and the default is that field's default unless given."""

    def __init__(self, parser, title: str, cls):
        self.group, self.cls = parser.add_argument_group(title), cls

    def add(self, *flags, field: str | None = None, **kwargs):
        dest = field or flags[0].lstrip("-").replace("-", "_")
        if "default" not in kwargs:
            kwargs["default"] = field_default(self.cls, dest)
        self.group.add_argument(*flags, dest=dest, **kwargs)


def _normalization(value: str) -> str:
    """Megatron's spelling of a norm from any case (Megatron-DeepSpeed: ``rmsnorm``)."""
    return {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}.get(value.lower(), value)


def add_model_args(parser):
    g = FlagGroup(parser, "model", ModelConfig)
    for name in ("num-layers", "hidden-size", "ffn-hidden-size", "num-attention-heads",
                 "seq-length", "max-position-embeddings", "make-vocab-size-divisible-by"):
        g.add(f"--{name}", type=int)
    for name in ("layernorm-epsilon", "init-method-std", "attention-dropout", "hidden-dropout"):
        g.add(f"--{name}", type=float)
    g.add("--position-embedding-type", choices=["learned_absolute", "rope", "none"],
          help="learned absolute positions (GPT-2, default), rotary (RoPE) or none")
    g.add("--rotary-base", type=int, help="RoPE's base period (default 10000)")
    g.add("--rotary-percent", type=float,
          help="fraction of each head's dimensions that RoPE rotates (default 1.0)")
    g.add("--normalization", choices=["LayerNorm", "RMSNorm"], type=_normalization,
          help="LayerNorm or RMSNorm (any case: Megatron-DeepSpeed writes rmsnorm)")
    g.add("--use-rotary-position-embeddings", field="position_embedding_type",
          action="store_const", const="rope",
          help="Megatron-DeepSpeed's: --position-embedding-type rope")
    g.add("--swiglu", action="store_true",
          help="SwiGLU MLP: silu(gate) * up (default --ffn-hidden-size int(8h/3/64)*64)")
    g.add("--group-query-attention", action="store_true",
          help="grouped-query attention with --num-query-groups key/value heads")
    g.add("--num-query-groups", type=int)
    g.add("--untie-embeddings-and-output-weights", action="store_true",
          help="an output layer of its own instead of the word embedding's transpose")
    g.add("--disable-bias-linear", field="add_bias_linear", action="store_false",
          help="no bias in any linear layer (qkv, attention output, MLP)")
    g.add("--attention-backend", choices=["auto", "flash", "fused", "unfused", "local"],
          help="scaled_dot_product_attention's kernel: auto (torch chooses), flash, fused "
               "(memory-efficient), unfused/local (explicit matmul + softmax)")
    g.add("--attention-softmax-in-fp32", action="store_true",
          help="with --bf16/--fp16, the unfused attention computes its softmax in fp32 (the "
               "flash and fused kernels always accumulate it in fp32)")
    g.add("--checkpoint-activations", field="recompute_activations", action="store_true",
          help="recompute each transformer layer's activations in backward (Megatron-"
               "DeepSpeed's flag: --recompute-granularity full --recompute-method uniform; "
               "Megatron-LM's --recompute-activations is the selective recompute)")
    g.add("--recompute-granularity", choices=["full", "selective"],
          help="full: whole layers (--recompute-method, --recompute-num-layers); selective: "
               "only the attention core (scores, softmax, dropout, context)")
    g.add("--recompute-method", "--activations-checkpoint-method", choices=["uniform", "block"],
          help="uniform: chunks of --recompute-num-layers layers, each recomputed as one; "
               "block: the first --recompute-num-layers layers of each stage, each alone")
    g.add("--checkpoint-num-layers", "--recompute-num-layers", field="recompute_num_layers",
          type=int, help="layers per recompute chunk")
    g.add("--partition-activations", "--distribute-checkpointed-activations",
          action="store_true", help="split each recompute chunk's saved input across tp ranks")
    g.add("--checkpoint-in-cpu", action="store_true",
          help="keep each recompute chunk's saved input in host memory until its backward "
               "(Megatron-DeepSpeed's flag; DeepSpeed's cpu_checkpointing)")
    g.add("--no-bias-gelu-fusion", field="bias_gelu_fusion", action="store_false")
    g.add("--no-bias-dropout-fusion", field="bias_dropout_fusion", action="store_false")
    g.add("--no-bias-swiglu-fusion", field="bias_swiglu_fusion", action="store_false")
    g.add("--no-rope-fusion", field="apply_rope_fusion", action="store_false")
    g.add("--no-persist-layer-norm", "--no-fused-layernorm", field="fused_layernorm",
          action="store_false")
    g.add("--compile", action="store_true",
          help="torch.compile each transformer layer (torchtitan's flag; the first "
               "iteration compiles)")


def add_parallel_args(parser):
    g = FlagGroup(parser, "parallelism", ParallelConfig)
    g.add("--tensor-model-parallel-size", type=int)
    g.add("--pipeline-model-parallel-size", type=int)
    g.group.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                         help="interleaved schedule: layers per virtual stage")
    g.add("--overlap-p2p-communication", field="overlap_p2p_comm", action="store_true",
          help="interleaved schedule: keep each p2p exchange in flight during the other "
               "direction's compute (default)")
    g.add("--no-overlap-p2p-communication", field="overlap_p2p_comm", action="store_false",
          help="interleaved schedule: wait for every exchange after each step")
    g.add("--sequence-parallel", action="store_true")
    g.add("--distributed-backend", choices=["gloo", "nccl"],
          help="default: nccl when CUDA is available, else gloo")
    g.add("--distributed-timeout-minutes", type=float)
    g.add("--ring-collectives", choices=["auto", "ring", "native"],
          help="gloo reduce-scatter/all-gather of 4 MiB and more: megazero's ring, gloo's "
               "own, or auto (measured once per group; default)")
    g.group.add_argument("--world-size", type=int, default=None,
                         help="normally taken from torchrun's WORLD_SIZE")
