"""GPT-2 in Hugging Face's ``GPT2LMHeadModel`` layout <-> megazero's full state dict.

No ``transformers`` needed: HF's GPT-2 is plain tensors with known names. Differences handled:

* names: ``transformer.h.<i>.ln_1`` <-> ``layers.<i>.input_layernorm``, ``attn.c_attn`` <->
  ``attention.qkv``, ``attn.c_proj`` <-> ``attention.proj``, ``mlp.c_fc``/``mlp.c_proj`` <->
  ``mlp.fc1``/``mlp.fc2``, ``wte``/``wpe``/``ln_f`` <-> the embeddings and
  ``final_layernorm``; ``lm_head`` is tied to ``wte`` in both;
* HF's ``Conv1D`` stores weights as ``[in, out]``, megazero's linears as ``[out, in]``;
* the fused qkv rows: HF ``[(q, k, v), head, head_dim]``, megazero (Megatron)
  ``[head, (q, k, v), head_dim]`` so a tensor-parallel shard holds whole heads.

Every conversion is transposes and reshapes, so from-hf then to-hf reproduces the tensors
bit for bit. megazero's full tensors are unpadded (vocabulary padding is per layout). Files:
``model.safetensors`` (when the ``safetensors`` package is installed) or
``pytorch_model.bin``, plus ``config.json`` with ``GPT2Config`` fields; reading also accepts
sharded checkpoints (``*.index.json``) and keys without the ``transformer.`` prefix, and
ignores the attention-mask buffers (``attn.bias``, ``attn.masked_bias``).
"""

from __future__ import annotations

import json
import os

import torch

from megazero.checkpoint.paths import atomic_save, atomic_write_text

PREFIX = "transformer."
# HF module -> (megazero module, HF weight stored transposed: Conv1D's [in, out])
_LAYER_MODULES = (("ln_1", "input_layernorm", False), ("attn.c_attn", "attention.qkv", True),
                  ("attn.c_proj", "attention.proj", True),
                  ("ln_2", "post_attention_layernorm", False), ("mlp.c_fc", "mlp.fc1", True),
                  ("mlp.c_proj", "mlp.fc2", True))
_LAYER_MAP = {f"{hf}.{w}": (f"{mz}.{w}", transposed and w == "weight")  # HF suffix -> (ours, T)
              for hf, mz, transposed in _LAYER_MODULES for w in ("weight", "bias")}
_TOP_MAP = {"wte.weight": "embedding.word_embeddings.weight",
            "wpe.weight": "embedding.position_embeddings.weight",
            "ln_f.weight": "final_layernorm.weight", "ln_f.bias": "final_layernorm.bias"}
_BUFFERS = (".attn.bias", ".attn.masked_bias")


class HFFormatError(ValueError):
    """An HF folder or state dict megazero cannot convert (the message says what is wrong)."""


