"""Megatron-LM's checkpoint format, piece by piece: safe unpickling, tensor names, the model's
architecture from its ``args``, and the SwiGLU and scheduler conventions. No process group,
no parallelism: pure functions on one file's contents (``megatron`` reads a whole checkpoint,
``megatron_save`` writes one).

Unpickling (``load_megatron_file``) is ``torch.load(weights_only=True)`` allowing
``argparse.Namespace`` and inert stand-ins (``Pickled``) named like the classes Megatron puts
into its files: its enums (in ``args``: model_type, attention_backend, cuda_graph_scope,
exit_signal; next to them: the rerun state machine's) and the numpy arrays of its RNG state.
A stand-in records the arguments it is rebuilt with and runs no code; any other class is a
``CheckpointError`` naming it.

Names, per layer (Megatron-core's ``decoder.layers.N.`` / legacy's
``language_model.encoder.layers.N.`` -> megazero's ``layers.N.``)::

    input_layernorm | input_norm                        -> input_layernorm
    self_attention.linear_qkv | .query_key_value        -> attention.qkv   (column-parallel)
    self_attention.linear_proj | .dense                 -> attention.proj  (row-parallel)
    pre_mlp_layernorm | post_attention_norm             -> post_attention_layernorm
    mlp.linear_fc1 | mlp.dense_h_to_4h                  -> mlp.fc1         (column-parallel)
    mlp.linear_fc2 | mlp.dense_4h_to_h                  -> mlp.fc2         (row-parallel)

and ``embedding.word_embeddings`` (vocab-parallel, padded), ``embedding.position_embeddings``,
``decoder.final_layernorm`` | ``final_norm`` -> ``final_layernorm``, ``output_layer`` (vocab-
parallel; with tied embeddings the last stage's copy is dropped). Row-parallel biases and
norms are replicated. Megatron's fused QKV rows are ``[group, (q..., k, v), head_dim]``
(checkpoint_version >= 2), megazero's order; its SwiGLU fc1 holds ``[gate; up]`` per tp rank
where megazero interleaves ``[ffn, (gate, up)]`` (``interleave_swiglu``, ``split_swiglu``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re

import torch

from megazero.checkpoint.paths import CheckpointError, foreign_file_error, unsafe_globals

logger = logging.getLogger(__name__)

# ---- safe unpickling -------------------------------------------------------------------------
class Pickled:
    """Inert stand-in for a class Megatron pickles: keeps the arguments and state it is
    rebuilt with, runs no code (an enum member's ``value`` is its first argument)."""

    def __init__(self, *args):
        self.args = args

    def __setstate__(self, state):
        self.state = state

    @property
    def value(self):
        return self.args[0] if len(self.args) == 1 else self.args

    def __eq__(self, other):
        return type(self) is type(other) and self.args == other.args

    def __hash__(self):
        return hash((type(self).__qualname__, repr(self.args)))

    def __repr__(self):
        return f"{type(self).__module__}.{type(self).__qualname__}{self.args!r}"


def _stand_in(path: str) -> type:
    module, _, qualname = path.rpartition(".")
    return type(qualname, (Pickled,), {"__module__": module, "__qualname__": qualname})


# Enums Megatron-LM puts into args (model_type, attention_backend, cuda_graph_scope, exit
# signal, ...) or next to them (the rerun state machine), across its versions.
MEGATRON_ENUMS = (
    "megatron.core.enums.ModelType", "megatron.core.enums.Fp8Recipe",
    "megatron.core.enums.Fp4Recipe",
    *(f"megatron.core.transformer.enums.{n}" for n in (
        "ModelType", "AttnBackend", "AttnMaskType", "AttnType", "LayerType", "CudaGraphScope",
        "CudaGraphModule", "InferenceCudaGraphScope")),
    *(f"megatron.core.rerun_state_machine.{n}" for n in (
        "RerunMode", "RerunState", "RerunDiagnostic")),
    *(f"megatron.model.enums.{n}" for n in ("ModelType", "AttnMaskType", "AttnType",
                                            "LayerType", "PositionEmbeddingType")),
    *(f"megatron.legacy.model.enums.{n}" for n in ("AttnMaskType", "AttnType", "LayerType")),
    "signal.Signals")
# numpy's RNG state in ``rng_state`` (megazero does not use it: kept as inert records)
RNG_ARRAYS = ("numpy.ndarray", "numpy.dtype", "numpy.core.multiarray._reconstruct",
              "numpy._core.multiarray._reconstruct", "numpy.dtypes.UInt32DType")
STAND_INS = {name: _stand_in(name) for name in (*MEGATRON_ENUMS, *RNG_ARRAYS)}
ALLOWED_GLOBALS = [argparse.Namespace, *STAND_INS.values()]
ALLOWED_NAMES = {"argparse.Namespace", *STAND_INS}


@contextlib.contextmanager
def exactly_allowed():
    """``ALLOWED_GLOBALS`` and nothing else while unpickling: the process-wide allow-list
    (e.g. the real numpy classes importing megatron.core registers) is set aside meanwhile."""
    ser = torch.serialization
    saved = ser.get_safe_globals()
    ser.clear_safe_globals()
    try:
        with ser.safe_globals(ALLOWED_GLOBALS):
            yield
    finally:
        ser.clear_safe_globals()
        ser.add_safe_globals(saved)


def load_megatron_file(path: str, mmap: bool = True) -> dict:
    """``torch.load(weights_only=True)`` of a Megatron file, allowing ``ALLOWED_GLOBALS``
    only; other classes are a ``CheckpointError`` naming them."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} does not exist")
    named = set(unsafe_globals(path))
    others = sorted(named - ALLOWED_NAMES)
    if others:
        raise CheckpointError(
            f"Megatron checkpoint file {path} pickles classes megazero does not load: "
            f"{', '.join(others)} (megazero unpickles argparse.Namespace, Megatron's enums and "
            "its RNG arrays only)" if "argparse.Namespace" in named
            else foreign_file_error(path))
    try:
        with exactly_allowed():
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # noqa: BLE001 - corrupt or truncated
        raise CheckpointError(f"checkpoint file {path} is corrupt or truncated "
                              f"({type(exc).__name__}: {exc})") from exc
    if not isinstance(state, dict):
        raise CheckpointError(foreign_file_error(path))
    return state


def plain_args(args) -> dict:
    """A file's ``args`` as a dict (a Namespace's attributes; enums as their values)."""
    d = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    return {k: v.value if isinstance(v, Pickled) else v for k, v in d.items()}


# ---- names -----------------------------------------------------------------------------------
# per-layer suffix -> (megazero suffix, tp split dim: 0 column-parallel, 1 row-parallel, None)
_MCORE_LAYER = {
    "input_layernorm.weight": ("input_layernorm.weight", None),
    "input_layernorm.bias": ("input_layernorm.bias", None),
    "self_attention.linear_qkv.layer_norm_weight": ("input_layernorm.weight", None),  # TE
    "self_attention.linear_qkv.layer_norm_bias": ("input_layernorm.bias", None),
    "self_attention.linear_qkv.weight": ("attention.qkv.weight", 0),
    "self_attention.linear_qkv.bias": ("attention.qkv.bias", 0),
    "self_attention.linear_proj.weight": ("attention.proj.weight", 1),
    "self_attention.linear_proj.bias": ("attention.proj.bias", None),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight", None),
    "pre_mlp_layernorm.bias": ("post_attention_layernorm.bias", None),
    "mlp.linear_fc1.layer_norm_weight": ("post_attention_layernorm.weight", None),  # TE
    "mlp.linear_fc1.layer_norm_bias": ("post_attention_layernorm.bias", None),
    "mlp.linear_fc1.weight": ("mlp.fc1.weight", 0),
    "mlp.linear_fc1.bias": ("mlp.fc1.bias", 0),
    "mlp.linear_fc2.weight": ("mlp.fc2.weight", 1),
    "mlp.linear_fc2.bias": ("mlp.fc2.bias", None),
}
_LEGACY_LAYER = {
    **{f"{old}.{w}": (f"{new}.{w}", None) for old, new in (
        ("input_norm", "input_layernorm"), ("input_layernorm", "input_layernorm"),
        ("post_attention_norm", "post_attention_layernorm"),
        ("post_attention_layernorm", "post_attention_layernorm")) for w in ("weight", "bias")},
    "self_attention.query_key_value.weight": ("attention.qkv.weight", 0),
    "self_attention.query_key_value.bias": ("attention.qkv.bias", 0),
    "self_attention.dense.weight": ("attention.proj.weight", 1),
    "self_attention.dense.bias": ("attention.proj.bias", None),
    "mlp.dense_h_to_4h.weight": ("mlp.fc1.weight", 0),
    "mlp.dense_h_to_4h.bias": ("mlp.fc1.bias", 0),
    "mlp.dense_4h_to_h.weight": ("mlp.fc2.weight", 1),
    "mlp.dense_4h_to_h.bias": ("mlp.fc2.bias", None),
}
# top-level name -> (megazero name, split dim); vocabulary-parallel ones are padded
_MCORE_TOP = {
    "embedding.word_embeddings.weight": ("embedding.word_embeddings.weight", 0),
    "embedding.position_embeddings.weight": ("embedding.position_embeddings.weight", None),
    "decoder.final_layernorm.weight": ("final_layernorm.weight", None),
    "decoder.final_layernorm.bias": ("final_layernorm.bias", None),
    "output_layer.weight": ("output_layer.weight", 0),
}
_LEGACY_TOP = {
    "language_model.embedding.word_embeddings.weight": ("embedding.word_embeddings.weight", 0),
    "language_model.embedding.position_embeddings.weight":
        ("embedding.position_embeddings.weight", None),
    **{f"language_model.{stack}.{norm}.{w}": (f"final_layernorm.{w}", None)
       for stack in ("encoder", "transformer") for norm in ("final_norm", "final_layernorm")
       for w in ("weight", "bias")},
    "language_model.output_layer.weight": ("output_layer.weight", 0),
    "word_embeddings_for_head.weight": ("output_layer.weight", 0),  # tied: the head's copy
}
VOCAB_PARALLEL = ("embedding.word_embeddings.weight", "output_layer.weight")
_LAYER_KEY = {
    "mcore": re.compile(r"^decoder\.layers\.(\d+)\.(.+)$"),
    "legacy": re.compile(r"^language_model\.(?:encoder|transformer)\.layers\.(\d+)\.(.+)$")}


def flatten(tree: dict, prefix: str = "") -> dict:
    """Nested state dicts (legacy) as one dict of dotted names, in their order."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def name_format(model_state: dict) -> str:
    """``legacy`` (a ``language_model`` tree) or ``mcore`` (Megatron-core's flat names)."""
    return "legacy" if "language_model" in model_state else "mcore"


