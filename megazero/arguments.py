"""The one argparse parser, with Megatron-LM's flag names, turned into a ``MegazeroConfig``.

Flags are grouped by concern like Megatron's ``arguments.py``. ``parse_args`` returns the config
tree; the world size comes from torchrun's ``WORLD_SIZE`` (1 when launched as one process).
"""

from __future__ import annotations

import argparse
import os

from megazero.config import (
    ConfigError,
    DataConfig,
    MegazeroConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainConfig,
)


def _bool_pair(group, name, default, help_on, dest=None):
    """--name / --no-name pair, Megatron style."""
    dest = dest or name.replace("-", "_")
    group.add_argument(f"--{name}", dest=dest, action="store_true", default=default, help=help_on)
    group.add_argument(f"--no-{name}", dest=dest, action="store_false")


def _add_model_args(parser):
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--layernorm-epsilon", type=float, default=1e-5)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--recompute-activations", "--checkpoint-activations",
                   dest="recompute_activations", action="store_true",
                   help="recompute each transformer layer's activations in backward")
    g.add_argument("--checkpoint-num-layers", "--recompute-num-layers",
                   dest="recompute_num_layers", type=int, default=1,
                   help="layers per recompute chunk")
    g.add_argument("--partition-activations", "--distribute-checkpointed-activations",
                   dest="partition_activations", action="store_true",
                   help="split each recompute chunk's saved input across tp ranks")
    g.add_argument("--no-bias-gelu-fusion", dest="bias_gelu_fusion", action="store_false")
    g.add_argument("--no-bias-dropout-fusion", dest="bias_dropout_fusion", action="store_false")
    g.add_argument("--no-persist-layer-norm", "--no-fused-layernorm", dest="fused_layernorm",
                   action="store_false")
    g.add_argument("--no-masked-softmax-fusion", dest="masked_softmax_fusion",
                   action="store_false")


def _add_parallel_args(parser):
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--overlap-p2p-communication", dest="overlap_p2p_comm",
                   action="store_true", default=True,
                   help="interleaved schedule: keep each p2p exchange in flight during the "
                        "other direction's compute (default)")
    g.add_argument("--no-overlap-p2p-communication", dest="overlap_p2p_comm",
                   action="store_false",
                   help="interleaved schedule: wait for every exchange after each step")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--distributed-backend", choices=["gloo", "nccl"], default=None,
                   help="default: nccl when CUDA is available, else gloo")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    g.add_argument("--world-size", type=int, default=None,
                   help="normally taken from torchrun's WORLD_SIZE")


def _add_optimizer_args(parser):
    g = parser.add_argument_group("optimizer and learning rate")
    g.add_argument("--optimizer", choices=["adam", "lamb", "sgd"], default="adam")
    g.add_argument("--lr", type=float, default=1.5e-4)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="cosine")
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-decay-samples", type=int, default=None)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    _bool_pair(g, "adam-w-mode", True, "decoupled weight decay (AdamW); --no-adam-w-mode: L2")
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--clip-grad", type=float, default=1.0)

    g = parser.add_argument_group("mixed precision")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="constant loss scale; unset means dynamic scaling with --fp16")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)

    g = parser.add_argument_group("ZeRO")
    g.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=0)
    g.add_argument("--zero-reduce-bucket-size", type=int, default=25_000_000)
    g.add_argument("--zero-allgather-bucket-size", type=int, default=25_000_000)
    g.add_argument("--zero-overlap-comm", action="store_true")
    g.add_argument("--zero-param-persistence-threshold", type=int, default=0)
    g.add_argument("--no-zero-prefetch", dest="zero_prefetch", action="store_false")
    g.add_argument("--no-zero3-order-check", dest="zero3_order_check", action="store_false",
                   help="skip ZeRO-3's check that dp ranks issue collectives in one order "
                        "(a tiny all-gather before each; on by default)")
    g.add_argument("--cpu-offload", "--zero-offload-optimizer", dest="cpu_offload",
                   action="store_true")
    g.add_argument("--cpu-torch-adam", action="store_true",
                   help="use torch.optim.AdamW even when megazero's CPU Adam is built")
    g.add_argument("--no-fused-optimizer-step", dest="use_fused_step", action="store_false")


def _add_data_args(parser):
    g = parser.add_argument_group("data and tokenizer")
    g.add_argument("--data-path", nargs="*", default=[],
                   help="prefix, or weight prefix weight prefix ... for a blend")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--tokenizer-type", default=None,
                   choices=["GPT2BPETokenizer", "SentencePieceTokenizer"])
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--num-workers", type=int, default=0)
    g.add_argument("--mock-data", action="store_true",
                   help="train on synthetic random tokens (no files); needs --vocab-size")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="vocabulary size of --mock-data's null tokenizer")
    g.add_argument("--default-corpus-dir", default=None,
                   help="cache folder of the built-in corpus (default: ~/.cache/megazero)")


