"""A plain GPT-2 written from the published architecture, in Hugging Face's parameter layout.

Used as ground truth: megazero's GPTModel (any layout, gathered to full tensors) converted to
this layout must give the same logits and loss. Nothing of megazero is used to compute.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def gelu_new(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def reference_logits(sd: dict, input_ids: torch.Tensor, n_head: int, eps: float = 1e-5):
    """Logits [b, s, V] of GPT2LMHeadModel weights ``sd`` (HF names) for ids [b, s]."""
    b, s = input_ids.shape
    x = sd["transformer.wte.weight"][input_ids] + sd["transformer.wpe.weight"][:s]
    n_layer = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("transformer.h."))
    h = x.shape[-1]
    hn = h // n_head
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    for i in range(n_layer):
        p = f"transformer.h.{i}."
        a = F.layer_norm(x, (h,), sd[p + "ln_1.weight"], sd[p + "ln_1.bias"], eps)
        qkv = a @ sd[p + "attn.c_attn.weight"] + sd[p + "attn.c_attn.bias"]  # [b, s, 3h]
        q, k, v = qkv.split(h, dim=-1)
        q, k, v = (t.view(b, s, n_head, hn).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(hn)
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, h)
        x = x + y @ sd[p + "attn.c_proj.weight"] + sd[p + "attn.c_proj.bias"]
        m = F.layer_norm(x, (h,), sd[p + "ln_2.weight"], sd[p + "ln_2.bias"], eps)
        m = gelu_new(m @ sd[p + "mlp.c_fc.weight"] + sd[p + "mlp.c_fc.bias"])
        x = x + m @ sd[p + "mlp.c_proj.weight"] + sd[p + "mlp.c_proj.bias"]
    x = F.layer_norm(x, (h,), sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"], eps)
    return x @ sd["transformer.wte.weight"].t()


def megazero_full_to_hf(full: dict, n_head: int, vocab_size: int) -> dict:
    """Convert a full (tp=1, unpadded) megazero GPT state dict to HF GPT-2 names/layout."""
    out = {"transformer.wte.weight": full["embedding.word_embeddings.weight"][:vocab_size],
           "transformer.wpe.weight": full["embedding.position_embeddings.weight"],
           "transformer.ln_f.weight": full["final_layernorm.weight"],
           "transformer.ln_f.bias": full["final_layernorm.bias"]}
    layers = sorted({int(k.split(".")[1]) for k in full if k.startswith("layers.")})
    for i in layers:
        p, q = f"layers.{i}.", f"transformer.h.{i}."
        w = full[p + "attention.qkv.weight"]  # [3h, h], rows [head, (q,k,v), hn]
        h = w.shape[1]
        hn = h // n_head
        w = w.view(n_head, 3, hn, h).transpose(0, 1).reshape(3 * h, h)
        bias = full[p + "attention.qkv.bias"].view(n_head, 3, hn).transpose(0, 1).reshape(3 * h)
        out[q + "attn.c_attn.weight"] = w.t()
        out[q + "attn.c_attn.bias"] = bias
        out[q + "attn.c_proj.weight"] = full[p + "attention.proj.weight"].t()
        out[q + "attn.c_proj.bias"] = full[p + "attention.proj.bias"]
        out[q + "mlp.c_fc.weight"] = full[p + "mlp.fc1.weight"].t()
        out[q + "mlp.c_fc.bias"] = full[p + "mlp.fc1.bias"]
        out[q + "mlp.c_proj.weight"] = full[p + "mlp.fc2.weight"].t()
        out[q + "mlp.c_proj.bias"] = full[p + "mlp.fc2.bias"]
        for ln in ("1", "2"):
            src = "input_layernorm" if ln == "1" else "post_attention_layernorm"
            out[q + f"ln_{ln}.weight"] = full[p + f"{src}.weight"]
            out[q + f"ln_{ln}.bias"] = full[p + f"{src}.bias"]
    return out
