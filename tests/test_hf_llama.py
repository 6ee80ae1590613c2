"""HF Llama (``LlamaForCausalLM`` layout) <-> megazero, against a reference Llama written
here from the HF tensor names (no ``transformers``): the same logits both ways (fp32, 1e-5),
and to-hf then from-hf reproduces every tensor bit for bit."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from megazero.config import ModelConfig
from megazero.tools.hf import HFFormatError
from megazero.tools.hf_llama import (
    llama_config,
    llama_to_megazero,
    megazero_to_llama,
    model_args_from_llama,
)

VOCAB, LAYERS, H, HEADS = 96, 2, 32, 4


def reference_llama(sd, cfg, ids):
    """LlamaForCausalLM's forward from its config.json and tensors: ids [b, s] -> logits."""
    heads, groups = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg["hidden_size"] // heads
    rot = int(hd * cfg.get("partial_rotary_factor", 1.0))
    eps = cfg["rms_norm_eps"]

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def lin(x, name):
        y = x @ sd[name + ".weight"].T
        return y + sd[name + ".bias"] if name + ".bias" in sd else y

    b, s = ids.shape
    inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, rot, 2).float() / rot)
    ang = torch.arange(s).float()[:, None] * inv  # [s, rot/2]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

    def rope(t):  # [b, n, s, hd]
        r, p = t[..., :rot], t[..., rot:]
        half = rot // 2
        rotated = torch.cat([-r[..., half:], r[..., :half]], -1)
        return torch.cat([r * cos + rotated * sin, p], -1)

    x = sd["model.embed_tokens.weight"][ids]  # [b, s, h]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = rms(x, sd[p + "input_layernorm.weight"])
        q = lin(a, p + "self_attn.q_proj").view(b, s, heads, hd).transpose(1, 2)
        k = lin(a, p + "self_attn.k_proj").view(b, s, groups, hd).transpose(1, 2)
        v = lin(a, p + "self_attn.v_proj").view(b, s, groups, hd).transpose(1, 2)
        q, k = rope(q), rope(k)
        k = k.repeat_interleave(heads // groups, dim=1)
        v = v.repeat_interleave(heads // groups, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
        scores = scores.masked_fill(torch.ones(s, s).triu(1).bool(), float("-inf"))
        ctx = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, heads * hd)
        x = x + lin(ctx, p + "self_attn.o_proj")
        m = rms(x, sd[p + "post_attention_layernorm.weight"])
        x = x + lin(F.silu(lin(m, p + "mlp.gate_proj")) * lin(m, p + "mlp.up_proj"),
                    p + "mlp.down_proj")
    x = rms(x, sd["model.norm.weight"])
    head = sd["lm_head.weight"] if "lm_head.weight" in sd else sd["model.embed_tokens.weight"]
    return x @ head.T


FAMILIES = {
    "llama-gqa-untied": dict(group_query_attention=True, num_query_groups=2,
                             untie_embeddings_and_output_weights=True, add_bias_linear=False),
    "mha-tied-bias-partial-rope": dict(rotary_percent=0.5, rotary_base=500),
}


def _megazero_model(family):
    from megazero.distributed.parallel_state import ParallelState
    from megazero.model import GPTModel

    cfg = ModelConfig(num_layers=LAYERS, hidden_size=H, num_attention_heads=HEADS,
                      ffn_hidden_size=48, vocab_size=VOCAB, make_vocab_size_divisible_by=8,
                      seq_length=16, attention_dropout=0.0, hidden_dropout=0.0,
                      init_method_std=0.2, layernorm_epsilon=1e-6,
                      position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                      **FAMILIES[family])
    model = GPTModel(cfg, ParallelState.build(), seed=5).eval()
    return cfg, model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_megazero_to_hf_gives_the_same_logits_and_round_trips(family):
    cfg, model = _megazero_model(family)
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    margs = dataclasses.asdict(cfg)
    hf = megazero_to_llama(full, margs)
    hcfg = llama_config(margs)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids, torch.arange(16).expand(2, -1))  # [b, s, V]
    torch.testing.assert_close(ours, reference_llama(hf, hcfg, ids), rtol=1e-5, atol=1e-5)
    back = llama_to_megazero(hf, model_args_from_llama(hcfg))
    assert back.keys() == full.keys()
    for k in full:
        assert torch.equal(back[k], full[k]), k


