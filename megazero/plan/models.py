"""The model to plan for: a named model, a MODEL.json, or Megatron's flags.

Whatever the source, the result is megazero's own ``ModelConfig`` (the one the runtime
builds from), so the planner's model-state arithmetic runs on the model the job will build.

Named models: ``gpt3-175b`` and the GPT models of Narayanan et al. 2021 Table 1
(``megatron-1.7b`` ... ``megatron-1t``) and Korthikanti et al. 2022 Table 3
(``megatron-22b``; the 175B, 530B and 1T there are the same shapes as Table 1's), GPT-2's
sizes (``gpt2-124m`` ... ``gpt2-1.5b``). All use vocabulary 51,200 (Megatron's padded GPT-2
vocabulary, as in both papers) unless the flags say otherwise.

MODEL.json holds ``ModelConfig`` field names (``num_layers``, ``hidden_size``,
``num_attention_heads``, ``vocab_size``, ...); Megatron flags are parsed by
``megazero.arguments`` (``--num-layers 96 --hidden-size 12288 ...``).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

from megazero.arguments import build_parser, namespace_to_config
from megazero.config import ConfigError, ModelConfig
from megazero.plan.system import PlanInputError

# name -> (layers, hidden, heads); vocabulary 51,200 and max positions 2048 unless noted
NAMED = {
    "gpt2-124m": (12, 768, 12),
    "gpt2-350m": (24, 1024, 16),
    "gpt2-774m": (36, 1280, 20),
    "gpt2-1.5b": (48, 1600, 25),
    # Narayanan et al. 2021, Table 1 (weak scaling on Selene)
    "megatron-1.7b": (24, 2304, 24),
    "megatron-3.6b": (30, 3072, 32),
    "megatron-7.5b": (36, 4096, 32),
    "megatron-18b": (40, 6144, 48),
    "megatron-39b": (48, 8192, 64),
    "megatron-76b": (60, 10240, 80),
    "megatron-145b": (80, 12288, 96),
    "megatron-310b": (96, 16384, 128),
    "megatron-530b": (105, 20480, 128),
    "megatron-1t": (128, 25600, 160),
    # Korthikanti et al. 2022, Table 3
    "megatron-22b": (48, 6144, 64),
    "gpt3-175b": (96, 12288, 96),
}
DEFAULT_VOCAB = 51200


def named_models() -> list[str]:
    return list(NAMED)


def _config(fields: dict, seq_length: int | None, where: str) -> ModelConfig:
    fields = dict(fields)
    if seq_length is not None:
        fields["seq_length"] = seq_length
        if (fields.get("max_position_embeddings") or 0) < seq_length:
            fields["max_position_embeddings"] = seq_length
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise PlanInputError(f"{where}: unknown model field(s) {', '.join(unknown)}")
    try:
        return ModelConfig(**fields)
    except (ConfigError, TypeError, ValueError) as exc:
        raise PlanInputError(f"{where}: {exc}") from None


def named_model(name: str, seq_length: int | None = None) -> ModelConfig:
    if name not in NAMED:
        raise PlanInputError(f"--model: unknown model {name!r}; named models: "
                             f"{', '.join(NAMED)}; or a MODEL.json, or Megatron flags")
    layers, hidden, heads = NAMED[name]
    return _config({"num_layers": layers, "hidden_size": hidden,
                    "num_attention_heads": heads, "vocab_size": DEFAULT_VOCAB,
                    "seq_length": 2048, "max_position_embeddings": 2048,
                    "params_dtype": "bfloat16"}, seq_length, f"--model {name}")


def model_from_flags(flags: list[str], seq_length: int | None = None) -> ModelConfig:
    """The model part of Megatron's flags, parsed by megazero's own parser."""
    parser = build_parser()
    try:
        ns, rest = parser.parse_known_args(flags)
    except SystemExit:
        raise PlanInputError(f"--model: megazero's parser refused {' '.join(flags)!r}") from None
    if rest:
        raise PlanInputError(f"--model: unknown flag(s) {' '.join(rest)}")
    # the model alone: the layout is the planner's to choose
    ns.tensor_model_parallel_size = ns.pipeline_model_parallel_size = 1
    ns.num_layers_per_virtual_pipeline_stage = None
    ns.sequence_parallel = False
    try:
        cfg = namespace_to_config(ns, world_size=1)
    except ConfigError as exc:
        raise PlanInputError(f"--model: {exc}") from None
    fields = dataclasses.asdict(cfg.model)
    fields["vocab_size"] = fields.get("vocab_size") or ns.vocab_size or DEFAULT_VOCAB
    if cfg.optimizer.params_dtype == "float32" and not (ns.fp16 or ns.bf16):
        fields["params_dtype"] = "float32"
    return _config(fields, seq_length, "--model flags")


def model_from_json(path: str, seq_length: int | None = None) -> ModelConfig:
    try:
        fields = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise PlanInputError(f"--model: no such file {path!r}") from None
    except json.JSONDecodeError as exc:
        raise PlanInputError(f"--model: {path} is not valid JSON ({exc})") from None
    fields.setdefault("vocab_size", DEFAULT_VOCAB)
    fields.setdefault("params_dtype", "bfloat16")
    return _config(fields, seq_length, f"--model {path}")


def resolve_model(spec: str | list[str], seq_length: int | None = None) -> ModelConfig:
    """``spec``: a model name, a path to MODEL.json, or Megatron flags (a list, or one string
    starting with ``--``)."""
    if isinstance(spec, str) and spec.lstrip().startswith("--"):
        spec = shlex.split(spec)
    if isinstance(spec, list):
        if len(spec) == 1 and not spec[0].lstrip().startswith("--"):
            spec = spec[0]
        else:  # flags as separate words, or in one quoted string
            words = shlex.split(spec[0]) if len(spec) == 1 else spec
            return model_from_flags(words, seq_length)
    if spec.endswith(".json"):
        return model_from_json(spec, seq_length)
    return named_model(spec, seq_length)


def parameter_count(m: ModelConfig) -> int:
    """Parameters of the full model (unpadded vocabulary; tied embedding counted once)."""
    h, L, V = m.hidden_size, m.num_layers, m.vocab_size
    ffn = m.ffn_hidden_size or 4 * h
    qkv = h * (m.num_attention_heads + 2 * m.kv_heads) * m.head_dim
    mlp = h * ffn * (3 if m.swiglu else 2)
    bias = (qkv // h + h + ffn * (2 if m.swiglu else 1) + h) if m.add_bias_linear else 0
    norms = 2 * h * (2 if m.normalization == "LayerNorm" else 1)
    layer = qkv + h * h + mlp + bias + norms
    pos = m.max_position_embeddings * h if m.position_embedding_type == "learned_absolute" \
        else 0
    out = V * h if m.untie_embeddings_and_output_weights else 0
    return L * layer + V * h + pos + out + norms // 2
