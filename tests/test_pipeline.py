"""Pipeline parallelism: parity with one process, schedule order, p2p, resume."""

import json

import pytest
import torch

from megazero.distributed.parallel_state import ParallelState
from megazero.pipeline_parallel.p2p import P2P
from tests.common import assert_close
from tests.dist_helper import run_distributed
from tests.train_helper import TINY, assert_same_run, run_training

ITERS = " --train-iters 5"
PP2 = " --pipeline-model-parallel-size 2"


@pytest.fixture(scope="module")
def single_process_run():
    return run_training(TINY + ITERS, 1)


@pytest.mark.parametrize("argv,world", [
    (PP2, 2),
    (" --pipeline-model-parallel-size 4", 4),
    (PP2 + " --tensor-model-parallel-size 2", 4),
    (PP2, 4),  # pp2 x dp2
    (PP2 + " --tensor-model-parallel-size 2 --sequence-parallel", 8),  # tp2 x pp2 x dp2
    (PP2 + " --num-layers-per-virtual-pipeline-stage 1", 2),  # interleaved, 2 chunks/rank
    (PP2 + " --num-layers-per-virtual-pipeline-stage 1 --no-overlap-p2p-communication", 2),
])
def test_pipeline_layouts_match_single_process(single_process_run, argv, world):
    run = run_training(TINY + ITERS + argv, world)
    assert_same_run(run, single_process_run, what=argv)


def test_interleaved_four_stages_matches():
    tiny8 = TINY.replace("--num-layers 4", "--num-layers 8")
    base = run_training(tiny8 + " --train-iters 3", 1)
    run = run_training(tiny8 + " --train-iters 3 --pipeline-model-parallel-size 4 "
                       "--num-layers-per-virtual-pipeline-stage 1", 4)
    assert_same_run(run, base, what="pp4 x 2 chunks")


@pytest.mark.parametrize("overlap", ["", " --no-overlap-p2p-communication"])
def test_interleaved_evaluation_with_more_microbatches_than_stages(overlap):
    """Evaluation (forward only) runs every virtual micro-batch as warmup, as Megatron."""
    evals = TINY.replace("--eval-iters 0", "--eval-iters 2 --eval-interval 2")
    base = run_training(evals + " --train-iters 4", 1)
    run = run_training(evals + " --train-iters 4" + PP2 +
                       " --num-layers-per-virtual-pipeline-stage 1" + overlap, 2)
    assert_same_run(run, base, what="interleaved with evaluation" + overlap)
    evals = [r["history"]["validation"] for r in (run[2][-1], base[2][-1])]
    assert len(evals[0]) == len(evals[1]) == 2, evals
    for got, want in zip(*evals):
        assert got["lm loss"] == pytest.approx(want["lm loss"], rel=1e-5), evals


def expected_1f1b(p, r, m):
    warmup = min(p - r - 1, m)
    order = [("forward", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("forward", warmup + i), ("backward", i)]
    order += [("backward", i) for i in range(m - warmup, m)]
    return order


def test_1f1b_order_and_in_flight_bound(tmp_path):
    p, m = 4, 8
    trace = tmp_path / "trace.json"
    run_training(TINY.replace("--global-batch-size 8", "--global-batch-size 16")
                 + f" --train-iters 3 --pipeline-model-parallel-size {p} "
                 f"--pipeline-trace {trace}", p)
    ranks = json.loads(trace.read_text())["ranks"]
    assert len(ranks) == p
    for r in ranks:
        events = sorted((e for e in r["events"] if e["iteration"] == 2),
                        key=lambda e: e["start"])
        order = [(e["kind"], e["microbatch"]) for e in events]
        assert order == expected_1f1b(p, r["pp_rank"], m), f"stage {r['pp_rank']}: {order}"
        in_flight = peak = 0
        for kind, _ in order:
            in_flight += 1 if kind == "forward" else -1
            peak = max(peak, in_flight)
        assert peak == min(p - r["pp_rank"], m) <= p


def p2p_case(variable, batched):
    ps = ParallelState.build(pp_size=2)
    shape = (3, 2, 4) if not variable else ((5, 1) if ps.is_first_stage else (2, 7))
    p2p = P2P(ps, None if variable else shape, variable_shapes=variable)
    p2p._batched = batched  # NCCL's path (one batch_isend_irecv), or ops posted one by one
    gen = torch.Generator().manual_seed(ps.pp_rank)
    act = torch.randn(shape, generator=gen)
    # both directions at once between the same two ranks (prev == next): tags keep them apart
    from_prev, from_next = p2p.communicate(send_next=act, send_prev=act * 10,
                                           recv_prev=True, recv_next=True)
    other = torch.randn((5, 1) if ps.is_last_stage else (2, 7), generator=torch.Generator()
                        .manual_seed(1 - ps.pp_rank)) if variable else \
        torch.randn(shape, generator=torch.Generator().manual_seed(1 - ps.pp_rank))
    assert_close(from_prev.detach(), other, rtol=0, atol=0, what="activation")
    assert_close(from_next, other * 10, rtol=0, atol=0, what="gradient")
    assert from_prev.requires_grad and not from_next.requires_grad
    return True


def p2p_pending_case():
    ps = ParallelState.build(pp_size=2)
    p2p = P2P(ps, (3, 2, 4))
    mine = [torch.full((3, 2, 4), float(10 * ps.pp_rank + k)) for k in range(3)]
    # two activation exchanges and one gradient exchange in flight at once, waited out of order
    act = [p2p.post(send_next=mine[k], recv_prev=True) for k in range(2)]
    grad = p2p.post(send_prev=mine[2], recv_next=True)
    other = 10 * (1 - ps.pp_rank)
    assert torch.equal(grad.wait()[1], torch.full((3, 2, 4), float(other + 2)))
    for k in (1, 0):
        received = act[k].wait()[0]
        assert received.requires_grad
        assert torch.equal(received.detach(), torch.full((3, 2, 4), float(other + k)))
    return True


def test_p2p_exchanges_in_flight_complete_in_any_order():
    assert all(run_distributed(p2p_pending_case, 2))


@pytest.mark.parametrize("variable", [False, True])
@pytest.mark.parametrize("batched", [False, True])
def test_p2p_both_directions_between_two_stages(variable, batched):
    assert all(run_distributed(p2p_case, 2, variable, batched))


def test_resume_with_pp2_is_exact(tmp_path):
    dropout = TINY.replace("--attention-dropout 0 --hidden-dropout 0",
                           "--attention-dropout 0.1 --hidden-dropout 0.1")
    full = run_training(dropout + " --train-iters 8" + PP2, 2)
    run_training(dropout + f" --train-iters 8 --exit-interval 4 --save {tmp_path}" + PP2, 2)
    assert (tmp_path / "iter_0000004" / "mp_rank_00_001" / "model_optim_rng.pt").exists()
    second = run_training(dropout + f" --train-iters 8 --load {tmp_path}" + PP2, 2)
    assert second[0] == full[0][4:]
    for name, p in full[1].items():
        assert torch.equal(p, second[1][name]), name
