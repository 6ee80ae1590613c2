"""Hugging Face GPT-2 import/export: exact round trip, and the same logits as megazero's model
through the reference GPT-2 of tests/reference_gpt2.py (written from the published model)."""

import json

import pytest
import torch

from megazero.tools import hf
from megazero.tools.checkpoint import main as tool
from tests.reference_gpt2 import megazero_full_to_hf, reference_logits
from tests.train_helper import TINY, run_training

N_HEAD = 4


def _hf_state_dict(n_layer=2, h=16, vocab=50, n_pos=8, inner=48, seed=0):
    """A GPT2LMHeadModel-shaped state dict of random tensors (with HF's mask buffers)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.3  # noqa: E731
    sd = {"transformer.wte.weight": r(vocab, h), "transformer.wpe.weight": r(n_pos, h),
          "transformer.ln_f.weight": 1 + r(h), "transformer.ln_f.bias": r(h)}
    for i in range(n_layer):
        p = f"transformer.h.{i}."
        sd.update({p + "ln_1.weight": 1 + r(h), p + "ln_1.bias": r(h),
                   p + "attn.c_attn.weight": r(h, 3 * h), p + "attn.c_attn.bias": r(3 * h),
                   p + "attn.c_proj.weight": r(h, h), p + "attn.c_proj.bias": r(h),
                   p + "ln_2.weight": 1 + r(h), p + "ln_2.bias": r(h),
                   p + "mlp.c_fc.weight": r(h, inner), p + "mlp.c_fc.bias": r(inner),
                   p + "mlp.c_proj.weight": r(inner, h), p + "mlp.c_proj.bias": r(h),
                   p + "attn.bias": torch.ones(1, 1, n_pos, n_pos).tril()})
    config = {"model_type": "gpt2", "vocab_size": vocab, "n_positions": n_pos, "n_embd": h,
              "n_layer": n_layer, "n_head": N_HEAD, "n_inner": inner,
              "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5}
    return sd, config


def _write_hf(folder, sd, config, fmt):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / "model.safetensors"))
    else:
        torch.save(sd, folder / "pytorch_model.bin")


def _params(sd):
    return {k: v for k, v in sd.items() if not k.endswith(".attn.bias")}


@pytest.mark.parametrize("fmt,prefix,tp,pp", [("safetensors", True, 2, 2),
                                              ("bin", False, 1, 2)])
def test_from_hf_then_to_hf_is_exact(tmp_path, fmt, prefix, tp, pp):
    if fmt == "safetensors":
        pytest.importorskip("safetensors")
    sd, config = _hf_state_dict()
    src = dict(sd)
    if not prefix:  # GPT2Model-style keys, and an lm_head tied to wte
        src = {k.removeprefix("transformer."): v for k, v in sd.items()}
        src["lm_head.weight"] = sd["transformer.wte.weight"].clone()
    _write_hf(tmp_path / "hf", src, config, fmt)
    assert tool(["from-hf", str(tmp_path / "hf"), str(tmp_path / "mz"), "--tp", str(tp),
                 "--pp", str(pp), "--make-vocab-size-divisible-by", "8"]) == 0
    assert (tmp_path / "mz" / "latest_checkpointed_iteration.txt").read_text().strip() \
        == "release"
    assert (tmp_path / "mz" / "release" / "layout.json").is_file()
    assert tool(["to-hf", str(tmp_path / "mz"), str(tmp_path / "out"), "--format", fmt]) == 0
    out_cfg, out = hf.load_hf(str(tmp_path / "out"))
    expect = _params(sd)
    assert out.keys() == expect.keys()
    for k, v in expect.items():
        assert torch.equal(out[k], v), k
    for key in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner"):
        assert out_cfg[key] == config[key], key
    assert out_cfg["model_type"] == "gpt2" and out_cfg["architectures"] == ["GPT2LMHeadModel"]
    assert out_cfg["activation_function"] == "gelu_new" and out_cfg["tie_word_embeddings"]


def test_from_hf_checkpoint_computes_the_hf_logits(tmp_path):
    """The imported checkpoint, loaded by megazero at tp=1 from tp=2 pp=2 files (vocab 50
    padded to 64), gives the reference GPT-2's logits of the HF tensors."""
    from megazero.inference.generate import load_model

    sd, config = _hf_state_dict(seed=1)
    _write_hf(tmp_path / "hf", sd, config, "bin")
    assert tool(["from-hf", str(tmp_path / "hf"), str(tmp_path / "mz"), "--tp", "2", "--pp",
                 "2", "--make-vocab-size-divisible-by", "16"]) == 0
    model, cfg, _ = load_model(str(tmp_path / "mz"))
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(8).expand(2, 8)
    with torch.no_grad():
        ours = model(ids, pos)[..., :50]
    torch.testing.assert_close(ours, reference_logits(_params(sd), ids, N_HEAD), rtol=1e-5,
                               atol=1e-5)


