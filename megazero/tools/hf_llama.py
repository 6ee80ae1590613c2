"""The Llama family in Hugging Face's ``LlamaForCausalLM`` layout <-> megazero's full state
dict (offline, one process; no ``transformers`` needed).

A megazero model converts when it is Llama-shaped: RoPE (``--position-embedding-type rope``,
``rope_theta`` = ``--rotary-base``, ``partial_rotary_factor`` = ``--rotary-percent``), RMSNorm,
SwiGLU, with or without grouped-query attention (``num_key_value_heads``), tied or untied
embeddings (``tie_word_embeddings``), with or without linear biases (``attention_bias`` /
``mlp_bias``). Differences handled:

* names: ``model.layers.<i>.self_attn.{q,k,v,o}_proj`` <-> ``layers.<i>.attention.qkv`` /
  ``attention.proj``, ``mlp.{gate,up,down}_proj`` <-> ``mlp.fc1`` / ``mlp.fc2``,
  ``model.embed_tokens`` / ``model.norm`` / ``lm_head`` <-> the embedding, ``final_layernorm``
  and ``output_layer``;
* the fused qkv: megazero's rows ``[group, (q_1 .. q_{heads/groups}, k, v), head_dim]`` <->
  HF's separate ``q_proj`` ``[heads * head_dim, h]`` (query head i in group i // (heads /
  groups)), ``k_proj`` and ``v_proj`` ``[groups * head_dim, h]``;
* SwiGLU's fc1 rows interleaved ``[ffn, (gate, up)]`` <-> ``gate_proj`` and ``up_proj``.

Both use RoPE's rotate-half convention on the same dimension order, so no permutation of the
query and key rows is needed. Every conversion is reshapes and slices: from-hf then to-hf
reproduces the tensors bit for bit.
"""

from __future__ import annotations

import torch

from megazero.tools import hf
from megazero.tools.hf import HFFormatError

LLAMA_ARCH = {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True}


def is_llama(model: dict) -> bool:
    """Whether megazero model settings (a ``ModelConfig`` as a dict) are Llama-shaped."""
    return all(model.get(k) == v for k, v in LLAMA_ARCH.items())


def _groups(model: dict) -> tuple[int, int, int]:
    heads = model["num_attention_heads"]
    groups = model.get("num_query_groups") or heads
    return heads, groups, model["hidden_size"] // heads


