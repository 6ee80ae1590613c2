"""The one argparse parser, with Megatron-LM's flag names, turned into a ``MegazeroConfig``.

Flags are grouped by concern like Megatron's ``arguments.py``. Each flag's destination is a
field of one of the config dataclasses and its default is read from that field (``_Flags``),
so a default is written once, in ``config.py``. ``parse_args`` returns the validated config
tree; the world size comes from torchrun's ``WORLD_SIZE`` (1 when launched as one process).
Megatron's other flags (honoured through megazero's own settings, or refused with an
alternative) are in ``arguments_compat``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from megazero.arguments_compat import UNSUPPORTED_TOKENIZERS, add_compat_args, apply_compat
from megazero.config import (
    ConfigError,
    DataConfig,
    MegazeroConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainConfig,
)
from megazero.config.deepspeed import parse_ds_config


def field_default(cls, name: str):
    """The default of dataclass field ``cls.name`` (what its flag defaults to)."""
    f = cls.__dataclass_fields__[name]
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()


class _Flags:
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


def _add_model_args(parser):
    g = _Flags(parser, "model", ModelConfig)
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
    g.add("--normalization", choices=["LayerNorm", "RMSNorm"])
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
    g.add("--recompute-method", choices=["uniform", "block"],
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


def _add_parallel_args(parser):
    g = _Flags(parser, "parallelism", ParallelConfig)
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


def _add_optimizer_args(parser):
    g = _Flags(parser, "optimizer and learning rate", OptimizerConfig)
    g.add("--optimizer", choices=["adam", "lamb", "sgd", "onebitadam", "zerooneadam"])
    g.add("--var-freeze-step", type=int,
          help="zerooneadam: the last step that updates the variance (DeepSpeed's)")
    g.add("--var-update-scaler", type=int,
          help="zerooneadam: variance updates between doublings of their interval")
    g.add("--local-step-scaler", type=int,
          help="zerooneadam: steps between doublings of the local-step interval")
    g.add("--local-step-clipper", type=int,
          help="zerooneadam: the largest local-step interval")
    g.add("--freeze-step", type=int,
          help="onebitadam: Adam steps with full-precision gradients before the variance is "
               "frozen and momenta travel 1-bit compressed (DeepSpeed's freeze_step)")
    g.add("--lr", type=float)
    g.add("--min-lr", type=float)
    g.add("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root",
                                       "WSD"])
    g.add("--lr-wsd-decay-style", choices=["linear", "cosine", "exponential", "minus_sqrt"],
          help="WSD's final decay (default exponential, as Megatron)")
    g.add("--lr-wsd-decay-iters", type=int, help="WSD: iterations of the final decay")
    g.add("--lr-wsd-decay-samples", type=int, help="WSD: samples of the final decay")
    g.add("--lr-warmup-fraction", type=float)
    g.add("--lr-warmup-iters", type=int)
    g.add("--lr-warmup-samples", type=int)
    g.add("--lr-decay-iters", type=int)
    g.add("--lr-decay-samples", type=int)
    for name in ("weight-decay", "adam-beta1", "adam-beta2", "adam-eps"):
        g.add(f"--{name}", type=float)
    g.add("--adam-w-mode", action="store_true",
          help="decoupled weight decay (AdamW); --no-adam-w-mode: L2")
    g.add("--no-adam-w-mode", field="adam_w_mode", action="store_false")
    g.add("--no-adam-bias-correction", field="adam_bias_correction", action="store_false",
          help="Adam without its bias corrections (DeepSpeed's bias_correction: false)")
    g.add("--sgd-momentum", type=float)
    g.add("--clip-grad", type=float)

    g = _Flags(parser, "mixed precision", OptimizerConfig)
    g.add("--fp16", action="store_true")
    g.add("--bf16", action="store_true")
    g.add("--loss-scale", type=float,
          help="constant loss scale; unset means dynamic scaling with --fp16")
    g.add("--initial-loss-scale", type=float)
    g.add("--min-loss-scale", type=float)
    g.add("--loss-scale-window", type=int)
    g.add("--hysteresis", type=int)

    g = _Flags(parser, "ZeRO", OptimizerConfig)
    g.add("--zero-stage", type=int, choices=[0, 1, 2, 3])
    g.add("--zero-reduce-bucket-size", "--ddp-bucket-size", field="zero_reduce_bucket_size",
          type=int, help="elements per gradient bucket (default: from the model size, "
          "several buckets in flight)")
    g.add("--overlap-grad-reduce", "--zero-overlap-comm", field="overlap_grad_reduce",
          action="store_true", help="reduce-scatter each gradient bucket during the rest of "
          "the backward (the default)")
    g.add("--no-overlap-grad-reduce", field="overlap_grad_reduce", action="store_false",
          help="reduce the gradient buckets after the backward instead")
    g.add("--overlap-param-gather", field="overlap_param_gather", action="store_true",
          help="ZeRO 1-2: all-gather updated parameters during the next forward, each layer "
          "waiting for its own bucket (the default; ZeRO-3 prefetches units in forward and "
          "backward, see --no-zero-prefetch)")
    g.add("--no-overlap-param-gather", field="overlap_param_gather", action="store_false",
          help="all-gather updated parameters inside the optimizer step instead")
    g.add("--zero-param-persistence-threshold", type=int)
    g.add("--no-zero-prefetch", field="zero_prefetch", action="store_false")
    g.add("--zero-max-live-parameters", type=int,
          help="ZeRO-3: prefetch the next unit only while the gathered parameters stay at or "
               "below this many elements (DeepSpeed's stage3_max_live_parameters)")
    g.add("--zero-prefetch-bucket-size", type=int,
          help="ZeRO-3: prefetch the units ahead while their elements sum to at most this "
               "(DeepSpeed's stage3_prefetch_bucket_size; default: the next unit only)")
    g.add("--no-zero3-order-check", field="zero3_order_check", action="store_false",
          help="skip ZeRO-3's check that dp ranks issue collectives in one order (a tiny "
               "all-gather before each; on by default)")
    g.add("--cpu-offload", "--zero-offload-optimizer", field="cpu_offload",
          action="store_true")
    g.add("--offload-optimizer", choices=["cpu", "nvme"],
          help="cpu: --cpu-offload; nvme: fp32 main values and moments in files under "
               "--nvme-path, streamed through the host (ZeRO-Infinity)")
    g.add("--offload-param", choices=["nvme"],
          help="nvme (ZeRO-3): this rank's parameter partition in files under --nvme-path, "
               "read when a unit is gathered (ZeRO-Infinity); needs --offload-optimizer")
    g.add("--nvme-path", help="a directory on a fast disk for --offload-optimizer/--offload-"
                              "param nvme")
    g.add("--nvme-sub-group-size", type=int,
          help="elements per streamed sub-group of --offload-optimizer nvme")
    g.add("--nvme-threads", type=int, help="I/O threads of --offload-optimizer nvme")
    g.add("--nvme-block-size", type=int, help="bytes per I/O piece of the NVMe offload "
          "(1 MiB; DeepSpeed's aio.block_size)")
    g.add("--nvme-buffer-count", type=int, help="host slots --offload-optimizer nvme streams "
          "its sub-groups through (2; DeepSpeed's offload_optimizer.buffer_count)")
    g.add("--cpu-torch-adam", "--cpu_torch_adam", action="store_true",
          help="use torch.optim.AdamW even when megazero's CPU Adam is built")
    g.add("--ds_fused_adam", "--ds-fused-adam", field="use_fused_step", action="store_true",
          help="Megatron-DeepSpeed's flag: the fused Adam step (megazero's kernel; the "
               "default)")
    g.add("--no-fused-optimizer-step", field="use_fused_step", action="store_false",
          help="run the PyTorch reference of the fused optimizer step instead of the kernel")


def _add_data_args(parser):
    g = _Flags(parser, "data and tokenizer", DataConfig)
    g.add("--data-path", nargs="*", help="prefix, or weight prefix weight prefix ... for a blend")
    g.add("--split")
    g.add("--data-cache-path")
    g.add("--tokenizer-type", choices=["GPT2BPETokenizer", "SentencePieceTokenizer",
                                       "NullTokenizer", *UNSUPPORTED_TOKENIZERS],
          help="NullTokenizer: pre-tokenized ids below --vocab-size, end-of-document id "
               "--vocab-size (Megatron's)")
    g.add("--vocab-file")
    g.add("--merge-file")
    g.add("--tokenizer-model")
    g.add("--eod-mask-loss", action="store_true")
    g.add("--reset-position-ids", action="store_true")
    g.add("--reset-attention-mask", action="store_true")
    g.add("--num-workers", type=int)
    g.add("--mock-data", action="store_true",
          help="train on synthetic random tokens (no files); needs --vocab-size")
    g.add("--vocab-size", type=int, help="vocabulary size of --mock-data's null tokenizer")
    g.add("--default-corpus-dir",
          help="cache folder of the built-in corpus (default: ~/.cache/megazero)")


def _add_training_args(parser):
    g = _Flags(parser, "training", TrainConfig)
    g.add("--micro-batch-size", type=int)
    g.add("--global-batch-size", type=int)
    g.add("--train-iters", type=int)
    g.add("--train-samples", type=int)
    g.add("--rampup-batch-size", type=int, nargs=3, metavar=("START", "INCREMENT", "SAMPLES"),
          help="grow the global batch from START by INCREMENT over the first SAMPLES samples "
               "to --global-batch-size (needs --train-samples)")
    g.add("--seed", type=int)
    g.add("--exit-interval", type=int)
    g.add("--exit-duration-in-mins", type=float)
    g.add("--exit-signal-handler", action="store_true",
          help="on --exit-signal, all ranks finish the iteration, save and exit 0")
    g.add("--exit-signal", help="the signal --exit-signal-handler catches (default SIGTERM)")
    g.add("--max-consecutive-skipped-iterations", type=int,
          help="stop with an error after this many skipped (non-finite) iterations in a row "
               "(0: never)")
    g.add("--skip-train", action="store_true")

    g = _Flags(parser, "logging and evaluation", TrainConfig)
    g.add("--log-interval", type=int)
    g.add("--eval-interval", type=int)
    g.add("--eval-iters", type=int)
    g.add("--tensorboard-dir")
    g.add("--log-timers", "--timing-log-level", nargs="?", const=True,
          help="print named timers at each log line")
    g.add("--log-memory", action="store_true",
          help="log each rank's bytes of params, grads, main params and optimizer states "
               "after the first iteration")
    g.add("--pipeline-trace",
          help="record each micro-batch's forward/backward times to this file prefix")
    g.add("--log-throughput", action="store_true",
          help="add Megatron's 'throughput per GPU (TFLOP/s/GPU)' to the log line")
    g.add("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add("--wandb-project", help="log to wandb (offline unless WANDB_MODE says otherwise)")
    g.add("--wandb-exp-name")
    g.add("--wandb-save-dir", help="default <--save or .>/wandb")
    g.add("--profile", action="store_true",
          help="torch.profiler Chrome trace of --profile-step-start..--profile-step-end")
    g.add("--use-pytorch-profiler", field="profile", action="store_true",
          help="the same as --profile (megazero's profiler is torch.profiler)")
    g.add("--profile-step-start", type=int)
    g.add("--profile-step-end", type=int)
    g.add("--profile-ranks", type=int, nargs="+")
    g.add("--profile-dir", help="folder of the traces (default <--tensorboard-dir or .>/profile)")
    g.add("--manual-gc", action="store_true",
          help="Python's garbage collector off; collect every --manual-gc-interval "
               "iterations, at evaluation and at checkpoints")
    g.add("--manual-gc-interval", type=int)
    g.add("--empty-unused-memory-level", type=int, choices=[0, 1, 2],
          help="return the CUDA allocator's free blocks after each iteration (1) and after "
               "evaluation (2)")

    g = _Flags(parser, "checkpointing", TrainConfig)
    g.add("--save")
    g.add("--load")
    g.add("--save-interval", type=int)
    g.add("--no-verify-checkpoint", field="verify_checkpoint", action="store_false",
          help="skip the checksums of loaded checkpoint files (their coordinates are always "
               "checked)")
    for name in ("no-save-optim", "no-save-rng", "no-load-optim", "no-load-rng", "finetune",
                 "use-checkpoint-args", "exit-on-missing-checkpoint"):
        g.add(f"--{name}", action="store_true")


def add_config_arguments(parser):
    """DeepSpeed's ``deepspeed.add_config_arguments(parser)``: ``--deepspeed`` and
    ``--deepspeed_config`` on the user's own parser (``initialize(args=...)`` reads them)."""
    _add_deepspeed_args(parser)
    return parser


