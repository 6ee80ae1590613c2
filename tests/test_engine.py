"""megazero.initialize on a plain torch.nn model equals torch.optim.AdamW in one process."""

import pytest
import torch

import megazero
from megazero.config import OptimizerConfig
from megazero.distributed.parallel_state import ParallelState
from tests.dist_helper import run_distributed

STEPS, BATCH, GAS = 6, 8, 2


def make_model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))


def data(step, micro):
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 8, generator=g)


def reference():
    model = make_model()
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() == 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=1e-2)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(GAS):
            x, y = data(step, micro)
            loss = torch.nn.functional.mse_loss(model(x), y)
            (loss / GAS).backward()
            losses.append(loss.item())
        opt.step()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def engine_run(stage, tmp=None):
    ps = ParallelState.build()
    model = make_model()
    cfg = OptimizerConfig(zero_stage=stage, lr=1e-2, weight_decay=0.1, clip_grad=0.0,
                          zero_reduce_bucket_size=300)
    engine = megazero.initialize(model, cfg, ps, gradient_accumulation_steps=GAS)
    losses = []
    n, r = ps.dp_size, ps.dp_rank
    for step in range(STEPS):
        for micro in range(GAS):
            x, y = data(step, micro)
            xs, ys = x.chunk(n)[r], y.chunk(n)[r]  # this rank's part of the batch
            loss = torch.nn.functional.mse_loss(engine(xs), ys)
            engine.backward(loss)
            updated = engine.step()
            assert updated == (micro == GAS - 1)
            full = loss.detach().clone()
            torch.distributed.all_reduce(full, group=ps.dp_group)
            losses.append(full.item() / n)
    if tmp is not None:
        engine.save_checkpoint(tmp)
    from megazero.data_parallel.zero3 import GatheredParameters

    with GatheredParameters(list(model.parameters())):
        params = {n_: p.detach().clone() for n_, p in model.named_parameters()}
    return losses, params, engine.global_steps


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_matches_torch_adamw(stage, tmp_path):
    ref_losses, ref_params = reference()
    results = run_distributed(engine_run, 2, stage, str(tmp_path))
    losses, params, steps = results[0]
    assert steps == STEPS
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5,
                               atol=1e-7)
    for name, p in ref_params.items():
        torch.testing.assert_close(params[name], p, rtol=1e-5, atol=1e-7,
                                   msg=lambda m, name=name: f"stage {stage} {name}: {m}")
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == str(STEPS)
    from megazero.tools.consolidate import consolidate

    state = consolidate(str(tmp_path))
    for name, p in ref_params.items():
        torch.testing.assert_close(state[name], p, rtol=1e-5, atol=1e-7)


def test_megazero_initialize_is_also_the_init_module():
    import megazero.initialize as init_module

    assert callable(megazero.initialize) and hasattr(init_module, "init_distributed")
    engine = megazero.initialize(torch.nn.Linear(2, 2), OptimizerConfig(lr=0.1))
    loss = engine(torch.ones(1, 2)).sum()
    engine.backward(loss)
    assert engine.step()