def megazero_to_llama(full: dict[str, torch.Tensor], model: dict) -> dict[str, torch.Tensor]:
    """HF ``LlamaForCausalLM`` tensors from megazero's full (unpadded) tensors."""
    if not is_llama(model):
        raise HFFormatError("to-hf writes Llama (LlamaForCausalLM) only for a model with "
                            "--position-embedding-type rope --normalization RMSNorm --swiglu")
    heads, groups, hd = _groups(model)
    per = heads // groups
    out = {"model.embed_tokens.weight": full["embedding.word_embeddings.weight"],
           "model.norm.weight": full["final_layernorm.weight"]}
    if model.get("untie_embeddings_and_output_weights"):
        out["lm_head.weight"] = full["output_layer.weight"]
    for i in range(model["num_layers"]):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = full[src + "input_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = \
            full[src + "post_attention_layernorm.weight"]
        for w in ("weight", "bias"):
            qkv = full.get(src + f"attention.qkv.{w}")
            if qkv is None:
                continue
            g = qkv.reshape(groups, per + 2, hd, *qkv.shape[1:])  # [ng, per + 2, hd, (h)]
            out[dst + f"self_attn.q_proj.{w}"] = g[:, :per].reshape(heads * hd, *qkv.shape[1:])
            out[dst + f"self_attn.k_proj.{w}"] = g[:, per].reshape(groups * hd, *qkv.shape[1:])
            out[dst + f"self_attn.v_proj.{w}"] = \
                g[:, per + 1].reshape(groups * hd, *qkv.shape[1:])
            if src + f"attention.proj.{w}" in full:
                out[dst + f"self_attn.o_proj.{w}"] = full[src + f"attention.proj.{w}"]
            fc1 = full.get(src + f"mlp.fc1.{w}")
            if fc1 is not None:
                out[dst + f"mlp.gate_proj.{w}"] = fc1[0::2]
                out[dst + f"mlp.up_proj.{w}"] = fc1[1::2]
            if src + f"mlp.fc2.{w}" in full:
                out[dst + f"mlp.down_proj.{w}"] = full[src + f"mlp.fc2.{w}"]
    return {k: v.contiguous() for k, v in out.items()}


def llama_to_megazero(sd: dict[str, torch.Tensor], model: dict) -> dict[str, torch.Tensor]:
    """megazero's full tensors from HF ``LlamaForCausalLM`` tensors (all of them used)."""
    heads, groups, hd = _groups(model)
    used: set[str] = set()

    def take(key):
        if key not in sd:
            raise HFFormatError(f"the HF Llama checkpoint has no tensor {key!r}")
        used.add(key)
        return sd[key]

    out = {"embedding.word_embeddings.weight": take("model.embed_tokens.weight"),
           "final_layernorm.weight": take("model.norm.weight")}
    if model.get("untie_embeddings_and_output_weights"):
        out["output_layer.weight"] = take("lm_head.weight")
    elif "lm_head.weight" in sd:  # tied: HF may store the shared tensor twice
        if not torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"]):
            raise HFFormatError("config.json ties the embeddings but lm_head.weight differs "
                                "from model.embed_tokens.weight")
        used.add("lm_head.weight")
    biases = {"weight": True, "bias": model.get("add_bias_linear", False)}
    for i in range(model["num_layers"]):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        out[dst + "input_layernorm.weight"] = take(src + "input_layernorm.weight")
        out[dst + "post_attention_layernorm.weight"] = take(src + "post_attention_layernorm.weight")
        for w, present in biases.items():
            if not present:
                continue
            q = take(src + f"self_attn.q_proj.{w}")
            k, v = take(src + f"self_attn.k_proj.{w}"), take(src + f"self_attn.v_proj.{w}")
            rest = q.shape[1:]
            qg = q.reshape(groups, heads // groups, hd, *rest)
            out[dst + f"attention.qkv.{w}"] = torch.cat(
                [qg, k.reshape(groups, 1, hd, *rest), v.reshape(groups, 1, hd, *rest)],
                dim=1).reshape(-1, *rest)
            out[dst + f"attention.proj.{w}"] = take(src + f"self_attn.o_proj.{w}")
            gate, up = take(src + f"mlp.gate_proj.{w}"), take(src + f"mlp.up_proj.{w}")
            out[dst + f"mlp.fc1.{w}"] = torch.stack([gate, up], dim=1).reshape(
                2 * gate.shape[0], *gate.shape[1:])
            out[dst + f"mlp.fc2.{w}"] = take(src + f"mlp.down_proj.{w}")
    extra = sorted(k for k in sd if k not in used and not k.endswith("rotary_emb.inv_freq"))
    if extra:
        raise HFFormatError(f"unexpected tensors in the HF Llama checkpoint: {extra[:8]}")
    return out


def llama_config(model: dict, *, eos_token_id: int | None = None,
                 torch_dtype: str = "float32") -> dict:
    """``LlamaConfig`` fields (config.json) for megazero's model settings."""
    heads, groups, hd = _groups(model)
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
           "vocab_size": model["vocab_size"], "hidden_size": model["hidden_size"],
           "intermediate_size": model["ffn_hidden_size"],
           "num_hidden_layers": model["num_layers"], "num_attention_heads": heads,
           "num_key_value_heads": groups, "head_dim": hd, "hidden_act": "silu",
           "max_position_embeddings": model["max_position_embeddings"],
           "rms_norm_eps": model["layernorm_epsilon"], "rope_theta": float(model["rotary_base"]),
           "partial_rotary_factor": model.get("rotary_percent", 1.0),
           "tie_word_embeddings": not model.get("untie_embeddings_and_output_weights", False),
           "attention_bias": bool(model.get("add_bias_linear", True)),
           "mlp_bias": bool(model.get("add_bias_linear", True)),
           "attention_dropout": model.get("attention_dropout", 0.0),
           "initializer_range": model.get("init_method_std", 0.02),
           "use_cache": True, "torch_dtype": torch_dtype}
    if eos_token_id is not None:
        cfg["bos_token_id"] = cfg["eos_token_id"] = int(eos_token_id)
    return cfg


def model_args_from_llama(cfg: dict) -> dict:
    """``ModelConfig`` keyword arguments from an HF Llama config.json (checked)."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise HFFormatError(f"hidden_act {cfg.get('hidden_act')!r}: megazero's SwiGLU uses silu")
    if cfg.get("rope_scaling"):
        raise HFFormatError(f"config.json sets rope_scaling {cfg['rope_scaling']!r}, which "
                            "megazero's RoPE lacks")
    if bool(cfg.get("attention_bias", False)) != bool(cfg.get("mlp_bias", False)):
        raise HFFormatError("attention_bias and mlp_bias differ; megazero's "
                            "--disable-bias-linear covers both")
    heads, h = cfg["num_attention_heads"], cfg["hidden_size"]
    if cfg.get("head_dim", h // heads) * heads != h:
        raise HFFormatError(f"head_dim {cfg['head_dim']} x {heads} heads != hidden_size {h}")
    groups = cfg.get("num_key_value_heads") or heads
    n_pos = cfg.get("max_position_embeddings", 2048)
    return {"num_layers": cfg["num_hidden_layers"], "hidden_size": h,
            "num_attention_heads": heads, "ffn_hidden_size": cfg["intermediate_size"],
            "seq_length": n_pos, "max_position_embeddings": n_pos,
            "vocab_size": cfg["vocab_size"], "layernorm_epsilon": cfg.get("rms_norm_eps", 1e-6),
            "init_method_std": cfg.get("initializer_range", 0.02),
            "attention_dropout": cfg.get("attention_dropout", 0.0), "hidden_dropout": 0.0,
            "position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True,
            "rotary_base": int(cfg.get("rope_theta", 10000)),
            "rotary_percent": cfg.get("partial_rotary_factor", 1.0),
            "group_query_attention": groups != heads,
            "num_query_groups": groups if groups != heads else None,
            "untie_embeddings_and_output_weights": not cfg.get("tie_word_embeddings", False),
            "add_bias_linear": bool(cfg.get("attention_bias", False))}




# ---- dispatch between the GPT-2 and Llama layouts (the checkpoint tool's to-hf / from-hf) ----
_GPT2 = {"position_embedding_type": "learned_absolute", "normalization": "LayerNorm",
         "swiglu": False, "num_query_groups": None,
         "untie_embeddings_and_output_weights": False, "add_bias_linear": True}


def check_hf_exportable(model: dict) -> None:
    """An ``HFFormatError`` unless the model is Llama-shaped or GPT-2."""
    if is_llama(model):
        return
    odd = {k: model.get(k, v) for k, v in _GPT2.items() if model.get(k, v) != v}
    if odd:
        raise HFFormatError(
            "to-hf writes GPT-2 (GPT2LMHeadModel) or Llama (LlamaForCausalLM: rope, RMSNorm, "
            "SwiGLU) checkpoints; this model is neither: "
            + ", ".join(f"{k}={v}" for k, v in odd.items()))


def export_hf(full: dict[str, torch.Tensor], model: dict, *, eos_token_id: int | None,
              torch_dtype: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(HF tensors, config.json) of a megazero model: ``LlamaForCausalLM`` when it is
    Llama-shaped, ``GPT2LMHeadModel`` when it is GPT-2, else an ``HFFormatError`` naming the
    settings that fit neither."""
    check_hf_exportable(model)
    if is_llama(model):
        return megazero_to_llama(full, model), llama_config(
            model, eos_token_id=eos_token_id, torch_dtype=torch_dtype)
    return hf.megazero_to_hf(full, model["num_attention_heads"]), hf.hf_config(
        model, eos_token_id=eos_token_id, torch_dtype=torch_dtype)


def import_hf(cfg: dict, sd: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """(``ModelConfig`` keyword arguments, megazero's full tensors) of an HF folder's
    config.json and tensors: Llama (``model_type`` llama, mistral without sliding window) or
    GPT-2."""
    kind = cfg.get("model_type", "gpt2")
    if kind in ("llama", "mistral"):
        if cfg.get("sliding_window"):
            raise HFFormatError(f"config.json sets sliding_window {cfg['sliding_window']}, "
                                "which megazero's attention lacks")
        args = model_args_from_llama(cfg)
        return args, llama_to_megazero(sd, args)
    if kind != "gpt2":
        raise HFFormatError(f"config.json has model_type {kind!r}; GPT-2 (gpt2) and Llama "
                            "(llama) convert")
    args = hf.model_args_from_hf(cfg)
    return args, hf.hf_to_megazero(sd, args["num_attention_heads"])


def model_flags(args: dict) -> str:
    """pretrain_gpt2.py's model flags for ``ModelConfig`` keyword arguments."""
    flags = [f"--num-layers {args['num_layers']}", f"--hidden-size {args['hidden_size']}",
             f"--num-attention-heads {args['num_attention_heads']}",
             f"--ffn-hidden-size {args['ffn_hidden_size']}",
             f"--max-position-embeddings {args['max_position_embeddings']}"]
    if args.get("position_embedding_type", "learned_absolute") != "learned_absolute":
        flags.append(f"--position-embedding-type {args['position_embedding_type']} "
                     f"--rotary-base {args['rotary_base']}")
        if args.get("rotary_percent", 1.0) != 1.0:
            flags.append(f"--rotary-percent {args['rotary_percent']}")
    if args.get("normalization", "LayerNorm") != "LayerNorm":
        flags.append(f"--normalization {args['normalization']}")
    if args.get("swiglu"):
        flags.append("--swiglu")
    if args.get("num_query_groups"):
        flags.append(f"--group-query-attention --num-query-groups {args['num_query_groups']}")
    if args.get("untie_embeddings_and_output_weights"):
        flags.append("--untie-embeddings-and-output-weights")
    if not args.get("add_bias_linear", True):
        flags.append("--disable-bias-linear")
    return " ".join(flags)


__all__ = ["check_hf_exportable", "export_hf", "import_hf", "is_llama", "llama_config",
           "llama_to_megazero", "megazero_to_llama", "model_args_from_llama", "model_flags"]
