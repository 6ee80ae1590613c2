"""Configuration tree: one dataclass per concern, filled by ``arguments.parse_args``.

Every cross-check lives in a ``__post_init__`` and raises ``ConfigError`` with a message that
names the command-line flags involved, so a wrong launch fails before any process group or
tensor is created. A flag that acts in one mode only is a ``Needs`` entry of its section's
table (``MODES``): given outside that mode it is refused by name (``check_given``), never
parsed and ignored. Every numeric field is checked against its valid range (finite where a
float must be: ``--lr inf`` is an error), and the message names the flag, the value and the
range (``--adam-beta1 must be in [0, 1), got 1.5``); a checkpoint's stored config goes through
the same checks when ``from_dict`` rebuilds it. Nothing here knows about torch.distributed; the
world size is an integer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megazero.config.checks import (
    DTYPES,
    SEED_LIMIT,
    ConfigError,
    Needs,
    _check,
    given_outside_mode,
    signal_name,
)
from megazero.config.model import (
    ATTENTION_BACKENDS,
    MODEL_MODES,
    NORMALIZATIONS,
    POSITION_EMBEDDING_TYPES,
    ModelConfig,
)
from megazero.config.optimizer import (
    OPTIMIZER_MODES,
    PARALLEL_MODES,
    OptimizerConfig,
    ParallelConfig,
)
from megazero.config.training import DATA_MODES, TRAIN_MODES, DataConfig, TrainConfig

# section -> its flags that act in one mode only
MODES = {"model": MODEL_MODES, "parallel": PARALLEL_MODES, "optimizer": OPTIMIZER_MODES,
         "data": DATA_MODES, "train": TRAIN_MODES}


@dataclass
class MegazeroConfig:
    """The whole tree, with the checks that span several concerns."""

    # None: a model megazero did not build (the engine's); its shape is its parameters'
    model: ModelConfig | None = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self):
        m, p, o, t = self.model, self.parallel, self.optimizer, self.train
        pp, dp = p.pipeline_model_parallel_size, p.data_parallel_size
        if m is not None:
            self._check_model(m, p, o)
        v = p.virtual_pipeline_model_parallel_size
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


    @staticmethod
    def _check_model(m: ModelConfig, p: ParallelConfig, o: OptimizerConfig) -> None:
        """The GPT model's fit to the layout (the flags of both)."""
        tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
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
            _check(m.recompute_activations, "--partition-activations needs whole-layer "
                   "recompute (--checkpoint-activations or --recompute-granularity full)")
        if m.checkpoint_in_cpu:
            _check(m.recompute_activations, "--checkpoint-in-cpu needs whole-layer recompute "
                   "(--checkpoint-activations or --recompute-granularity full)")

    def check_given(self, given) -> None:
        """Refuse every flag in ``given`` (the spellings on a command line, whatever their
        values) that acts in a mode this config is not in, each named with the mode it
        needs."""
        lines = [line for name, table in MODES.items() if getattr(self, name) is not None
                 for line in given_outside_mode(getattr(self, name), table, given)]
        if lines:
            raise ConfigError("; ".join(lines))

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

        model = None if d.get("model") is None else part("model", ModelConfig)
        return cls(model=model, parallel=part("parallel", ParallelConfig),
                   optimizer=part("optimizer", OptimizerConfig), data=part("data", DataConfig),
                   train=part("train", TrainConfig))


# Fields older checkpoints hold that nothing reads any more (their flags are accepted for
# Megatron compatibility only, see arguments_compat.add_compat_args).
_RETIRED = {"model": {"masked_softmax_fusion"}, "parallel": set(),
            "optimizer": {"zero_allgather_bucket_size", "zero_overlap_comm"}, "data": set(),
            "train": set()}


__all__ = ["ATTENTION_BACKENDS", "DTYPES", "MODES", "NORMALIZATIONS", "POSITION_EMBEDDING_TYPES",
           "SEED_LIMIT", "ConfigError", "DataConfig", "MegazeroConfig", "ModelConfig", "Needs",
           "OptimizerConfig", "ParallelConfig", "TrainConfig", "signal_name"]