def megazero_name(key: str, fmt: str, tied: bool):
    """(megazero name with the stage-local layer index as ``{}``, local layer index or None,
    split dim) of a flattened Megatron key; None for entries without a megazero tensor (TE's
    ``_extra_state``, the last stage's copy of a tied embedding)."""
    if key.endswith("_extra_state"):
        return None
    m = _LAYER_KEY[fmt].match(key)
    table = _MCORE_LAYER if fmt == "mcore" else _LEGACY_LAYER
    if m and m.group(2) in table:
        name, dim = table[m.group(2)]
        return f"layers.{{}}.{name}", int(m.group(1)), dim
    top = (_MCORE_TOP if fmt == "mcore" else _LEGACY_TOP).get(key)
    if top is None:
        raise CheckpointError(f"Megatron tensor {key!r} has no megazero counterpart (a "
                              "feature megazero lacks: MoE, QK-norm, TE fp8 state, ...?)")
    if top[0] == "output_layer.weight" and tied:
        return None  # the first stage's word embedding is the one kept
    return top[0], None, top[1]


# ---- architecture ----------------------------------------------------------------------------
def _get(args: dict, *names, default=None):
    for n in names:
        if args.get(n) is not None:
            return args[n]
    return default


def model_args_from_megatron(args: dict) -> dict:
    """megazero ``ModelConfig`` fields of a Megatron model (its ``args`` as a dict); Megatron
    features megazero lacks are a ``CheckpointError`` naming the flag."""
    unsupported = [(flag, ok) for flag, ok in (
        ("num_experts", not args.get("num_experts")),
        ("qk_layernorm", not args.get("qk_layernorm")),
        ("rotary_interleaved", not args.get("rotary_interleaved")),
        ("use_rope_scaling", not args.get("use_rope_scaling")),
        ("apply_layernorm_1p", not args.get("apply_layernorm_1p")),
        ("apply_residual_connection_post_layernorm",
         not args.get("apply_residual_connection_post_layernorm")),
        ("squared_relu", not args.get("squared_relu")),
        ("multi_latent_attention", not args.get("multi_latent_attention")),
        ("mtp_num_layers", not args.get("mtp_num_layers"))) if not ok]
    h, heads = int(args["hidden_size"]), int(args["num_attention_heads"])
    kv = args.get("kv_channels")
    if kv is not None and int(kv) * heads != h:
        unsupported.append(("kv_channels", False))
    bias = args.get("add_bias_linear", not args.get("disable_bias_linear", False))
    if args.get("add_qkv_bias") and not bias:
        unsupported.append(("add_qkv_bias", False))
    pos = args.get("position_embedding_type") or (
        "rope" if args.get("use_rotary_position_embeddings") else "learned_absolute")
    if pos == "learned_absolute" and args.get("add_position_embedding") is False:
        pos = "none"
    norm = args.get("normalization") or "LayerNorm"
    if pos not in ("learned_absolute", "rope", "none"):
        unsupported.append((f"position_embedding_type {pos}", False))
    if norm not in ("LayerNorm", "RMSNorm"):
        unsupported.append((f"normalization {norm}", False))
    if unsupported:
        raise CheckpointError("the Megatron model uses " + ", ".join(f for f, _ in unsupported)
                              + ", which megazero's GPT does not implement")
    gqa = bool(args.get("group_query_attention"))
    swiglu = bool(args.get("swiglu"))
    ffn = args.get("ffn_hidden_size") or (int(4 * h * 2 / 3 / 64) * 64 if swiglu else 4 * h)
    out = {"num_layers": int(args["num_layers"]), "hidden_size": h,
           "num_attention_heads": heads, "ffn_hidden_size": int(ffn),
           "max_position_embeddings": int(_get(args, "max_position_embeddings",
                                               "seq_length", default=1024)),
           "position_embedding_type": pos, "rotary_base": int(_get(args, "rotary_base",
                                                                   default=10000)),
           "rotary_percent": float(_get(args, "rotary_percent", default=1.0)),
           "normalization": norm, "swiglu": swiglu, "group_query_attention": gqa,
           "num_query_groups": int(args["num_query_groups"]) if gqa else None,
           "untie_embeddings_and_output_weights":
               bool(args.get("untie_embeddings_and_output_weights")),
           "add_bias_linear": bool(bias),
           "layernorm_epsilon": float(_get(args, "norm_epsilon", "layernorm_epsilon",
                                           default=1e-5))}
    if args.get("vocab_size") is not None:
        out["vocab_size"] = int(args["vocab_size"])
    return out


