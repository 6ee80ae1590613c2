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
    assert onebit[4:] != adam[4:]  # then the compressed momentum (step 4 moves the weights)
    assert max(abs(a - b) / a for a, b in zip(adam, onebit)) < 0.01


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
    with pytest.raises(ConfigError, match="comm_backend_name"):
        OptimizerConfig(optimizer="onebitadam", compressed_comm_backend="mpi")


def _backend_worker(name, backend):
    import megazero
    from megazero.distributed.parallel_state import ParallelState

    model = torch.nn.Linear(4, 4)
    cfg = OptimizerConfig(optimizer=name, lr=1e-3, compressed_comm_backend=backend)
    try:
        megazero.initialize(model, cfg, ParallelState.build())
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("name", ["onebitadam", "zerooneadam"])
def test_a_named_backend_is_the_one_the_exchange_runs_on(name):
    # a ds_config's comm_backend_name: on CPU tensors the exchange runs on gloo
    assert run_distributed(_backend_worker, 2, name, "gloo") == [None, None]
    assert run_distributed(_backend_worker, 2, name, None) == [None, None]
    for err in run_distributed(_backend_worker, 2, name, "nccl"):
        assert "comm_backend_name is nccl" in err and "gloo" in err, err


# ---- 0/1 Adam ------------------------------------------------------------------------------
ZEROONE = (" --optimizer zerooneadam --var-freeze-step 6 --var-update-scaler 2 "
           "--local-step-scaler 3 --local-step-clipper 4")


def test_zero_one_adam_trains_like_adam():
    zo, _, _ = run_training(TINY + " --train-iters 16" + ZEROONE, 2)
    adam, _, _ = run_training(TINY + " --train-iters 16", 2)
    assert zo[:3] == pytest.approx(adam[:3], rel=1e-6)  # full-precision steps 1 and 2
    assert zo[3:] != adam[3:]
    assert max(abs(a - b) / a for a, b in zip(adam, zo)) < 0.01


def _zero_one_steps(freeze):
    import megazero
    from megazero.distributed.parallel_state import ParallelState

    ps = ParallelState.build()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 64))
    engine = megazero.initialize(model, OptimizerConfig(
        optimizer="zerooneadam", lr=1e-3, var_freeze_step=freeze, var_update_scaler=2,
        local_step_scaler=4, local_step_clipper=4), ps)
    g = torch.Generator().manual_seed(ps.dp_rank)
    out = []
    for _ in range(14):
        with ps.comm.counting() as stats:
            x = torch.randn(8, 64, generator=g)
            engine.backward(engine(x).pow(2).mean())
            engine.step()
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        out.append((stats.total_sent(), flat, dict(engine.optimizer.counters)))
    return out


def test_zero_one_adam_schedule_bytes_and_agreement():
    """Variance updates (full all-reduce) at steps 1, 2, 4, 6 (interval 1, 1, 2, 2, doubling
    after 2 updates) with 1-bit steps between; from step 7 local steps without communication,
    synchronised at multiples of the local interval (1, 1, 1, 1, then 2); parameters equal on
    every rank after each synchronisation."""
    runs = run_distributed(_zero_one_steps, 2, 6)
    sent = [b for b, _, _ in runs[0]]
    full = max(sent)
    assert [b == full for b in sent[:6]] == [True, True, False, True, False, True]
    assert all(0 < b <= full / 4 for b in (sent[2], sent[4]))  # 1-bit gradient steps
    local = sent[6:]  # steps 7..14: intervals 1 (steps 7-10), then 2
    synced = [64 < b <= full / 4 for b in local]
    assert synced == [True, True, True, True, False, True, False, True]
    # between synchronisations only the one-element overflow flag (every rank must skip alike)
    assert all(b <= 16 for b, s in zip(local, synced) if not s)
    for step in range(14):
        if step < 6 or synced[step - 6]:
            assert torch.equal(runs[0][step][1], runs[1][step][1]), step
    assert not torch.equal(runs[0][12][1], runs[1][12][1])  # a local step: ranks differ


@pytest.mark.parametrize("stop", [9, 11])  # at a synchronisation, and between two
def test_zero_one_adam_resumes_exactly_in_its_local_phase(tmp_path, stop):
    argv = TINY + ZEROONE
    full = run_training(argv + " --train-iters 14", 2)
    run_training(argv + f" --train-iters 14 --exit-interval {stop} --save {tmp_path} "
                 f"--save-interval {stop}", 2)
    resumed = run_training(argv + f" --train-iters 14 --load {tmp_path}", 2)
    assert resumed[0] == full[0][stop:], "0/1 Adam did not resume exactly"
    for name, p in full[1].items():
        assert torch.equal(p, resumed[1][name]), name
    if stop == 11:  # at dp 4 the local phase restarts from the loaded parameters
        other = run_training(argv + f" --train-iters 14 --load {tmp_path}", 4)
        assert len(other[0]) == 3 and all(math.isfinite(v) for v in other[0])
