"""The naive data-parallel baseline against one process, and ZeRO 0-2 against the baseline."""

from __future__ import annotations

import torch

from megazero.config import OptimizerConfig
from megazero.data_parallel import ZeroOptimizer
from megazero.data_parallel.naive import DataParallelNaive
from megazero.distributed.parallel_state import ParallelState
from tests.dist_helper import run_distributed

SEED, STEPS, BATCH, LR, MOMENTUM = 7, 6, 8, 0.05, 0.9


def _model():
    torch.manual_seed(SEED)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 4, generator=g)


def _train(kind: str, stage: int = 0):
    """Losses and final parameters: kind "single" (one process, the whole batch),
    "naive" (DataParallelNaive) or "zero" (ZeroOptimizer at ``stage``), each dp rank on its
    share of every batch."""
    ps = ParallelState.build()
    model = _model()
    if kind == "zero":
        cfg = OptimizerConfig(optimizer="sgd", lr=LR, sgd_momentum=MOMENTUM, weight_decay=0.0,
                              clip_grad=0.0, zero_stage=stage)
        opt = ZeroOptimizer([model], cfg, ps)
    else:
        opt = DataParallelNaive(model, ps, torch.optim.SGD(model.parameters(), lr=LR,
                                                           momentum=MOMENTUM))
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        if kind != "single":
            x, y = x.chunk(ps.dp_size)[ps.dp_rank], y.chunk(ps.dp_size)[ps.dp_rank]
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.finish_grad_sync()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def test_naive_dp2_equals_one_process_on_the_whole_batch():
    _, expected = _train("single")
    for _, params in run_distributed(_train, 2, "naive"):
        for p, e in zip(params, expected):
            torch.testing.assert_close(p, e, rtol=1e-6, atol=1e-7)


def test_zero_stages_equal_the_naive_baseline():
    naive = run_distributed(_train, 2, "naive")
    for stage in (0, 1, 2):
        zero = run_distributed(_train, 2, "zero", stage)
        for (nl, np_), (zl, zp) in zip(naive, zero):
            torch.testing.assert_close(torch.tensor(zl), torch.tensor(nl), rtol=1e-6, atol=0)
            for p, e in zip(zp, np_):
                torch.testing.assert_close(p, e, rtol=1e-6, atol=1e-7,
                                           msg=lambda m, s=stage: f"stage {s}: {m}")


def _naive_refuses_model_parallelism():
    ps = ParallelState.build(tp_size=2)
    model = _model()
    try:
        DataParallelNaive(model, ps, torch.optim.SGD(model.parameters(), lr=LR))
    except ValueError as exc:
        return str(exc)
    return None


def test_naive_refuses_model_parallel_layouts():
    for msg in run_distributed(_naive_refuses_model_parallelism, 2):
        assert msg is not None and "tp = pp = 1" in msg