def expected_shapes(m: dict, vocab: int) -> dict[str, tuple]:
    """Full (unpadded) shape of every megazero tensor of model args ``m``."""
    h, ffn = m["hidden_size"], m["ffn_hidden_size"]
    kv = m["num_query_groups"] or m["num_attention_heads"]
    qkv = (m["num_attention_heads"] + 2 * kv) * (h // m["num_attention_heads"])
    fc1 = 2 * ffn if m["swiglu"] else ffn
    ln = ("weight",) if m["normalization"] == "RMSNorm" else ("weight", "bias")
    bias = m["add_bias_linear"]
    out = {"embedding.word_embeddings.weight": (vocab, h)}
    if m["position_embedding_type"] == "learned_absolute":
        out["embedding.position_embeddings.weight"] = (m["max_position_embeddings"], h)
    for i in range(m["num_layers"]):
        p = f"layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out.update({f"{p}{norm}.{w}": (h,) for w in ln})
        for lin, rows, cols in (("attention.qkv", qkv, h), ("attention.proj", h, h),
                                ("mlp.fc1", fc1, h), ("mlp.fc2", h, ffn)):
            out[f"{p}{lin}.weight"] = (rows, cols)
            if bias:
                out[f"{p}{lin}.bias"] = (rows,)
    out.update({f"final_layernorm.{w}": (h,) for w in ln})
    if m["untie_embeddings_and_output_weights"]:
        out["output_layer.weight"] = (vocab, h)
    return out


def interleave_swiglu(shard: torch.Tensor) -> torch.Tensor:
    """One tp rank's fc1 rows ``[gate; up]`` ([2 f, ...]) -> megazero's ``[f, (gate, up)]``."""
    gate, up = shard.chunk(2, dim=0)
    return torch.stack((gate, up), dim=1).reshape(shard.shape)


def split_swiglu(full: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """megazero's interleaved fc1 ([2 f, ...]) -> each tp rank's ``[gate_r; up_r]``."""
    gate, up = full[0::2], full[1::2]  # [f, ...] each
    return [torch.cat((g, u)) for g, u in zip(gate.chunk(tp), up.chunk(tp))]


def scheduler_state(s) -> dict | None:
    """Megatron's ``OptimizerParamScheduler`` state (any of its versions' names) as
    megazero's scheduler state (steps in samples in both); None when it cannot be read."""
    if not isinstance(s, dict):
        return None

    def pick(*names):
        return next(s[n] for n in names if n in s)

    try:
        out = {"max_lr": float(pick("max_lr", "start_lr")), "min_lr": float(s["min_lr"]),
               "warmup_steps": int(pick("lr_warmup_steps", "warmup_steps", "warmup_iter")),
               "decay_steps": int(pick("lr_decay_steps", "decay_steps", "end_iter")),
               "decay_style": str(pick("lr_decay_style", "decay_style")),
               "num_steps": int(pick("num_steps", "num_iters"))}
    except (StopIteration, KeyError, TypeError, ValueError):
        logger.warning("the Megatron lr scheduler state has fields %s, which megazero does not "
                       "map: the schedule starts from the flags", sorted(s))
        return None
    if s.get("wsd_decay_steps") is not None:
        out["wsd_decay_steps"] = int(s["wsd_decay_steps"])
    if s.get("lr_wsd_decay_style") is not None:
        out["wsd_decay_style"] = s["lr_wsd_decay_style"]
    return out


def megatron_scheduler(state: dict, weight_decay: float = 0.0) -> dict:
    """megazero's scheduler state as Megatron's ``OptimizerParamScheduler.state_dict()``."""
    out = {"max_lr": state["max_lr"], "lr_warmup_steps": state["warmup_steps"],
           "num_steps": state["num_steps"], "lr_decay_style": state["decay_style"],
           "lr_decay_steps": state["decay_steps"], "min_lr": state["min_lr"],
           "start_wd": weight_decay, "end_wd": weight_decay, "wd_incr_style": "constant",
           "wd_incr_steps": state["decay_steps"]}
    if state.get("wsd_decay_steps") is not None:
        out.update(wsd_decay_steps=state["wsd_decay_steps"],
                   lr_wsd_decay_style=state.get("wsd_decay_style"))
    return out


__all__ = ["ALLOWED_GLOBALS", "Pickled", "VOCAB_PARALLEL", "expected_shapes", "flatten",
           "interleave_swiglu", "load_megatron_file", "megazero_name", "megatron_scheduler",
           "model_args_from_megatron", "name_format", "plain_args", "scheduler_state",
           "split_swiglu"]
