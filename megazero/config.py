"""Configuration tree: one dataclass per concern, filled by ``arguments.parse_args``.

Every cross-check lives in a ``__post_init__`` and raises ``ConfigError`` with a message that
names the command-line flags involved, so a wrong launch fails before any process group or
tensor is created. Every numeric field is checked against its valid range (finite where a
float must be: ``--lr inf`` is an error), and the message names the flag, the value and the
range (``--adam-beta1 must be in [0, 1), got 1.5``); a checkpoint's stored config goes through
the same checks when ``from_dict`` rebuilds it. Nothing here knows about torch.distributed; the
world size is an integer.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import signal
from dataclasses import dataclass, field

import torch


class ConfigError(ValueError):
    """A flag value or combination of flags that megazero cannot run with."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _int_at_least(value, flag: str, low: int, note: str = "") -> None:
    """``value`` is an integer >= ``low`` (``note`` says what the edge value means)."""
    _check(isinstance(value, numbers.Integral) and not isinstance(value, bool)
           and value >= low,
           f"{flag} must be an integer >= {low}{note}, got {value!r}")


def _optional_int_at_least(value, flag: str, low: int) -> None:
    if value is not None:
        _int_at_least(value, flag, low)


def _finite(value, flag: str, *, positive: bool) -> None:
    """``value`` is a finite number, > 0 (``positive``) or >= 0."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) \
        and math.isfinite(value) and (value > 0 if positive else value >= 0)
    _check(ok, f"{flag} must be a finite number {'>' if positive else '>='} 0, got {value!r}")


def _in_unit(value, flag: str, *, closed: bool = False) -> None:
    """``value`` is in [0, 1) (or [0, 1] when ``closed``); NaN is outside."""
    ok = isinstance(value, numbers.Real) and 0.0 <= value and \
        (value <= 1.0 if closed else value < 1.0)
    _check(ok, f"{flag} must be in [0, 1{']' if closed else ')'}, got {value!r}")


SEED_LIMIT = 2**63  # torch.manual_seed takes < 2^64, and megazero adds offsets to the seed
# Signals that --exit-signal-handler cannot catch.
_UNCATCHABLE = {"SIGKILL", "SIGSTOP"}


def signal_name(name) -> str | None:
    """The canonical name (``SIGTERM``) of a catchable signal given as ``SIGTERM``, ``TERM``
    or ``sigterm``; None when there is no such signal or it cannot be caught."""
    if not isinstance(name, str):
        return None
    canonical = name.strip().upper()
    if not canonical.startswith("SIG"):
        canonical = "SIG" + canonical
    if canonical in _UNCATCHABLE or canonical not in signal.Signals.__members__:
        return None
    return canonical


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")


@dataclass
class ModelConfig:
    """Transformer shape, architecture family and regularisation (Megatron flag names in the
    messages). The defaults are GPT-2; Megatron's flags select the Llama family (RoPE, RMSNorm,
    SwiGLU, grouped-query attention, untied embeddings, no linear biases)."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    # default 4 * hidden_size; with --swiglu Megatron's int(8 * hidden / 3 / 64) * 64
    ffn_hidden_size: int | None = None
    seq_length: int = 128
    max_position_embeddings: int | None = None  # default seq_length
    vocab_size: int | None = None  # true vocabulary size, set from the tokenizer
    make_vocab_size_divisible_by: int = 128
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    # architecture family (Megatron's flags)
    position_embedding_type: str = "learned_absolute"  # learned_absolute | rope | none
    rotary_base: int = 10000
    rotary_percent: float = 1.0  # fraction of each head's dims that RoPE rotates
    normalization: str = "LayerNorm"  # LayerNorm | RMSNorm
    swiglu: bool = False
    group_query_attention: bool = False
    num_query_groups: int | None = None  # key/value heads; None: one per attention head
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True  # --disable-bias-linear: no bias in any linear layer
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    params_dtype: str = "float32"
    # attention kernel: auto | flash | fused | unfused | local (scaled_dot_product_attention's)
    attention_backend: str = "auto"
    attention_softmax_in_fp32: bool = False
    # activation recompute (Megatron's --recompute-granularity full = recompute_activations)
    recompute_activations: bool = False
    recompute_granularity: str | None = None  # full | selective
    recompute_method: str = "uniform"  # uniform | block
    recompute_num_layers: int = 1
    partition_activations: bool = False
    # fused kernels (used when built; PyTorch reference otherwise)
    bias_gelu_fusion: bool = True
    bias_dropout_fusion: bool = True
    fused_layernorm: bool = True  # LayerNorm and RMSNorm
    bias_swiglu_fusion: bool = True
    apply_rope_fusion: bool = True

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = int(4 * self.hidden_size * 2 / 3 / 64) * 64 \
                if self.swiglu else 4 * self.hidden_size
        if self.num_query_groups is not None:
            _int_at_least(self.num_query_groups, "--num-query-groups", 1)
            _check(self.group_query_attention,
                   "--num-query-groups needs --group-query-attention")
        elif self.group_query_attention:
            raise ConfigError("--group-query-attention needs --num-query-groups")
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                     "seq_length", "max_position_embeddings", "make_vocab_size_divisible_by"):
            _int_at_least(getattr(self, name), _flag(name), 1)
        _check(self.hidden_size % self.num_attention_heads == 0,
               f"--hidden-size ({self.hidden_size}) must be divisible by "
               f"--num-attention-heads ({self.num_attention_heads})")
        _check(self.seq_length <= self.max_position_embeddings,
               f"--seq-length ({self.seq_length}) exceeds --max-position-embeddings "
               f"({self.max_position_embeddings})")
        for name in ("attention_dropout", "hidden_dropout"):
            _in_unit(getattr(self, name), _flag(name))
        _finite(self.layernorm_epsilon, "--layernorm-epsilon", positive=True)
        _finite(self.init_method_std, "--init-method-std", positive=True)
        _check(self.params_dtype in DTYPES,
               f"params dtype must be one of {sorted(DTYPES)}, got {self.params_dtype!r}")
        _int_at_least(self.recompute_num_layers, "--checkpoint-num-layers", 1)
        _check(self.recompute_granularity in (None, "full", "selective"),
               f"--recompute-granularity must be full or selective, got "
               f"{self.recompute_granularity!r}")
        _check(self.recompute_method in ("uniform", "block"),
               f"--recompute-method must be uniform or block, got {self.recompute_method!r}")
        if self.recompute_granularity == "full":
            self.recompute_activations = True
        elif self.recompute_activations and self.recompute_granularity is None:
            self.recompute_granularity = "full"
        _check(not (self.recompute_activations and self.recompute_granularity == "selective"),
               "--recompute-activations (whole layers) contradicts --recompute-granularity "
               "selective")
        _check(self.attention_backend in ATTENTION_BACKENDS,
               f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}, got "
               f"{self.attention_backend!r}")
        _check(self.position_embedding_type in POSITION_EMBEDDING_TYPES,
               f"--position-embedding-type must be one of {', '.join(POSITION_EMBEDDING_TYPES)}"
               f", got {self.position_embedding_type!r}")
        _check(self.normalization in NORMALIZATIONS,
               f"--normalization must be one of {', '.join(NORMALIZATIONS)}, got "
               f"{self.normalization!r}")
        _int_at_least(self.rotary_base, "--rotary-base", 1)
        ok = isinstance(self.rotary_percent, numbers.Real) and 0.0 < self.rotary_percent <= 1.0
        _check(ok, f"--rotary-percent must be in (0, 1], got {self.rotary_percent!r}")
        if self.position_embedding_type == "rope":
            rot = int(self.head_dim * self.rotary_percent)
            _check(rot >= 2 and rot % 2 == 0,
                   f"--rotary-percent {self.rotary_percent} of the head dimension "
                   f"{self.head_dim} rotates {rot} dimensions; RoPE needs an even number >= 2")
        if self.num_query_groups is not None:
            _int_at_least(self.num_query_groups, "--num-query-groups", 1)
            _check(self.num_attention_heads % self.num_query_groups == 0,
                   f"--num-attention-heads ({self.num_attention_heads}) must be divisible by "
                   f"--num-query-groups ({self.num_query_groups})")
        if self.vocab_size is not None:
            _int_at_least(self.vocab_size, "--vocab-size", 1)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.params_dtype]

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``--num-query-groups`` with grouped-query attention, else one per
        attention head."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates (0 without RoPE)."""
        if self.position_embedding_type != "rope":
            return 0
        return int(self.head_dim * self.rotary_percent)


