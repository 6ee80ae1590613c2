"""``DataConfig`` (data and tokenizer) and ``TrainConfig`` (batch sizes, length of training,
logging, monitoring, evaluation and checkpoints)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from megazero.config.checks import (
    SEED_LIMIT,
    ConfigError,
    Needs,
    _check,
    _finite,
    _int_at_least,
    _optional_int_at_least,
    signal_name,
)

# The flags that act in one mode only (``Needs``): given outside it, refused by name. None is
# checked by value: the dry run rebuilds a config on mock data without --load,
# --tensorboard-dir or evaluation.
DATA_MODES = (
    *(Needs((flag,), flag[2:].replace("-", "_"),
            lambda d: d.tokenizer_type == "GPT2BPETokenizer", "is a GPT-2 BPE tokenizer file",
            "--tokenizer-type GPT2BPETokenizer (got {tokenizer_type})")
      for flag in ("--vocab-file", "--merge-file")),
    Needs(("--tokenizer-model",), "tokenizer_model",
          lambda d: d.tokenizer_type == "SentencePieceTokenizer",
          "is a SentencePiece tokenizer's model", "--tokenizer-type SentencePieceTokenizer "
          "(got {tokenizer_type})"),
    Needs(("--vocab-size",), "vocab_size",
          lambda d: d.mock_data or d.tokenizer_type == "NullTokenizer",
          "sets the null tokenizer's vocabulary (other tokenizers bring their own)",
          "--mock-data or --tokenizer-type NullTokenizer"),
    *(Needs((flag,), flag[2:].replace("-", "_"), lambda d: not d.mock_data, acts,
            "data files (--data-path or the default corpus), not --mock-data")
      for flag, acts in (("--split", "splits the documents into train, valid and test"),
                         ("--data-cache-path", "caches the dataset indices"))),
    Needs(("--default-corpus-dir",), "default_corpus_dir",
          lambda d: not (d.mock_data or d.data_path or d.tokenizer_type),
          "caches the built-in corpus", "no --data-path, --tokenizer-type or --mock-data "
          "(the built-in corpus is their default)"),
)


def _saves(t) -> bool:
    return t.save is not None


def _loads(t) -> bool:
    return t.load is not None


TRAIN_MODES = (
    Needs(("--exit-signal",), "exit_signal", lambda t: t.exit_signal_handler,
          "names the signal to save and exit on", "--exit-signal-handler"),
    *(Needs((flag,), flag[2:].replace("-", "_"), _saves, acts, "--save")
      for flag, acts in (("--save-interval", "sets how often checkpoints are saved"),
                         ("--no-save-optim", "leaves the optimizer out of saved checkpoints"),
                         ("--no-save-rng", "leaves the RNG states out of saved checkpoints"))),
    *(Needs(flags, field, _loads, acts, "--load")
      for flags, field, acts in (
          (("--no-load-optim",), "no_load_optim", "skips the loaded optimizer states"),
          (("--no-load-rng",), "no_load_rng", "skips the loaded RNG states"),
          (("--finetune",), "finetune", "loads weights only, from iteration 0"),
          (("--use-checkpoint-args",), "use_checkpoint_args",
           "takes the model's flags from the loaded checkpoint"),
          (("--no-verify-checkpoint",), "verify_checkpoint",
           "skips the loaded files' checksums"))),
    Needs(("--log-validation-ppl-to-tensorboard",), "log_validation_ppl_to_tensorboard",
          lambda t: t.tensorboard_dir is not None, "adds the validation perplexity to "
          "TensorBoard", "--tensorboard-dir"),
    *(Needs((flag,), flag[2:].replace("-", "_"), lambda t: t.wandb_project is not None, acts,
            "--wandb-project")
      for flag, acts in (("--wandb-exp-name", "names the wandb run"),
                         ("--wandb-save-dir", "places the wandb files"))),
    *(Needs((flag,), flag[2:].replace("-", "_"), lambda t: t.profile, "places the profiler's "
            "trace", "--profile or --use-pytorch-profiler")
      for flag in ("--profile-step-start", "--profile-step-end", "--profile-ranks",
                   "--profile-dir")),
    Needs(("--manual-gc-interval",), "manual_gc_interval", lambda t: t.manual_gc,
          "sets how often the garbage collector runs", "--manual-gc"),
)


@dataclass
class DataConfig:
    """Where samples come from: Megatron ``--data-path`` blends or the default corpus."""

    data_path: list[str] = field(default_factory=list)
    split: str = "969,30,1"
    data_cache_path: str | None = None
    tokenizer_type: str | None = None  # GPT2BPETokenizer | SentencePieceTokenizer
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    num_workers: int = 0
    default_corpus_dir: str | None = None  # cache folder of the built-in corpus
    mock_data: bool = False  # synthetic tokens, no files (tests, benchmarks)
    vocab_size: int | None = None  # vocabulary of the mock data's null tokenizer

    def __post_init__(self):
        if self.tokenizer_type == "GPT2BPETokenizer":
            _check(self.vocab_file is not None and self.merge_file is not None,
                   "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
        if self.tokenizer_type == "SentencePieceTokenizer":
            _check(self.tokenizer_model is not None,
                   "--tokenizer-type SentencePieceTokenizer needs --tokenizer-model")
        if self.tokenizer_type == "NullTokenizer":
            _check(self.vocab_size is not None,
                   "--tokenizer-type NullTokenizer needs --vocab-size")
        parts = self.split.replace("/", ",").split(",")
        try:
            weights = [float(p) for p in parts if p.strip()]
        except ValueError:
            raise ConfigError(
                f"--split must be comma-separated numbers, got {self.split!r}") from None
        _check(0 < len(weights) <= 3 and all(0 <= w < math.inf for w in weights)
               and sum(weights) > 0,
               f"--split must hold up to 3 finite non-negative weights (not all 0), got "
               f"{self.split!r}")
        _int_at_least(self.num_workers, "--num-workers", 0)
        _optional_int_at_least(self.vocab_size, "--vocab-size", 1)
        if self.mock_data:
            _check(not self.data_path, "--mock-data and --data-path are exclusive")
            _check(self.tokenizer_type in (None, "NullTokenizer"),
                   f"--mock-data brings its own null tokenizer; --tokenizer-type "
                   f"{self.tokenizer_type} contradicts it")
            _check(self.vocab_size is not None and self.vocab_size > 1,
                   f"--mock-data needs --vocab-size >= 2, got {self.vocab_size!r}")
        if self.data_path:
            _check(self.tokenizer_type is not None,
                   "--data-path needs --tokenizer-type (with its vocab/merge or model files)")


@dataclass
class TrainConfig:
    """Batch sizes, length of training, logging, evaluation and checkpoints."""

    micro_batch_size: int = 1
    global_batch_size: int | None = None  # default micro * dp
    train_iters: int | None = None
    train_samples: int | None = None
    seed: int = 1234
    log_interval: int = 100
    eval_interval: int = 1000
    eval_iters: int = 10
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    no_save_optim: bool = False
    no_save_rng: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    use_checkpoint_args: bool = False
    exit_interval: int | None = None
    exit_duration_in_mins: float | None = None
    exit_signal_handler: bool = False  # save and exit 0 at the end of the iteration on a signal
    exit_signal: str = "SIGTERM"
    max_consecutive_skipped_iterations: int = 50  # 0: never stop on skipped iterations
    verify_checkpoint: bool = True  # checksums of loaded files (coordinates always checked)
    tensorboard_dir: str | None = None
    log_timers: bool = False
    log_memory: bool = False
    pipeline_trace: str | None = None
    skip_train: bool = False
    exit_on_missing_checkpoint: bool = False
    # [start, increment, samples]: the global batch grows from start by increment over the
    # first `samples` samples to --global-batch-size (Megatron's --rampup-batch-size)
    rampup_batch_size: list | None = None
    # monitoring (megazero.training.monitor)
    log_throughput: bool = False
    log_validation_ppl_to_tensorboard: bool = False
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None
    profile: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: list = field(default_factory=lambda: [0])
    profile_dir: str | None = None  # default <tensorboard-dir or .>/profile
    manual_gc: bool = False
    manual_gc_interval: int = 0  # 0: only at evaluation and checkpoints
    empty_unused_memory_level: int = 0

    def __post_init__(self):
        _int_at_least(self.micro_batch_size, "--micro-batch-size", 1)
        _optional_int_at_least(self.global_batch_size, "--global-batch-size", 1)
        _optional_int_at_least(self.train_iters, "--train-iters", 0)
        _optional_int_at_least(self.train_samples, "--train-samples", 0)
        _check(not (self.train_iters is not None and self.train_samples is not None),
               "use either --train-iters or --train-samples, not both")
        _check(isinstance(self.seed, numbers.Integral) and 0 <= self.seed < SEED_LIMIT,
               f"--seed must be an integer in [0, 2^63), got {self.seed!r}")
        _int_at_least(self.log_interval, "--log-interval", 1)
        _int_at_least(self.eval_interval, "--eval-interval", 1)
        _int_at_least(self.eval_iters, "--eval-iters", 0)
        _optional_int_at_least(self.save_interval, "--save-interval", 1)
        _optional_int_at_least(self.exit_interval, "--exit-interval", 1)
        _int_at_least(self.profile_step_start, "--profile-step-start", 1)
        _check(isinstance(self.profile_step_end, numbers.Integral)
               and self.profile_step_end >= self.profile_step_start,
               f"--profile-step-end ({self.profile_step_end}) must be >= --profile-step-start "
               f"({self.profile_step_start})")
        _int_at_least(self.manual_gc_interval, "--manual-gc-interval", 0)
        if self.rampup_batch_size is not None:
            r = self.rampup_batch_size
            _check(isinstance(r, list) and len(r) == 3,
                   f"--rampup-batch-size takes 3 integers <start> <increment> <samples>, got "
                   f"{r!r}")
            for name, v, low in zip(("start", "increment", "samples"), r, (1, 1, 0)):
                _int_at_least(v, f"--rampup-batch-size {name}", low)
            _check(self.train_samples is not None,
                   "--rampup-batch-size needs --train-samples: use --train-samples instead of "
                   "--train-iters (as in Megatron, iteration-based training has no ramp-up)")
        _check(isinstance(self.profile_ranks, list) and all(
            isinstance(r, numbers.Integral) and r >= 0 for r in self.profile_ranks),
            f"--profile-ranks must be integers >= 0, got {self.profile_ranks!r}")
        _check(self.empty_unused_memory_level in (0, 1, 2),
               f"--empty-unused-memory-level must be 0, 1 or 2, got "
               f"{self.empty_unused_memory_level!r}")
        _check(not (self.exit_on_missing_checkpoint and not self.load),
               "--exit-on-missing-checkpoint needs --load")
        if self.exit_duration_in_mins is not None:
            _finite(self.exit_duration_in_mins, "--exit-duration-in-mins", positive=True)
        name = signal_name(self.exit_signal)
        _check(name is not None,
               "--exit-signal must be the name of a signal that can be caught, such as "
               f"SIGTERM, SIGINT or SIGUSR1, got {self.exit_signal!r}")
        self.exit_signal = name
        _int_at_least(self.max_consecutive_skipped_iterations,
                      "--max-consecutive-skipped-iterations", 0, " (0: never stop)")