def test_bad_hf_inputs_fail_clearly(tmp_path):
    sd, config = _hf_state_dict()
    _write_hf(tmp_path / "hf", sd, {**config, "activation_function": "relu"}, "bin")
    with pytest.raises(hf.HFFormatError, match="gelu_new"):
        hf.model_args_from_hf(hf.load_hf(str(tmp_path / "hf"))[0])
    untied = dict(sd, **{"lm_head.weight": sd["transformer.wte.weight"] + 1})
    with pytest.raises(hf.HFFormatError, match="ties"):
        hf.hf_to_megazero(untied, N_HEAD)
    missing = {k: v for k, v in sd.items() if "h.1.mlp.c_fc.bias" not in k}
    with pytest.raises(hf.HFFormatError, match="h.1.mlp.c_fc.bias"):
        hf.hf_to_megazero(missing, N_HEAD)


@pytest.fixture(scope="module")
def tp2_checkpoint(tmp_path_factory):
    """A tp=2 training run (vocab 100, padded to 112 at tp=2) saved after 3 iterations."""
    path = tmp_path_factory.mktemp("tp2")
    argv = TINY.replace("--vocab-size 96", "--vocab-size 100")
    _, full, _ = run_training(argv + f" --train-iters 3 --tensor-model-parallel-size 2 "
                              f"--save {path}", 2)
    return path, full


def test_megazero_export_gives_megazero_logits(tp2_checkpoint, tmp_path):
    from megazero.inference.generate import load_model

    path, live = tp2_checkpoint
    assert tool(["to-hf", str(path), str(tmp_path / "hf")]) == 0
    _, exported = hf.load_hf(str(tmp_path / "hf"))
    # the export equals the test's own converter applied to the live parameters
    independent = megazero_full_to_hf(live, N_HEAD, 100)
    assert exported.keys() == independent.keys()
    for k, v in independent.items():
        assert torch.equal(exported[k], v), k
    model, _, _ = load_model(str(path))  # tp=1, resharded from the tp=2 files
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids, torch.arange(16).expand(2, 16))
    assert ours.shape[-1] == 104  # padded for tp=1 (multiple of 8)
    ref = reference_logits(exported, ids, N_HEAD)
    torch.testing.assert_close(ours[..., :100], ref, rtol=1e-5, atol=1e-5)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == 99


def test_export_runs_in_transformers_when_installed(tp2_checkpoint, tmp_path):
    transformers = pytest.importorskip("transformers")
    path, _ = tp2_checkpoint
    assert tool(["to-hf", str(path), str(tmp_path / "hf")]) == 0
    model = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    _, exported = hf.load_hf(str(tmp_path / "hf"))
    ids = torch.randint(0, 100, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    torch.testing.assert_close(logits, reference_logits(exported, ids, N_HEAD), rtol=1e-5,
                               atol=1e-5)