@dataclass
class ParallelConfig:
    """Sizes of the rank grid: world = tp * dp * pp (tp fastest, then dp, then pp)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    sequence_parallel: bool = False
    overlap_p2p_comm: bool = True  # interleaved schedule: exchanges in flight during compute
    world_size: int = 1
    distributed_backend: str | None = None  # None: nccl with CUDA, else gloo
    distributed_timeout_minutes: float = 10.0
    ring_collectives: str = "auto"  # gloo reduce-scatter/all-gather: auto | ring | native

    def __post_init__(self):
        tp, pp, world = (self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
                         self.world_size)
        _int_at_least(tp, "--tensor-model-parallel-size", 1)
        _int_at_least(pp, "--pipeline-model-parallel-size", 1)
        _int_at_least(world, "--world-size (or WORLD_SIZE)", 1)
        _check(world % (tp * pp) == 0,
               f"world size ({world}) is not divisible by --tensor-model-parallel-size ({tp}) "
               f"x --pipeline-model-parallel-size ({pp}) = {tp * pp}")
        if self.virtual_pipeline_model_parallel_size is not None:
            v = self.virtual_pipeline_model_parallel_size
            _int_at_least(v, "the number of virtual pipeline stages", 1)
            _check(pp > 1 or v == 1,
                   "--num-layers-per-virtual-pipeline-stage needs "
                   "--pipeline-model-parallel-size > 1")
            if v == 1:
                self.virtual_pipeline_model_parallel_size = None
        _check(self.distributed_backend in (None, "gloo", "nccl"),
               f"--distributed-backend must be gloo or nccl, got {self.distributed_backend!r}")
        _check(self.ring_collectives in ("auto", "ring", "native"),
               f"--ring-collectives must be auto, ring or native, got {self.ring_collectives!r}")
        _finite(self.distributed_timeout_minutes, "--distributed-timeout-minutes",
                positive=True)

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tensor_model_parallel_size
                                   * self.pipeline_model_parallel_size)


@dataclass
class OptimizerConfig:
    """Optimizer, learning-rate schedule, precision, loss scaling and ZeRO."""

    optimizer: str = "adam"  # adam | lamb | sgd
    lr: float = 1.5e-4
    min_lr: float = 0.0
    lr_decay_style: str = "cosine"  # constant | linear | cosine | inverse-square-root | WSD
    lr_wsd_decay_style: str = "exponential"  # linear | cosine | exponential | minus_sqrt
    lr_wsd_decay_iters: int | None = None
    lr_wsd_decay_samples: int | None = None
    lr_warmup_fraction: float | None = None
    lr_warmup_iters: int = 0
    lr_warmup_samples: int = 0
    lr_decay_iters: int | None = None
    lr_decay_samples: int | None = None
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    adam_w_mode: bool = True
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    # precision and loss scaling
    fp16: bool = False
    bf16: bool = False
    loss_scale: float | None = None  # constant scale; None -> dynamic (fp16 only)
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    # ZeRO data parallelism
    zero_stage: int = 0
    # elements per reduce bucket; None: chosen from the model size (layout.default_bucket_size)
    zero_reduce_bucket_size: int | None = None
    overlap_grad_reduce: bool = True  # bucket reduce-scatters run during the backward
    overlap_param_gather: bool = True  # updated parameters gathered during the next forward
    zero_param_persistence_threshold: int = 0  # elements; params at or below stay whole
    zero_prefetch: bool = True
    zero3_order_check: bool = True  # all-gather (kind, bucket, seq) before each collective
    cpu_offload: bool = False
    cpu_torch_adam: bool = False
    use_fused_step: bool = True  # fused unscale+clip+adam+cast kernel when built

    def __post_init__(self):
        _check(self.optimizer in ("adam", "lamb", "sgd"),
               f"--optimizer must be adam, lamb or sgd, got {self.optimizer!r}")
        styles = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
        _check(self.lr_decay_style in styles,
               f"--lr-decay-style must be one of {', '.join(styles)}, got "
               f"{self.lr_decay_style!r}")
        wsd = ("linear", "cosine", "exponential", "minus_sqrt")
        _check(self.lr_wsd_decay_style in wsd,
               f"--lr-wsd-decay-style must be one of {', '.join(wsd)}, got "
               f"{self.lr_wsd_decay_style!r}")
        _optional_int_at_least(self.lr_wsd_decay_iters, "--lr-wsd-decay-iters", 1)
        _optional_int_at_least(self.lr_wsd_decay_samples, "--lr-wsd-decay-samples", 1)
        if self.lr_decay_style == "WSD":
            _check(self.lr_wsd_decay_iters is not None or self.lr_wsd_decay_samples is not None,
                   "--lr-decay-style WSD needs --lr-wsd-decay-iters or --lr-wsd-decay-samples")
        _check(not (self.fp16 and self.bf16), "--fp16 and --bf16 cannot both be set")
        _finite(self.lr, "--lr", positive=False)
        _finite(self.min_lr, "--min-lr", positive=False)
        _check(self.min_lr <= self.lr or self.lr == 0,
               f"--min-lr ({self.min_lr}) must not exceed --lr ({self.lr})")
        _int_at_least(self.lr_warmup_iters, "--lr-warmup-iters", 0)
        _int_at_least(self.lr_warmup_samples, "--lr-warmup-samples", 0)
        _optional_int_at_least(self.lr_decay_iters, "--lr-decay-iters", 1)
        _optional_int_at_least(self.lr_decay_samples, "--lr-decay-samples", 1)
        if self.lr_warmup_fraction is not None:
            _in_unit(self.lr_warmup_fraction, "--lr-warmup-fraction", closed=True)
            _check(self.lr_warmup_iters == 0 and self.lr_warmup_samples == 0,
                   "--lr-warmup-fraction cannot be combined with --lr-warmup-iters/samples")
        _finite(self.weight_decay, "--weight-decay", positive=False)
        _in_unit(self.adam_beta1, "--adam-beta1")
        _in_unit(self.adam_beta2, "--adam-beta2")
        _finite(self.adam_eps, "--adam-eps", positive=True)
        _in_unit(self.sgd_momentum, "--sgd-momentum")
        _check(self.zero_stage in (0, 1, 2, 3),
               f"--zero-stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        _optional_int_at_least(self.zero_reduce_bucket_size, "--zero-reduce-bucket-size", 1)
        _int_at_least(self.zero_param_persistence_threshold,
                      "--zero-param-persistence-threshold", 0)
        _finite(self.clip_grad, "--clip-grad", positive=False)
        _int_at_least(self.hysteresis, "--hysteresis", 1)
        _int_at_least(self.loss_scale_window, "--loss-scale-window", 1)
        if self.loss_scale is not None:
            _finite(self.loss_scale, "--loss-scale", positive=True)
        _finite(self.initial_loss_scale, "--initial-loss-scale", positive=True)
        _finite(self.min_loss_scale, "--min-loss-scale", positive=True)
        if self.fp16 and self.loss_scale is None:  # the dynamic scaler's range
            _check(self.min_loss_scale <= self.initial_loss_scale,
                   f"--min-loss-scale ({self.min_loss_scale}) must not exceed "
                   f"--initial-loss-scale ({self.initial_loss_scale})")
        _check(not (self.cpu_offload and self.zero_stage == 0),
               "--cpu-offload / --zero-offload-optimizer needs --zero-stage >= 1")

    @property
    def params_dtype(self) -> str:
        return "float16" if self.fp16 else "bfloat16" if self.bf16 else "float32"


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


@dataclass
class MegazeroConfig:
    """The whole tree, with the checks that span several concerns."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self):
        m, p, o, t = self.model, self.parallel, self.optimizer, self.train
        tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
        dp = p.data_parallel_size
        m.params_dtype = o.params_dtype
        _check(m.num_attention_heads % tp == 0,
               f"--num-attention-heads ({m.num_attention_heads}) must be divisible by "
               f"--tensor-model-parallel-size ({tp})")
        _check(m.kv_heads % tp == 0,
               f"--num-query-groups ({m.kv_heads}) must be divisible by "
               f"--tensor-model-parallel-size ({tp}): each tp rank holds whole key/value "
               "groups (as Megatron requires)")
        _check(m.ffn_hidden_size % tp == 0,
               f"--ffn-hidden-size ({m.ffn_hidden_size}) must be divisible by "
               f"--tensor-model-parallel-size ({tp})")
        _check(m.num_layers % pp == 0,
               f"--num-layers ({m.num_layers}) must be divisible by "
               f"--pipeline-model-parallel-size ({pp}); megazero gives every stage the "
               "same number of layers")
        v = p.virtual_pipeline_model_parallel_size
        if v is not None:
            _check(m.num_layers % (pp * v) == 0,
                   f"--num-layers ({m.num_layers}) must be divisible by "
                   f"--pipeline-model-parallel-size ({pp}) x virtual stages ({v})")
        if p.sequence_parallel:
            _check(m.seq_length % tp == 0,
                   f"--sequence-parallel needs --seq-length ({m.seq_length}) divisible by "
                   f"--tensor-model-parallel-size ({tp})")
        if m.partition_activations:
            _check(m.recompute_activations,
                   "--partition-activations needs --recompute-activations")
        if t.global_batch_size is None:
            t.global_batch_size = t.micro_batch_size * dp
        _check(t.global_batch_size % (t.micro_batch_size * dp) == 0,
               f"--global-batch-size ({t.global_batch_size}) must be divisible by "
               f"--micro-batch-size ({t.micro_batch_size}) x data-parallel size ({dp})")
        if t.train_iters is not None and o.lr_decay_style != "constant" \
                and o.lr_warmup_fraction is None and o.lr_warmup_samples == 0:
            decay = o.lr_decay_iters if o.lr_decay_iters is not None else t.train_iters
            _check(o.lr_warmup_iters < decay,
                   f"--lr-warmup-iters ({o.lr_warmup_iters}) must be smaller than the lr decay "
                   f"({decay} iterations: --lr-decay-iters, else --train-iters)")
        if t.rampup_batch_size is not None:
            start, inc, _ = t.rampup_batch_size
            unit = t.micro_batch_size * dp * (pp if v is not None else 1)
            _check(start <= t.global_batch_size and (t.global_batch_size - start) % inc == 0,
                   f"--rampup-batch-size: --global-batch-size ({t.global_batch_size}) must be "
                   f"the start ({start}) plus a whole number of increments ({inc})")
            _check(start % unit == 0 and inc % unit == 0,
                   f"--rampup-batch-size: the start ({start}) and increment ({inc}) must be "
                   f"multiples of --micro-batch-size x dp"
                   f"{' x pp (interleaved)' if v is not None else ''} = {unit}")
        if v is not None:
            n_micro = t.global_batch_size // (t.micro_batch_size * dp)
            _check(n_micro % pp == 0,
                   f"the interleaved schedule needs the number of micro-batches ({n_micro} = "
                   f"--global-batch-size / (--micro-batch-size x dp)) to be a multiple of "
                   f"--pipeline-model-parallel-size ({pp})")

    @property
    def num_microbatches(self) -> int:
        return self.microbatches_for(self.train.global_batch_size)

    def microbatches_for(self, global_batch_size: int) -> int:
        """Micro-batches per iteration for a global batch of this size on this layout."""
        dp = self.parallel.data_parallel_size
        return global_batch_size // (self.train.micro_batch_size * dp)

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """The global batch of the iteration after ``consumed_samples`` samples: with
        ``--rampup-batch-size start inc samples``, start + inc for every samples / ((gbs -
        start) / inc) consumed (Megatron's ramp-up), up to --global-batch-size."""
        t = self.train
        if t.rampup_batch_size is None:
            return t.global_batch_size
        start, inc, ramp = t.rampup_batch_size
        steps = (t.global_batch_size - start) // inc
        if steps == 0 or consumed_samples > ramp:
            return t.global_batch_size
        per_step = ramp / steps
        return min(t.global_batch_size, start + int(consumed_samples / per_step) * inc)

    def replace_model(self, **fields) -> MegazeroConfig:
        """A new config with these ``ModelConfig`` fields changed, validated again."""
        d = self.to_dict()
        d["model"].update(fields)
        return MegazeroConfig.from_dict(d)

    def to_dict(self) -> dict:
        """Plain nested dict (for checkpoints loaded with ``weights_only=True``)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> MegazeroConfig:
        """The tree from ``to_dict``'s output (a checkpoint's ``args``); fields that older
        versions saved and this one retired are dropped."""
        def part(key, section):
            return section(**{k: v for k, v in d[key].items() if k not in _RETIRED[key]})

        return cls(model=part("model", ModelConfig), parallel=part("parallel", ParallelConfig),
                   optimizer=part("optimizer", OptimizerConfig), data=part("data", DataConfig),
                   train=part("train", TrainConfig))


# Fields older checkpoints hold that nothing reads any more (their flags are accepted for
# Megatron compatibility only, see arguments._add_compat_args).
_RETIRED = {"model": {"masked_softmax_fusion"}, "parallel": set(),
            "optimizer": {"zero_allgather_bucket_size", "zero_overlap_comm"}, "data": set(),
            "train": set()}