def _add_deepspeed_args(parser):
    g = parser.add_argument_group("DeepSpeed (Megatron-DeepSpeed's flags)")
    g.add_argument("--deepspeed", action="store_true",
                   help="take batch sizes, optimizer, ZeRO, precision, clipping, scheduler "
                        "and logging from --deepspeed_config")
    g.add_argument("--deepspeed_config", "--deepspeed-config", default=None,
                   help="a ds_config.json (strict: unknown or unsupported keys fail by name; "
                        "a value that contradicts a flag given on the command line fails)")


def apply_deepspeed_config(config: MegazeroConfig, ns, argv, parser) -> MegazeroConfig:
    """``config`` with the ds_config's settings; a flag given on the command line must agree
    with the ds_config's value for it."""
    if ns.deepspeed and not ns.deepspeed_config:
        raise ConfigError("--deepspeed needs --deepspeed_config ds_config.json")
    if not ns.deepspeed_config:
        return config
    p = config.parallel
    settings = parse_ds_config(ns.deepspeed_config, p.world_size, p.tensor_model_parallel_size,
                               p.pipeline_model_parallel_size)
    given = list(argv)
    explicit = {}
    for action in parser._actions:
        if any(a == opt or a.startswith(opt + "=") for opt in action.option_strings
               for a in given):
            for path in settings.fields:
                if path.split(".")[1] == action.dest:
                    explicit[path] = action.option_strings[0]
    config = settings.apply(config, explicit)
    if settings.scheduler is not None:
        kind, params = settings.scheduler
        d = config.to_dict()
        d["optimizer"].update(ds_scheduler=kind, ds_scheduler_params=params)
        config = MegazeroConfig.from_dict(d)
    return config


