"""Write a Megatron-LM checkpoint (its ``torch`` format) from full megazero tensors, at any
(tp, pp), in Megatron-core's names (default) or legacy ones. One process, no process group.

Each (tp, pp) cell gets ``iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt`` holding what
Megatron-LM's ``load_checkpoint`` reads: ``args`` (an ``argparse.Namespace`` with the model's
architecture, parallel sizes, padded vocabulary, iteration and consumed samples),
``checkpoint_version`` 3.0, ``iteration``, ``model`` (that cell's shards: column-parallel
tensors cut along dim 0, row-parallel along dim 1, the vocabulary padded to a multiple of
``make_vocab_size_divisible_by`` x tp with zero rows, SwiGLU's fc1 as ``[gate; up]`` per
rank; stage p holds layers ``[p L/pp, (p+1) L/pp)`` numbered from 0; with tied embeddings the
last stage holds the head's copy) and, when given, ``opt_param_scheduler``. No optimizer
state and no RNG state are written: Megatron loads the result with ``--finetune`` (or
``--no-load-optim --no-load-rng`` to keep the iteration). Files are written atomically, the
tracker last.
"""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Callable

import torch

from megazero.checkpoint.megatron_format import expected_shapes, split_swiglu
from megazero.checkpoint.paths import (
    CHECKPOINT_VERSION,
    MODEL_FILE,
    CheckpointError,
    atomic_save,
    atomic_write_text,
    cell_dir,
    iteration_dir,
    tracker_path,
)
from megazero.tensor_parallel.layers import padded_vocab_size

FORMATS = ("mcore", "legacy")
# megazero layer suffix -> (Megatron-core suffix, legacy suffix, tp split dim)
_LAYER = (
    ("input_layernorm", "input_layernorm", "input_norm", None),
    ("attention.proj", "self_attention.linear_proj", "self_attention.dense", 1),
    ("attention.qkv", "self_attention.linear_qkv", "self_attention.query_key_value", 0),
    ("post_attention_layernorm", "pre_mlp_layernorm", "post_attention_norm", None),
    ("mlp.fc1", "mlp.linear_fc1", "mlp.dense_h_to_4h", 0),
    ("mlp.fc2", "mlp.linear_fc2", "mlp.dense_4h_to_h", 1),
)
_LINEARS = ("attention.proj", "attention.qkv", "mlp.fc1", "mlp.fc2")


def megatron_args(model: dict, *, tp: int, pp: int, vocab_size: int, padded: int,
                  divisible_by: int, iteration: int, consumed_train_samples: int,
                  params_dtype: torch.dtype, fmt: str, extra: dict | None = None):
    """The ``args`` Namespace of the written files: what Megatron-LM's ``load_checkpoint``
    and ``--use-checkpoint-args`` read."""
    rope = model["position_embedding_type"] == "rope"
    d = {"num_layers": model["num_layers"], "hidden_size": model["hidden_size"],
         "ffn_hidden_size": model["ffn_hidden_size"],
         "num_attention_heads": model["num_attention_heads"],
         "kv_channels": model["hidden_size"] // model["num_attention_heads"],
         "group_query_attention": model["group_query_attention"],
         "num_query_groups": model["num_query_groups"] or model["num_attention_heads"],
         "max_position_embeddings": model["max_position_embeddings"],
         "seq_length": model.get("seq_length") or model["max_position_embeddings"],
         "position_embedding_type": model["position_embedding_type"],
         "add_position_embedding": model["position_embedding_type"] == "learned_absolute",
         "use_rotary_position_embeddings": rope, "rotary_base": model["rotary_base"],
         "rotary_percent": model["rotary_percent"], "rotary_interleaved": False,
         "normalization": model["normalization"],
         "norm_epsilon": model.get("layernorm_epsilon", 1e-5), "apply_layernorm_1p": False,
         "swiglu": model["swiglu"], "squared_relu": False,
         "openai_gelu": not model["swiglu"],  # megazero's GPT-2 GELU: the tanh approximation
         "bias_gelu_fusion": False, "add_bias_linear": model["add_bias_linear"],
         "add_qkv_bias": model["add_bias_linear"],
         "untie_embeddings_and_output_weights": model["untie_embeddings_and_output_weights"],
         "apply_query_key_layer_scaling": False, "num_experts": None,
         "attention_dropout": model.get("attention_dropout", 0.1),
         "hidden_dropout": model.get("hidden_dropout", 0.1),
         "vocab_size": vocab_size, "padded_vocab_size": padded,
         "make_vocab_size_divisible_by": divisible_by,
         "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
         "virtual_pipeline_model_parallel_size": None, "data_parallel_size": 1,
         "world_size": tp * pp, "params_dtype": params_dtype,
         "fp16": params_dtype == torch.float16, "bf16": params_dtype == torch.bfloat16,
         "iteration": iteration, "consumed_train_samples": consumed_train_samples,
         "consumed_valid_samples": 0, "ckpt_format": "torch",
         "use_legacy_models": fmt == "legacy", "transformer_impl": "local",
         "use_distributed_optimizer": False, "tokenizer_type": None}
    d.update(extra or {})
    return argparse.Namespace(**d)


