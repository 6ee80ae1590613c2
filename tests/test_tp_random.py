"""RNG tracker streams and activation recompute with bit-identical dropout."""

import pytest
import torch
import torch.nn.functional as F

from megazero.distributed.parallel_state import ParallelState
from megazero.tensor_parallel import ColumnParallelLinear, RowParallelLinear, checkpoint
from megazero.tensor_parallel.random import RNGStatesTracker, model_parallel_manual_seed
from tests.dist_helper import run_distributed


def test_tracker_streams_are_independent_and_resumable():
    tracker = model_parallel_manual_seed(42, tp_rank=0)
    a = torch.rand(3)
    with tracker.fork():
        m1 = torch.rand(3)
    b = torch.rand(3)
    # default stream unaffected by the fork
    torch.manual_seed(42)
    assert torch.equal(torch.rand(3), a) and torch.equal(torch.rand(3), b)
    # the model-parallel stream continues where it stopped, and is seed + 2718 + tp_rank
    with tracker.fork():
        m2 = torch.rand(3)
    g = torch.Generator().manual_seed(42 + 2718)
    assert torch.equal(torch.rand(3, generator=g), m1)
    assert torch.equal(torch.rand(3, generator=g), m2)
    other = model_parallel_manual_seed(42, tp_rank=1)
    with other.fork():
        assert not torch.equal(torch.rand(3), m1)
    t = RNGStatesTracker()
    t.add("x", 1)
    with pytest.raises(ValueError, match="seed 1 already exists"):
        t.add("y", 1)


def _mlp_block(x, fc1, fc2, tracker):
    h, _ = fc1(x)
    h = F.gelu(h)
    with tracker.fork():  # tp region: dropout from the model-parallel stream
        h = F.dropout(h, p=0.3, training=True)
    y, _ = fc2(h)
    return F.dropout(y, p=0.2, training=True)  # default stream


def recompute_case(tp, partition):
    ps = ParallelState.build(tp_size=tp)
    g = ps.tp_group
    fc1 = ColumnParallelLinear(8, 16, tp_group=g, gather_output=False, init_key=1)
    fc2 = RowParallelLinear(16, 8, tp_group=g, input_is_parallel=True, init_key=2)
    x0 = torch.randn(5, 2, 8, generator=torch.Generator().manual_seed(0))

    def run(use_checkpoint):
        tracker = model_parallel_manual_seed(7, ps.tp_rank)
        for p in (*fc1.parameters(), *fc2.parameters()):
            p.grad = None
        x = x0.clone().requires_grad_(True)
        fn = lambda t: _mlp_block(t, fc1, fc2, tracker)  # noqa: E731
        if use_checkpoint:
            y = checkpoint(fn, x, tracker=tracker, partition_group=g if partition else None)
        else:
            y = fn(x)
        y.pow(2).sum().backward()
        after = torch.rand(2)  # the RNG state after forward+backward must match too
        with tracker.fork():
            after_mp = torch.rand(2)
        return y.detach(), x.grad, [p.grad.clone() for p in (*fc1.parameters(),
                                                              *fc2.parameters())], after, after_mp

    plain, ckpt = run(False), run(True)
    assert torch.equal(plain[0], ckpt[0]), "forward differs"
    assert torch.equal(plain[1], ckpt[1]), "input grad not bit-identical"
    for a, b in zip(plain[2], ckpt[2]):
        assert torch.equal(a, b), "weight grad not bit-identical"
    assert torch.equal(plain[3], ckpt[3]) and torch.equal(plain[4], ckpt[4]), "RNG state drift"
    return True


@pytest.mark.parametrize("tp,partition", [(1, False), (2, False), (2, True), (4, True)])
def test_recompute_is_bit_identical_with_dropout(tp, partition):
    assert all(run_distributed(recompute_case, tp, tp, partition))


def test_recompute_without_tracker_restores_rng():
    lin = torch.nn.Linear(4, 4)
    x0 = torch.randn(3, 4)

    def fn(t):
        return F.dropout(lin(t), 0.5, training=True)

    torch.manual_seed(3)
    x = x0.clone().requires_grad_(True)
    fn(x).sum().backward()
    g1 = x.grad.clone()
    torch.manual_seed(3)
    x = x0.clone().requires_grad_(True)
    checkpoint(fn, x).sum().backward()
    assert torch.equal(g1, x.grad)