def build_parser(extra_args_provider=None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="megazero GPT-2 pretraining",
                                     allow_abbrev=False)
    _add_model_args(parser)
    _add_parallel_args(parser)
    _add_optimizer_args(parser)
    _add_data_args(parser)
    _add_training_args(parser)
    add_compat_args(parser)
    _add_deepspeed_args(parser)
    _add_dry_run_args(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser


def _add_dry_run_args(parser):
    g = parser.add_argument_group(
        "dry run", "execute rank R of an N-rank job in this one CPU process on fake tensors "
                   "and a fake process group, and report its memory and collectives "
                   "(megazero.dryrun)")
    g.add_argument("--dry-run-rank", type=int, default=None, help="the global rank to play")
    g.add_argument("--dry-run-world-size", type=int, default=None,
                   help="the job's world size (needed with --dry-run-rank)")
    g.add_argument("--dry-run-device", choices=["cuda", "cpu"], default="cuda",
                   help="the job's device (cuda works on a CPU-only torch)")
    g.add_argument("--dry-run-iters", type=int, default=1, help="training iterations to run")
    g.add_argument("--dry-run-report", default=None, help="also write the report as JSON here")
    g.add_argument("--no-dry-run-check-peers", dest="dry_run_check_peers",
                   action="store_false", default=True,
                   help="skip dry-running a peer rank of each group to compare collectives")


DRY_RUN_FIELDS = ("rank", "world_size", "device", "iters", "report", "check_peers")


def dry_run_args(argv=None) -> dict | None:
    """The ``--dry-run-*`` values as a dict (``DryRunOptions`` fields), or None when no dry run
    is asked for. ``--dry-run-rank`` and ``--dry-run-world-size`` come together."""
    parser = build_parser()
    ns, _ = parser.parse_known_args(argv)
    if ns.dry_run_rank is None and ns.dry_run_world_size is None:
        return None
    if ns.dry_run_rank is None or ns.dry_run_world_size is None:
        parser.error("--dry-run-rank and --dry-run-world-size go together")
    return {f: getattr(ns, f"dry_run_{f}") for f in DRY_RUN_FIELDS}


def _pick(ns, cls, **values):
    """Dataclass ``cls`` from the namespace fields of the same name (``values`` win)."""
    kwargs = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)
              if hasattr(ns, f.name)}
    return cls(**{**kwargs, **values})


