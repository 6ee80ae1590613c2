"""``ModelConfig``: the transformer's shape, its architecture family (GPT-2 by default, the
Llama family by Megatron's flags), attention kernels, recompute, fused-op switches and
``--compile``."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from megazero.config.checks import (
    DTYPES,
    ConfigError,
    Needs,
    _check,
    _finite,
    _flag,
    _in_unit,
    _int_at_least,
)

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def _rope(m) -> bool:
    return m.position_embedding_type == "rope"


def _full_recompute(m) -> bool:
    return m.recompute_activations


_ROPE = "--position-embedding-type rope (got {position_embedding_type})"
_FULL = "whole-layer recompute (--recompute-granularity full or --checkpoint-activations)"
# The model's flags that act in one mode only (``Needs``): given outside it, refused. None is
# checked by value: --compile turns every fusion off, generation turns recompute off.
MODEL_MODES = (
    Needs(("--rotary-base",), "rotary_base", _rope, "sets RoPE's base period", _ROPE),
    Needs(("--rotary-percent",), "rotary_percent", _rope,
          "sets the fraction of each head that RoPE rotates", _ROPE),
    Needs(("--no-rope-fusion",), "apply_rope_fusion", _rope, "unfuses RoPE", _ROPE),
    Needs(("--no-bias-swiglu-fusion",), "bias_swiglu_fusion", lambda m: m.swiglu,
          "unfuses the SwiGLU MLP's activation", "--swiglu"),
    Needs(("--no-bias-gelu-fusion",), "bias_gelu_fusion", lambda m: not m.swiglu,
          "unfuses the GELU MLP's bias and activation", "the GELU MLP (no --swiglu)"),
    Needs(("--recompute-method", "--activations-checkpoint-method"), "recompute_method",
          _full_recompute,
          "chooses the layers whole-layer recompute covers", _FULL),
    Needs(("--checkpoint-num-layers", "--recompute-num-layers"), "recompute_num_layers",
          _full_recompute, "sizes whole-layer recompute's chunks", _FULL),
)


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
    # activation recompute (--recompute-granularity full or --checkpoint-activations =
    # recompute_activations; Megatron-LM's --recompute-activations is granularity selective)
    recompute_activations: bool = False
    recompute_granularity: str | None = None  # full | selective
    recompute_method: str = "uniform"  # uniform | block
    recompute_num_layers: int = 1
    partition_activations: bool = False
    checkpoint_in_cpu: bool = False  # recompute chunks' saved inputs kept in host memory
    # fused kernels (used when built; PyTorch reference otherwise)
    bias_gelu_fusion: bool = True
    bias_dropout_fusion: bool = True
    fused_layernorm: bool = True  # LayerNorm and RMSNorm
    bias_swiglu_fusion: bool = True
    apply_rope_fusion: bool = True
    # --compile: torch.compile on each transformer layer's forward (megazero.model.compile;
    # the layers then take the plain formulas above, which inductor fuses)
    compile: bool = False

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
               "--checkpoint-activations (whole layers) contradicts --recompute-granularity "
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
