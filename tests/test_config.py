"""Flag parsing and the cross-checks that name the offending flags."""

import pytest

from megazero.arguments import parse_args
from megazero.config import ConfigError, MegazeroConfig, ModelConfig, ParallelConfig


def cfg(argv, world=1):
    return parse_args(argv.split(), world_size=world)


def test_defaults_and_megatron_flags():
    c = cfg("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
            "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
            "--micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --bf16", world=8)
    assert c.parallel.data_parallel_size == 2
    assert c.model.ffn_hidden_size == 128 and c.model.max_position_embeddings == 16
    assert c.num_microbatches == 2
    assert c.model.params_dtype == "bfloat16"
    assert MegazeroConfig.from_dict(c.to_dict()) == c


@pytest.mark.parametrize("argv,world,needle", [
    ("--tensor-model-parallel-size 3", 8, "--tensor-model-parallel-size (3)"),
    ("--num-attention-heads 6 --hidden-size 48 --tensor-model-parallel-size 4", 4,
     "--num-attention-heads (6) must be divisible by --tensor-model-parallel-size (4)"),
    ("--num-layers 3 --pipeline-model-parallel-size 2", 2, "--num-layers (3)"),
    ("--micro-batch-size 3 --global-batch-size 8", 2, "--global-batch-size (8)"),
    ("--fp16 --bf16", 1, "--fp16 and --bf16"),
    ("--hidden-size 30 --num-attention-heads 4", 1, "--hidden-size (30)"),
    ("--sequence-parallel --tensor-model-parallel-size 2 --seq-length 15 "
     "--max-position-embeddings 16", 2, "--sequence-parallel needs --seq-length (15)"),
    ("--train-iters 5 --train-samples 10", 1, "--train-iters or --train-samples"),
    ("--data-path foo", 1, "--tokenizer-type"),
    ("--train-iters 5 --lr-warmup-iters 5", 1, "--lr-warmup-iters (5) must be smaller"),
])
def test_bad_flags_are_named(argv, world, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        cfg(argv, world)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_config_errors_without_argparse():
    with pytest.raises(ConfigError, match="world size"):
        ParallelConfig(tensor_model_parallel_size=2, world_size=3)
    with pytest.raises(ConfigError, match="--seq-length"):
        ModelConfig(seq_length=64, max_position_embeddings=32)
