"""1-bit Adam (``--optimizer onebitadam``): Adam bit for bit before the freeze step; after it,
local momenta averaged through the compressed all-reduce (a quarter or less of the bytes),
training on at tp x dp, exact resume at the same layout, a fresh start of the error feedback at
another, and the configurations it refuses."""

import math

import pytest
import torch

from megazero.config import ConfigError, OptimizerConfig
from tests.dist_helper import run_distributed
from tests.train_helper import TINY, assert_same_run, run_training


def test_before_the_freeze_it_is_adam_bit_for_bit():
    onebit = run_training(TINY + " --train-iters 4 --optimizer onebitadam --freeze-step 10", 2)
    adam = run_training(TINY + " --train-iters 4", 2)
    assert_same_run(onebit, adam, rtol=0, what="1-bit Adam before its freeze vs Adam")


@pytest.mark.parametrize("argv,world", [("", 2), (" --tensor-model-parallel-size 2", 4)])
def test_after_the_freeze_it_trains_like_adam(argv, world):
    onebit, _, results = run_training(
        TINY + " --train-iters 10 --optimizer onebitadam --freeze-step 3" + argv, world)
    adam, _, _ = run_training(TINY + " --train-iters 10" + argv, world)
    assert onebit[:3] == adam[:3]  # Adam up to the freeze
    assert all(math.isfinite(v) for v in onebit)
    assert onebit[-1] < onebit[0]
    assert abs(onebit[-1] - adam[-1]) / adam[-1] < 0.05


def _bytes_per_step(optimizer, freeze_step):
    import megazero
    from megazero.distributed.parallel_state import ParallelState

    ps = ParallelState.build()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 64))
    engine = megazero.initialize(model, OptimizerConfig(optimizer=optimizer, lr=1e-3,
                                                        freeze_step=freeze_step), ps)
    g = torch.Generator().manual_seed(ps.dp_rank)
    per_step = []
    for _ in range(4):
        with ps.comm.counting() as stats:
            x = torch.randn(8, 64, generator=g)
            engine.backward(engine(x).pow(2).mean())
            engine.step()
        per_step.append(stats.total_sent())
    return per_step, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("world", [2, 4])
def test_after_the_freeze_a_quarter_of_the_bytes_or_less(world):
    adam = run_distributed(_bytes_per_step, world, "adam", 100)
    onebit = run_distributed(_bytes_per_step, world, "onebitadam", 2)
    for (a, _), (o, _) in zip(adam, onebit):
        assert o[:2] == a[:2]  # the warm-up all-reduces full-precision gradients
        assert all(b <= a[-1] / 4 for b in o[2:]), (o, a)
    for _, params in onebit[1:]:  # the momentum, and so the parameters, agree on every rank
        assert all(torch.equal(p, q) for p, q in zip(params, onebit[0][1]))


def test_resume_is_exact_at_the_same_layout_and_fresh_at_another(tmp_path):
    argv = TINY + " --optimizer onebitadam --freeze-step 2"
    full = run_training(argv + " --train-iters 8", 2)
    run_training(argv + f" --train-iters 8 --exit-interval 5 --save {tmp_path} "
                 "--save-interval 5", 2)
    resumed = run_training(argv + f" --train-iters 8 --load {tmp_path}", 2)
    assert resumed[0] == full[0][5:], "1-bit Adam did not resume exactly"
    for name, p in full[1].items():
        assert torch.equal(p, resumed[1][name]), name
    # at another layout the error feedback restarts from zero: it trains on, not exactly
    other = run_training(argv + f" --train-iters 8 --load {tmp_path}", 1)
    assert len(other[0]) == 3 and all(math.isfinite(v) for v in other[0])
    assert other[0] != full[0][5:]


def test_refused_combinations_name_the_flags():
    with pytest.raises(ConfigError, match="--freeze-step"):
        OptimizerConfig(optimizer="onebitadam", freeze_step=0)
    with pytest.raises(Exception, match="runs at --zero-stage 0"):
        run_training(TINY + " --train-iters 3 --optimizer onebitadam --zero-stage 1", 2)