def _add_training_args(parser):
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-duration-in-mins", type=float, default=None)
    g.add_argument("--skip-train", action="store_true")

    g = parser.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=10)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--log-timers", "--timing-log-level", dest="log_timers", nargs="?",
                   const=True, default=False, help="print named timers at each log line")
    g.add_argument("--log-memory", action="store_true",
                   help="log each rank's bytes of params, grads, main params and optimizer "
                        "states after the first iteration")
    g.add_argument("--pipeline-trace", default=None,
                   help="record each micro-batch's forward/backward times to this file prefix")

    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--use-checkpoint-args", action="store_true")


def _add_compat_args(parser):
    """Megatron flags that Megatron scripts pass and megazero does not need: accepted so the
    scripts run unchanged, with what megazero does instead in their help."""
    g = parser.add_argument_group("Megatron compatibility (accepted, no effect)")
    g.add_argument("--data-impl", choices=["mmap", "infer"], default="mmap",
                   help="megazero reads Megatron's mmap format only")
    g.add_argument("--DDP-impl", dest="ddp_impl", choices=["local", "torch"], default="local",
                   help="megazero's data parallelism is its own ZeRO-0..3 optimizer")
    g.add_argument("--use-cpu-initialization", action="store_true",
                   help="initialisation is always layout-invariant (drawn per full tensor)")
    g.add_argument("--use-flash-attn", action="store_true",
                   help="attention always goes through scaled_dot_product_attention")
    g.add_argument("--attention-softmax-in-fp32", action="store_true",
                   help="the loss and attention softmax already accumulate in fp32")
    g.add_argument("--no-async-tensor-model-parallel-allreduce", action="store_true")
    g.add_argument("--no-gradient-accumulation-fusion", action="store_true")
    g.add_argument("--position-embedding-type", choices=["learned_absolute"],
                   default="learned_absolute", help="GPT-2 uses learned absolute positions")
    g.add_argument("--normalization", choices=["LayerNorm"], default="LayerNorm")


def build_parser(extra_args_provider=None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="megazero GPT-2 pretraining",
                                     allow_abbrev=False)
    _add_model_args(parser)
    _add_parallel_args(parser)
    _add_optimizer_args(parser)
    _add_data_args(parser)
    _add_training_args(parser)
    _add_compat_args(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser


def _pick(ns, cls, **renames):
    """Build dataclass ``cls`` from the namespace fields of the same name."""
    import dataclasses

    kwargs = {}
    for f in dataclasses.fields(cls):
        src = renames.get(f.name, f.name)
        if hasattr(ns, src):
            kwargs[f.name] = getattr(ns, src)
    return cls(**kwargs)


def namespace_to_config(ns: argparse.Namespace, world_size: int | None = None) -> MegazeroConfig:
    if world_size is None:
        world_size = ns.world_size or int(os.environ.get("WORLD_SIZE", "1"))
    v = None
    if ns.num_layers_per_virtual_pipeline_stage is not None:
        per = ns.num_layers_per_virtual_pipeline_stage
        layers_per_stage = ns.num_layers // max(ns.pipeline_model_parallel_size, 1)
        if per <= 0 or layers_per_stage % per != 0:
            raise ConfigError(
                f"--num-layers-per-virtual-pipeline-stage ({per}) must divide the layers per "
                f"pipeline stage ({ns.num_layers} / {ns.pipeline_model_parallel_size})")
        v = layers_per_stage // per
    if ns.bf16 or ns.fp16:
        ns.params_dtype = "bfloat16" if ns.bf16 else "float16"
    parallel = ParallelConfig(
        tensor_model_parallel_size=ns.tensor_model_parallel_size,
        pipeline_model_parallel_size=ns.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=v,
        sequence_parallel=ns.sequence_parallel,
        overlap_p2p_comm=ns.overlap_p2p_comm,
        world_size=world_size,
        distributed_backend=ns.distributed_backend,
        distributed_timeout_minutes=ns.distributed_timeout_minutes,
    )
    return MegazeroConfig(
        model=_pick(ns, ModelConfig),
        parallel=parallel,
        optimizer=_pick(ns, OptimizerConfig),
        data=_pick(ns, DataConfig),
        train=_pick(ns, TrainConfig),
    )


def parse_args(argv=None, extra_args_provider=None, world_size=None) -> MegazeroConfig:
    """Parse Megatron-style flags into a validated config tree.

    A ``ConfigError`` is turned into an argparse error (exit code 2, message on stderr).
    """
    parser = build_parser(extra_args_provider)
    ns = parser.parse_args(argv)
    try:
        return namespace_to_config(ns, world_size)
    except ConfigError as exc:
        parser.error(str(exc))
