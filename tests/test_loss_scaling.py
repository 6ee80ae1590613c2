"""fp16 dynamic loss scaling: an overflow skips the step, is counted and backs the scale off."""

import torch
import torch.distributed as dist

import pretrain_gpt2
from megazero.arguments import parse_args
from megazero.config import OptimizerConfig
from megazero.data_parallel import ZeroOptimizer
from megazero.distributed.parallel_state import ParallelState
from megazero.optim import DynamicGradScaler
from megazero.training import pretrain
from tests.dist_helper import run_distributed
from tests.train_helper import TINY, plain_history


def test_dynamic_scaler_hysteresis_and_growth():
    s = DynamicGradScaler(initial_scale=1024, min_scale=1, growth_interval=3, hysteresis=2)
    s.update(True)
    assert s.scale == 1024  # first overflow absorbed by hysteresis
    s.update(True)
    assert s.scale == 512
    for _ in range(3):
        s.update(False)
    assert s.scale == 1024 and s.hysteresis_tracker == 2
    s2 = DynamicGradScaler(initial_scale=2, min_scale=1, hysteresis=1)
    s2.update(True)
    s2.update(True)
    assert s2.scale == 1.0  # never below --min-loss-scale


def test_optimizer_skips_step_on_inf_and_halves_scale():
    model = torch.nn.Linear(4, 3).half()
    before = [p.detach().clone() for p in model.parameters()]
    cfg = OptimizerConfig(fp16=True, initial_loss_scale=2.0**10, hysteresis=1, lr=0.1)
    opt = ZeroOptimizer([model], cfg, ParallelState.build())
    model.weight.grad[0, 0] = float("inf")
    ok, norm, skipped = opt.step()
    assert not ok and skipped == 1 and opt.loss_scale == 2.0**9
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.zero_grad()
    model.weight.grad.fill_(0.5)
    ok, _, _ = opt.step()
    assert ok and not torch.equal(before[0], model.weight.detach())


def _forward_with_inf(data_iterator, model):
    output, loss_func = pretrain_gpt2.forward_step(data_iterator, model)
    state = getattr(_forward_with_inf, "calls", 0)
    _forward_with_inf.calls = state + 1
    # 4 micro-batches per iteration: poison the loss of iteration 3
    if 8 <= state < 12:
        output = output * float("inf")
    return output, loss_func


def _fp16_run(argv):
    _forward_with_inf.calls = 0
    config = parse_args(argv, world_size=dist.get_world_size())
    result = pretrain(pretrain_gpt2.train_valid_test_datasets_provider,
                      pretrain_gpt2.model_provider, _forward_with_inf, config,
                      zero3_unit_policy=pretrain_gpt2.zero3_unit_policy)
    return plain_history(result)  # live objects stay in the worker


def test_fp16_training_skips_overflowing_iteration():
    argv = (TINY + " --train-iters 5 --fp16 --initial-loss-scale 1024 --hysteresis 1").split()
    history = run_distributed(_fp16_run, 1, argv)[0]
    assert history["skipped_iters"] == 1
    assert history["nan_iters"] == 1  # the poisoned loss is inf
    assert len(history["lm loss"]) == 4  # like Megatron: no loss printed for a skipped step
    assert history["loss scale"] == [1024.0, 1024.0, 512.0, 512.0, 512.0]