def _kinds(m: dict, ours: str) -> tuple[str, ...]:
    """The tensors of one module of a layer ("weight", maybe "bias")."""
    if "layernorm" in ours:
        return ("weight",) if m["normalization"] == "RMSNorm" else ("weight", "bias")
    return ("weight", "bias") if m["add_bias_linear"] else ("weight",)


def _shards(full: torch.Tensor, dim: int | None, tp: int, swiglu_fc1: bool,
            pad_rows: int | None) -> list[torch.Tensor]:
    """Each tp rank's piece of a full tensor ([rows, ...] -> tp x [rows/tp, ...] or whole)."""
    if pad_rows is not None and pad_rows > full.shape[0]:
        full = torch.cat([full, full.new_zeros(pad_rows - full.shape[0], *full.shape[1:])])
    if dim is None:
        return [full.contiguous()] * tp
    if swiglu_fc1:
        return [s.contiguous() for s in split_swiglu(full, tp)]
    return [s.contiguous() for s in full.chunk(tp, dim=dim)]


def write_megatron_checkpoint(out: str, iteration: int | str, model: dict, *,
                              full_tensor: Callable[[str], torch.Tensor], vocab_size: int,
                              tp: int = 1, pp: int = 1, fmt: str = "mcore",
                              make_vocab_size_divisible_by: int = 128,
                              params_dtype: torch.dtype = torch.float32,
                              consumed_train_samples: int = 0, scheduler: dict | None = None,
                              extra_args: dict | None = None, overwrite: bool = False) -> str:
    """Write the model ``model`` (megazero ``ModelConfig`` fields) with the full logical
    tensors ``full_tensor(name)`` as Megatron checkpoint ``out``/``iteration`` at (tp, pp) in
    the ``fmt`` names; returns the iteration folder."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    kv = model["num_query_groups"] or model["num_attention_heads"]
    for what, n, div in (("--num-layers", model["num_layers"], pp),
                         ("--num-attention-heads", model["num_attention_heads"], tp),
                         ("the key/value heads", kv, tp),
                         ("--ffn-hidden-size", model["ffn_hidden_size"], tp)):
        if n % div:
            raise CheckpointError(f"{what} ({n}) is not divisible by {div}: Megatron cannot "
                                  "split it so")
    base = iteration_dir(out, iteration)
    if os.path.exists(base):
        if not overwrite:
            raise CheckpointError(f"{base} already exists; remove it or write elsewhere")
        shutil.rmtree(base)
    shapes = expected_shapes(model, vocab_size)
    padded = padded_vocab_size(vocab_size, make_vocab_size_divisible_by, tp)
    saved_iteration = 0 if iteration == "release" else int(iteration)
    args = megatron_args(model, tp=tp, pp=pp, vocab_size=vocab_size, padded=padded,
                         divisible_by=make_vocab_size_divisible_by, iteration=saved_iteration,
                         consumed_train_samples=consumed_train_samples,
                         params_dtype=params_dtype, fmt=fmt, extra=extra_args)
    tied = not model["untie_embeddings_and_output_weights"]
    per = model["num_layers"] // pp

    def get(name):
        t = full_tensor(name)
        if tuple(t.shape) != shapes[name]:
            raise CheckpointError(f"{name} has shape {list(t.shape)}, the model "
                                  f"{list(shapes[name])}")
        return t.to(params_dtype)

    for p in range(pp):
        cells = [{} for _ in range(tp)]  # Megatron key (flat; nested below for legacy)

        def put(key, name, dim, swiglu=False, vocab=False, cells=cells):
            for t, piece in enumerate(_shards(get(name), dim, tp, swiglu,
                                              padded if vocab else None)):
                cells[t][key] = piece

        first, last = p == 0, p == pp - 1
        emb = "language_model.embedding." if fmt == "legacy" else "embedding."
        if first:
            put(emb + "word_embeddings.weight", "embedding.word_embeddings.weight", 0,
                vocab=True)
            if "embedding.position_embeddings.weight" in shapes:
                put(emb + "position_embeddings.weight", "embedding.position_embeddings.weight",
                    None)
        stack = "language_model.encoder." if fmt == "legacy" else ""
        # module order within a layer, as each model registers them (legacy: qkv first)
        order = _LAYER if fmt == "mcore" else (_LAYER[0], _LAYER[2], _LAYER[1], *_LAYER[3:])
        for local in range(per):
            for ours, mcore, legacy, dim in order:
                module = f"layers.{local}.{legacy}" if fmt == "legacy" else \
                    f"decoder.layers.{local}.{mcore}"
                for w in _kinds(model, ours):
                    put(f"{stack}{module}.{w}", f"layers.{p * per + local}.{ours}.{w}",
                        dim if w == "weight" or dim == 0 else None,
                        swiglu=model["swiglu"] and ours == "mlp.fc1")
                if fmt == "mcore" and ours in _LINEARS:
                    for cell in cells:
                        cell[f"{module}._extra_state"] = None
        if last:
            norm = "language_model.encoder.final_norm." if fmt == "legacy" \
                else "decoder.final_layernorm."
            for w in ("weight", "bias"):
                if f"final_layernorm.{w}" in shapes:
                    put(norm + w, f"final_layernorm.{w}", None)
            head = "embedding.word_embeddings.weight" if tied else "output_layer.weight"
            if not tied:
                put("language_model.output_layer.weight" if fmt == "legacy"
                    else "output_layer.weight", head, 0, vocab=True)
            elif not first:  # the head's copy of the tied embedding
                put("word_embeddings_for_head.weight" if fmt == "legacy"
                    else "output_layer.weight", head, 0, vocab=True)
            if fmt == "mcore":
                for cell in cells:
                    cell["output_layer._extra_state"] = None
        for t, cell in enumerate(cells):
            state = {"args": args, "checkpoint_version": CHECKPOINT_VERSION,
                     "iteration": saved_iteration, "model": nest(cell, fmt),
                     "num_floating_point_operations_so_far": 0}
            if scheduler is not None:
                state["opt_param_scheduler"] = dict(scheduler)
            atomic_save(state, os.path.join(cell_dir(out, iteration, t, p, pp), MODEL_FILE))
    atomic_write_text(tracker_path(out), f"{iteration}\n")
    return base


def nest(flat: dict, fmt: str) -> dict:
    """Megatron-core's flat state dict, or legacy's tree: ``language_model`` -> embedding
    (per module) / encoder (flat) / output_layer, and ``word_embeddings_for_head``."""
    if fmt == "mcore":
        return flat
    tree: dict = {}
    for key, v in flat.items():
        parts = key.split(".")
        if parts[0] == "language_model" and parts[1] == "encoder":
            tree.setdefault("language_model", {}).setdefault("encoder", {})[
                ".".join(parts[2:])] = v
            continue
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = v
    return tree


__all__ = ["FORMATS", "megatron_args", "nest", "write_megatron_checkpoint"]
