"""The Llama family by Megatron's flags (RoPE, RMSNorm, SwiGLU, grouped-query attention, untied
embeddings, no linear biases, a free FFN size): each variant trained at tp2, pp2, dp2 with
ZeRO-3 and tp2 x pp2 x dp2 gives the single process's losses and parameters."""

import pytest
import torch

from tests.train_helper import TINY, assert_same_run, run_training

ITERS = " --train-iters 6"
LLAMA = (" --position-embedding-type rope --normalization RMSNorm --swiglu "
         "--group-query-attention --num-query-groups 2 --untie-embeddings-and-output-weights "
         "--disable-bias-linear")
VARIANTS = {
    "rope": " --position-embedding-type rope",
    "rope-partial": " --position-embedding-type rope --rotary-percent 0.5 --rotary-base 500",
    "rmsnorm": " --normalization RMSNorm",
    "swiglu": " --swiglu --ffn-hidden-size 48",
    "gqa": " --group-query-attention --num-query-groups 2",
    "untied": " --untie-embeddings-and-output-weights",
    "no-bias": " --disable-bias-linear",
    "no-positions": " --position-embedding-type none",
    "llama": LLAMA,
}
LAYOUTS = {
    "tp2": (" --tensor-model-parallel-size 2 --sequence-parallel", 2),
    "pp2": (" --pipeline-model-parallel-size 2", 2),
    "dp2-zero3": (" --zero-stage 3", 2),
    "tp2pp2dp2": (" --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
                  "--zero-stage 1", 8),
}
_single = {}


def _single_run(variant):
    if variant not in _single:
        _single[variant] = run_training(TINY + ITERS + VARIANTS[variant], 1)
    return _single[variant]


def _groups(variant):
    return 2 if "num-query-groups 2" in VARIANTS[variant] else None


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_layout_matches_single_process(variant, layout):
    argv, world = LAYOUTS[layout]
    run = run_training(TINY + ITERS + VARIANTS[variant] + argv, world)
    assert_same_run(run, _single_run(variant), what=f"{variant} at {layout}",
                    kv_groups=_groups(variant))


def test_variants_build_the_parameters_they_name():
    """Each flag changes the model it names (so the parity above is not vacuous)."""
    _, full, _ = _single_run("llama")
    names = set(full)
    assert "output_layer.weight" in names  # untied
    assert not any(n.endswith(".bias") and "layernorm" not in n for n in names)  # no bias
    assert "embedding.position_embeddings.weight" not in names  # RoPE, no learned positions
    assert "layers.0.input_layernorm.bias" not in names  # RMSNorm: weight only
    h, heads, groups = 32, 4, 2
    assert full["layers.0.attention.qkv.weight"].shape == ((heads + 2 * groups) * h // heads, h)
    ffn = int(4 * h * 2 / 3 / 64) * 64  # Megatron's SwiGLU default: 64 for h=32
    assert full["layers.0.mlp.fc1.weight"].shape[0] == 2 * full["layers.0.mlp.fc2.weight"].shape[1]
    assert ffn == full["layers.0.mlp.fc2.weight"].shape[1]
    gpt2 = _single_run("untied")[0]
    assert not torch.allclose(torch.tensor(gpt2), torch.tensor(_single_run("llama")[0]))
