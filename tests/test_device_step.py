"""The sync-free optimizer step (issue 27): the scalars computed on the device are the host's.

On a GPU the ZeRO optimizer keeps the overflow flag, grad norm, clip factor, step count and
fp16's dynamic loss scale on the device and runs torch's fused Adam(W) with them
(``ops.foreach_adam.adam_update_device_``); elsewhere it reads them once and runs its own
kernels. Both are checked here on CPU tensors (torch's fused Adam has a CPU kernel):

* ``finalize.step_scalars`` is Python's float64 arithmetic on the host value, bit for bit;
* ``adam_update_device_`` equals the reference Adam to fp32 rounding, and a step with the
  overflow flag set changes nothing;
* whole training runs with the device path forced on CPU match the host path: losses and
  parameters to fp32 rounding, the same skipped iterations and loss scales under fp16
  overflow, at ZeRO 0, 1 and 3.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import pretrain_gpt2
from megazero.arguments import parse_args
from megazero.data_parallel.finalize import step_scalars
from megazero.data_parallel.zero3 import GatheredParameters
from megazero.ops.cpu_adam import adam_update_reference_
from megazero.ops.foreach_adam import adam_update_device_
from megazero.optim.rules import AdamRule
from megazero.training import pretrain
from tests.dist_helper import run_distributed
from tests.train_helper import TINY, plain_history

EPS32 = torch.finfo(torch.float32).eps


def _host_scalars(sumsq: float, scale: float, dp: int, clip: float):
    """What the host computes from the value read, with the device's float64 square root
    (IEEE on CUDA, as ``math.sqrt``; torch's CPU one may differ by one ulp)."""
    divisor = scale * dp
    root = torch.tensor([sumsq], dtype=torch.float64).sqrt().item()
    norm = root / divisor
    coeff = 1.0
    if clip > 0:
        c = clip / (norm + 1e-6)
        coeff = c if c < 1.0 else 1.0
    return False, norm, coeff / divisor


@pytest.mark.parametrize("dynamic", [False, True])
def test_step_scalars_are_the_host_arithmetic_bit_for_bit(dynamic):
    gen = torch.Generator().manual_seed(0)
    values = (torch.rand(200, generator=gen, dtype=torch.float64) * 10.0) ** 8
    for i, s in enumerate(values.tolist() + [0.0, 1e-300]):
        scale, dp, clip = (2.0 ** (i % 20), 1 + i % 3, [0.0, 1.0, 0.3][i % 3])
        scale_arg = torch.tensor(scale, dtype=torch.float64) if dynamic else scale
        found, norm, factor = step_scalars(torch.tensor([s], dtype=torch.float64), scale_arg,
                                           dp, clip)
        want = _host_scalars(s, scale, dp, clip)
        assert (bool(found), norm.item(), factor.item()) == want, (s, scale, dp, clip)
    found, norm, factor = step_scalars(torch.tensor([math.inf], dtype=torch.float64), 4.0, 2,
                                       1.0)
    assert bool(found) and math.isnan(norm.item())


def _adam_case(grad_dtype, n_tensors=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    sizes = [int(x) for x in torch.randint(1, 3000, (n_tensors,), generator=gen)]
    params = [torch.randn(n, generator=gen) for n in sizes]
    grads = [torch.randn(n, generator=gen).to(grad_dtype) * 300.0 for n in sizes]
    m = [torch.randn(n, generator=gen) * 0.01 for n in sizes]
    v = [torch.rand(n, generator=gen) * 1e-4 for n in sizes]
    return params, grads, m, v


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_device_adam_matches_the_reference(grad_dtype, adam_w_mode):
    params, grads, m, v = _adam_case(grad_dtype)
    wds = [0.1, 0.0, 0.1, 0.0, 0.1]
    ref = [[t.clone() for t in ts] for ts in (params, m, v)]
    copies = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
    factor = 1.0 / (300.0 * 2.0)  # un-scaling and clipping in one multiplier
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, adam_w_mode=adam_w_mode)
    ref_grads = [g.clone() for g in grads]  # the kernel un-scales fp32 gradients in place
    adam_update_device_(params, grads, m, v, step=torch.tensor(7.0), weight_decay=wds,
                        grad_scale=torch.tensor([factor], dtype=torch.float64),
                        found_inf=torch.tensor([False]), copies=copies,
                        batch_numel=4000, **kw)  # several batches
    adam_update_reference_(*ref[:1], ref_grads, *ref[1:], step=7, weight_decay=wds,
                           grad_scale=factor, bias_correction=True, mask_nonfinite=True, **kw)
    for got, want in zip(params + m + v, ref[0] + ref[1] + ref[2]):
        # the kernel fuses the arithmetic and divides by 1/factor: rounding apart, a few ulp
        # of the tensor's scale (a moment's cancellation leaves small elements' last bits)
        torch.testing.assert_close(got, want, rtol=8 * EPS32,
                                   atol=8 * EPS32 * float(want.abs().max()))
    for c, p in zip(copies, params):
        assert torch.equal(c, p.to(torch.bfloat16))


def test_device_adam_with_the_overflow_flag_changes_nothing():
    params, grads, m, v = _adam_case(torch.bfloat16, seed=1)
    before = [t.clone() for t in params + m + v]
    adam_update_device_(params, grads, m, v, step=torch.tensor(3.0), lr=1e-3, beta1=0.9,
                        beta2=0.999, eps=1e-8, weight_decay=0.1,
                        grad_scale=torch.tensor([1.0], dtype=torch.float64),
                        found_inf=torch.tensor([True]))
    assert all(torch.equal(a, b) for a, b in zip(before, params + m + v))


def _poisoned(data_iterator, model):
    """The forward step, its loss made infinite in iteration 3 (4 micro-batches each)."""
    output, loss_func = pretrain_gpt2.forward_step(data_iterator, model)
    calls = getattr(_poisoned, "calls", 0)
    _poisoned.calls = calls + 1
    if 8 <= calls < 12:
        output = output * float("inf")
    return output, loss_func


def _train(argv, device_scalars: bool):
    """A pretrain run, with the device-scalar step forced on CPU tensors when asked."""
    _poisoned.calls = 0
    saved = AdamRule.takes_device_scalars
    if device_scalars:
        AdamRule.takes_device_scalars = lambda self, device: self.bias_correction
    try:
        config = parse_args(argv, world_size=dist.get_world_size())
        result = pretrain(pretrain_gpt2.train_valid_test_datasets_provider,
                          pretrain_gpt2.model_provider, _poisoned, config,
                          zero3_unit_policy=pretrain_gpt2.zero3_unit_policy)
        on_device = result.optimizer.scalars_on_device
        model = [p for c in result.model for p in c.parameters()]
        with GatheredParameters(model):  # ZeRO-3 released them
            params = torch.cat([p.detach().float().reshape(-1) for p in model])
        return {"history": plain_history(result), "on_device": on_device, "params": params,
                "steps": result.optimizer.steps_done()}
    finally:
        AdamRule.takes_device_scalars = saved


@pytest.mark.parametrize("flags,world", [
    ("--fp16 --initial-loss-scale 1024 --hysteresis 1 --zero-stage 0", 1),
    ("--fp16 --initial-loss-scale 1024 --hysteresis 1 --zero-stage 1", 2),
    ("--bf16 --zero-stage 3", 2),
], ids=["fp16-z0", "fp16-z1-dp2", "bf16-z3-dp2"])
def test_training_with_device_scalars_matches_the_host_path(flags, world):
    argv = (TINY + " --train-iters 6 " + flags).split()
    host = run_distributed(_train, world, argv, False, timeout=300)
    device = run_distributed(_train, world, argv, True, timeout=300)
    for h, d in zip(host, device):
        assert not h["on_device"] and d["on_device"]
        hh, dh = h["history"], d["history"]
        fp16 = "--fp16" in flags
        assert hh["skipped_iters"] == dh["skipped_iters"]
        assert hh["skipped_iters"] >= 1  # iteration 3's loss is made infinite
        assert hh["loss scale"] == dh["loss scale"]
        assert h["steps"] == d["steps"] == 6 - hh["skipped_iters"]
        assert hh["lm loss"][0] == dh["lm loss"][0]  # before any update: the same model
        # the updates differ by fp32 rounding (the fused kernel's operation order), which the
        # low-precision model weights can round across: one ulp of bf16/fp16 at most
        ulp = torch.finfo(torch.float16 if fp16 else torch.bfloat16).eps
        torch.testing.assert_close(torch.tensor(dh["lm loss"]), torch.tensor(hh["lm loss"]),
                                   rtol=4 * ulp, atol=0)
        torch.testing.assert_close(d["params"], h["params"], rtol=0, atol=2 * ulp)