def namespace_to_config(ns: argparse.Namespace, world_size: int | None = None) -> MegazeroConfig:
    apply_compat(ns)
    if world_size is None:
        world_size = getattr(ns, "dry_run_world_size", None) or ns.world_size
        if world_size is None:
            world_size = int(os.environ.get("WORLD_SIZE", "1"))
    v = None
    if ns.num_layers_per_virtual_pipeline_stage is not None:
        per = ns.num_layers_per_virtual_pipeline_stage
        if per < 1:
            raise ConfigError("--num-layers-per-virtual-pipeline-stage must be an integer "
                              f">= 1, got {per}")
        layers_per_stage = ns.num_layers // max(ns.pipeline_model_parallel_size, 1)
        if layers_per_stage % per != 0:
            raise ConfigError(
                f"--num-layers-per-virtual-pipeline-stage ({per}) must divide the layers per "
                f"pipeline stage ({ns.num_layers} / {ns.pipeline_model_parallel_size})")
        v = layers_per_stage // per
    if ns.bf16 or ns.fp16:
        ns.params_dtype = "bfloat16" if ns.bf16 else "float16"
    return MegazeroConfig(
        model=_pick(ns, ModelConfig),
        parallel=_pick(ns, ParallelConfig, virtual_pipeline_model_parallel_size=v,
                       world_size=world_size),
        optimizer=_pick(ns, OptimizerConfig),
        data=_pick(ns, DataConfig),
        train=_pick(ns, TrainConfig),
    )


def parse_args(argv=None, extra_args_provider=None, world_size=None) -> MegazeroConfig:
    """Parse Megatron-style flags into a validated config tree.

    A ``ConfigError`` is turned into an argparse error (exit code 2, message on stderr).
    """
    parser = build_parser(extra_args_provider)
    argv = sys.argv[1:] if argv is None else list(argv)
    ns = parser.parse_args(argv)
    try:
        return apply_deepspeed_config(namespace_to_config(ns, world_size), ns, argv, parser)
    except ConfigError as exc:
        parser.error(str(exc))