# ---- qkv row order ---------------------------------------------------------------------------
def qkv_megazero_to_hf(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows ``[head, (q,k,v), hn]`` -> ``[(q,k,v), head, hn]`` (weight ``[3h, in]`` or bias)."""
    rest = t.shape[1:]
    return t.reshape(n_head, 3, -1, *rest).transpose(0, 1).reshape(t.shape)


def qkv_hf_to_megazero(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows ``[(q,k,v), head, hn]`` -> ``[head, (q,k,v), hn]``."""
    rest = t.shape[1:]
    return t.reshape(3, n_head, -1, *rest).transpose(0, 1).reshape(t.shape)


# ---- state dicts -----------------------------------------------------------------------------
def megazero_to_hf(full: dict[str, torch.Tensor], n_head: int) -> dict[str, torch.Tensor]:
    """HF ``GPT2LMHeadModel`` tensors (``transformer.`` names, contiguous, no ``lm_head``:
    tied) from a full megazero state dict (unpadded, any dtype)."""
    out = {PREFIX + hf: full[mz] for hf, mz in _TOP_MAP.items()}
    layers = sorted({int(k.split(".")[1]) for k in full if k.startswith("layers.")})
    for i in layers:
        for hf, (mz, transposed) in _LAYER_MAP.items():
            t = full[f"layers.{i}.{mz}"]
            if mz.startswith("attention.qkv"):
                t = qkv_megazero_to_hf(t, n_head)
            out[f"{PREFIX}h.{i}.{hf}"] = t.t() if transposed else t
    return {k: v.detach().contiguous() for k, v in out.items()}


def hf_to_megazero(sd: dict[str, torch.Tensor], n_head: int) -> dict[str, torch.Tensor]:
    """Full megazero state dict from HF GPT-2 tensors (with or without ``transformer.``)."""
    sd = normalize_hf_keys(sd)
    out, used = {}, set()
    for hf, mz in _TOP_MAP.items():
        out[mz] = _take(sd, hf, used)
    layers = sorted({int(k.split(".")[1]) for k in sd if k.startswith("h.")})
    if layers != list(range(len(layers))):
        raise HFFormatError(f"GPT-2 layers must be numbered 0..n-1, found {layers}")
    for i in layers:
        for hf, (mz, transposed) in _LAYER_MAP.items():
            t = _take(sd, f"h.{i}.{hf}", used)
            t = t.t() if transposed else t
            if mz.startswith("attention.qkv"):
                t = qkv_hf_to_megazero(t, n_head)
            out[f"layers.{i}.{mz}"] = t.contiguous()
    lm_head = sd.get("lm_head.weight")
    if lm_head is not None:
        used.add("lm_head.weight")
        if not torch.equal(lm_head, out["embedding.word_embeddings.weight"]):
            raise HFFormatError("lm_head.weight differs from transformer.wte.weight: megazero "
                                "ties the output layer to the word embedding")
    extra = sorted(set(sd) - used)
    if extra:
        raise HFFormatError(f"unexpected tensors in the HF checkpoint: {extra[:8]}")
    return out


def normalize_hf_keys(sd: dict) -> dict:
    """Strip ``transformer.`` and drop the attention-mask buffers."""
    out = {}
    for k, v in sd.items():
        if k.endswith(_BUFFERS):
            continue
        out[k[len(PREFIX):] if k.startswith(PREFIX) else k] = v
    return out


def _take(sd, key, used):
    if key not in sd:
        raise HFFormatError(f"the HF checkpoint has no tensor {key!r} (nor {PREFIX}{key})")
    used.add(key)
    return sd[key]


# ---- config.json -----------------------------------------------------------------------------
def hf_config(model: dict, *, eos_token_id: int | None = None,
              torch_dtype: str = "float32") -> dict:
    """``GPT2Config`` fields (config.json) for megazero's ``ModelConfig`` (as a dict)."""
    h = model["hidden_size"]
    cfg = {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
        "vocab_size": model["vocab_size"], "n_positions": model["max_position_embeddings"],
        "n_ctx": model["max_position_embeddings"], "n_embd": h,
        "n_layer": model["num_layers"], "n_head": model["num_attention_heads"],
        "n_inner": model["ffn_hidden_size"], "activation_function": "gelu_new",
        "resid_pdrop": model["hidden_dropout"], "embd_pdrop": model["hidden_dropout"],
        "attn_pdrop": model["attention_dropout"],
        "layer_norm_epsilon": model["layernorm_epsilon"],
        "initializer_range": model["init_method_std"],
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False, "tie_word_embeddings": True, "use_cache": True,
        "summary_type": "cls_index", "summary_use_proj": True, "summary_activation": None,
        "summary_proj_to_labels": True, "summary_first_dropout": 0.1,
        "torch_dtype": torch_dtype,
    }
    if eos_token_id is not None:
        cfg["bos_token_id"] = cfg["eos_token_id"] = int(eos_token_id)
    return cfg


def model_args_from_hf(cfg: dict) -> dict:
    """``ModelConfig`` keyword arguments from an HF GPT-2 config.json (checked)."""
    if cfg.get("model_type", "gpt2") != "gpt2":
        raise HFFormatError(f"config.json has model_type {cfg.get('model_type')!r}; only "
                            "GPT-2 (model_type gpt2) converts")
    act = cfg.get("activation_function", "gelu_new")
    if act != "gelu_new":
        raise HFFormatError(f"activation_function {act!r}: megazero's GPT-2 uses the tanh "
                            "approximation of GELU (gelu_new)")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if cfg.get(flag):
            raise HFFormatError(f"config.json sets {flag}, which megazero's GPT-2 lacks")
    if cfg.get("scale_attn_weights") is False:
        raise HFFormatError("config.json sets scale_attn_weights false; megazero scales "
                            "attention scores by 1/sqrt(head_dim)")
    if cfg.get("tie_word_embeddings") is False:
        raise HFFormatError("config.json unties the word embedding; megazero ties it")
    h = cfg["n_embd"]
    n_pos = cfg.get("n_positions", cfg.get("n_ctx"))
    return {"num_layers": cfg["n_layer"], "hidden_size": h,
            "num_attention_heads": cfg["n_head"],
            "ffn_hidden_size": cfg.get("n_inner") or 4 * h,
            "seq_length": n_pos, "max_position_embeddings": n_pos,
            "vocab_size": cfg["vocab_size"],
            "layernorm_epsilon": cfg.get("layer_norm_epsilon", 1e-5),
            "init_method_std": cfg.get("initializer_range", 0.02),
            "attention_dropout": cfg.get("attn_pdrop", 0.1),
            "hidden_dropout": cfg.get("resid_pdrop", 0.1)}


# ---- files -----------------------------------------------------------------------------------
def have_safetensors() -> bool:
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        return False
    return True


def save_hf(out: str, tensors: dict[str, torch.Tensor], config: dict,
            fmt: str | None = None) -> str:
    """Write ``model.safetensors`` (default when available) or ``pytorch_model.bin`` and
    ``config.json`` into folder ``out`` (atomically each); returns the weights file path."""
    os.makedirs(out, exist_ok=True)
    fmt = fmt or ("safetensors" if have_safetensors() else "bin")
    if fmt == "safetensors":
        from safetensors.torch import save_file

        path = os.path.join(out, "model.safetensors")
        tmp = f"{path}.tmp.{os.getpid()}"
        try:
            save_file(tensors, tmp, metadata={"format": "pt"})
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    elif fmt == "bin":
        path = os.path.join(out, "pytorch_model.bin")
        atomic_save(tensors, path)
    else:
        raise ValueError(f"format must be safetensors or bin, got {fmt!r}")
    atomic_write_text(os.path.join(out, "config.json"), json.dumps(config, indent=2) + "\n")
    return path


def _load_file(path: str) -> dict:
    if path.endswith(".safetensors"):
        if not have_safetensors():
            raise HFFormatError(f"{path} needs the safetensors package (pip install "
                                "safetensors)")
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def load_hf(folder: str) -> tuple[dict, dict]:
    """(config.json dict, state dict) of an HF GPT-2 folder."""
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg_path):
        raise HFFormatError(f"{folder} has no config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    for name in ("model.safetensors", "pytorch_model.bin"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return cfg, _load_file(path)
        index = path + ".index.json"
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
            sd = {}
            for part in files:
                sd.update(_load_file(os.path.join(folder, part)))
            return cfg, sd
    raise HFFormatError(f"{folder} holds neither model.safetensors nor pytorch_model.bin "
                        "(nor their .index.json)")


__all__ = ["HFFormatError", "hf_config", "hf_to_megazero", "load_hf", "megazero_to_hf",
           "model_args_from_hf", "save_hf"]
