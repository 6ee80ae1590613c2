"""Flags of the data and tokenizer (``DataConfig``), training, logging, evaluation and
checkpointing (``TrainConfig``). Part of ``megazero.arguments``' parser."""

from __future__ import annotations

from megazero.arguments_compat import UNSUPPORTED_TOKENIZERS
from megazero.arguments_model import FlagGroup
from megazero.config import DataConfig, TrainConfig


def add_data_args(parser):
    g = FlagGroup(parser, "data and tokenizer", DataConfig)
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


def add_training_args(parser):
    g = FlagGroup(parser, "training", TrainConfig)
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

    g = FlagGroup(parser, "logging and evaluation", TrainConfig)
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

    g = FlagGroup(parser, "checkpointing", TrainConfig)
    g.add("--save")
    g.add("--load")
    g.add("--save-interval", type=int)
    g.add("--no-verify-checkpoint", field="verify_checkpoint", action="store_false",
          help="skip the checksums of loaded checkpoint files (their coordinates are always "
               "checked)")
    for name in ("no-save-optim", "no-save-rng", "no-load-optim", "no-load-rng", "finetune",
                 "use-checkpoint-args", "exit-on-missing-checkpoint"):
        g.add(f"--{name}", action="store_true")