def test_hf_llama_loads_into_megazero_with_the_same_logits():
    """A Llama made by the reference's names, loaded into megazero's model."""
    cfg, model = _megazero_model("llama-gqa-untied")
    g = torch.Generator().manual_seed(7)
    hf = {k: torch.randn(v.shape, generator=g) * 0.2
          for k, v in megazero_to_llama(model.state_dict(), dataclasses.asdict(cfg)).items()}
    hcfg = llama_config(dataclasses.asdict(cfg))
    args = model_args_from_llama(hcfg)
    assert args["num_query_groups"] == 2 and args["untie_embeddings_and_output_weights"]
    model.load_state_dict(llama_to_megazero(hf, args))
    ids = torch.randint(0, VOCAB, (2, 16), generator=g)
    with torch.no_grad():
        ours = model(ids, torch.arange(16).expand(2, -1))
    torch.testing.assert_close(ours, reference_llama(hf, hcfg, ids), rtol=1e-5, atol=1e-5)


def test_bad_llama_checkpoints_are_named():
    cfg, model = _megazero_model("llama-gqa-untied")
    margs = dataclasses.asdict(cfg)
    hf = megazero_to_llama(model.state_dict(), margs)
    args = model_args_from_llama(llama_config(margs))
    missing = dict(hf)
    del missing["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(HFFormatError, match="model.layers.1.mlp.up_proj.weight"):
        llama_to_megazero(missing, args)
    with pytest.raises(HFFormatError, match="unexpected tensors.*extra"):
        llama_to_megazero({**hf, "extra.weight": torch.zeros(1)}, args)
    with pytest.raises(HFFormatError, match="rope_scaling"):
        model_args_from_llama({**llama_config(margs), "rope_scaling": {"type": "linear"}})
    gpt2 = {**margs, "position_embedding_type": "learned_absolute"}
    with pytest.raises(HFFormatError, match="rope"):
        megazero_to_llama(model.state_dict(), gpt2)


def test_llama_checkpoint_to_hf_and_back_through_the_tool(tmp_path):
    """A trained tp2 x pp2 Llama checkpoint: to-hf writes LlamaForCausalLM (config and
    tensors), whose reference logits are megazero's; from-hf at another layout gives the same
    tensors back bit for bit."""
    from megazero.checkpoint.reader import CheckpointReader
    from megazero.tools import hf
    from megazero.tools.checkpoint import main as tool
    from tests.train_helper import TINY, run_training

    llama = (" --position-embedding-type rope --normalization RMSNorm --swiglu "
             "--group-query-attention --num-query-groups 2 --untie-embeddings-and-output-weights "
             "--disable-bias-linear --tensor-model-parallel-size 2 "
             "--pipeline-model-parallel-size 2")
    ckpt = tmp_path / "mz"
    run_training(TINY + llama + f" --train-iters 3 --save {ckpt} --save-interval 3", 4)
    assert tool(["to-hf", str(ckpt), str(tmp_path / "hf")]) == 0
    cfg, sd = hf.load_hf(str(tmp_path / "hf"))
    assert cfg["model_type"] == "llama" and cfg["num_key_value_heads"] == 2
    assert not cfg["tie_word_embeddings"] and not cfg["attention_bias"]
    assert "lm_head.weight" in sd and "model.layers.3.mlp.gate_proj.weight" in sd
    assert tool(["from-hf", str(tmp_path / "hf"), str(tmp_path / "back"), "--tp", "1",
                 "--make-vocab-size-divisible-by", "8"]) == 0
    a, b = CheckpointReader(str(ckpt), 3), CheckpointReader(str(tmp_path / "back"), "release")
    assert sorted(a.param_names()) == sorted(b.param_names())
    for name in a.param_names():
        assert torch.equal(a.full_tensor(name, "model"), b.full_tensor(name, "model")), name
    assert b.args["model"]["swiglu"] and b.args["model"]["num_query_groups"] == 2
    from megazero.distributed.parallel_state import ParallelState
    from megazero.model import GPTModel

    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    mcfg = ModelConfig(**{k: v for k, v in b.args["model"].items() if k in fields})
    model = GPTModel(mcfg, ParallelState.build()).eval()
    model.load_state_dict({n: b.full_tensor(n, "model") for n in b.param_names()})
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(ids, torch.arange(16).expand(2, -1))
    torch.testing.assert_close(ours, reference_llama(sd, cfg, ids), rtol=1e-5, atol=1e-5)
