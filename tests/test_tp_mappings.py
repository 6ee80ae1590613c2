"""Each tensor-parallel mapping does the right collective in forward and in backward."""

import pytest
import torch

from megazero.distributed.parallel_state import ParallelState
from megazero.tensor_parallel import mappings
from tests.common import assert_close
from tests.dist_helper import run_distributed


def _per_rank(shape, rank, salt):
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * salt + rank))


def _all(shape, n, salt):
    return [_per_rank(shape, r, salt) for r in range(n)]


def mapping_cases(tp):
    ps = ParallelState.build(tp_size=tp)
    g, r, n = ps.tp_group, ps.tp_rank, tp
    shape = (4, 2, 8)  # [s, b, h]: s and h divisible by 1, 2, 4

    def run(op, x_shape, g_shape, salt):
        x = _per_rank(x_shape, r, salt).requires_grad_(True)
        y = op(x, g)
        gy = _per_rank(g_shape, r, salt + 500)
        y.backward(gy)
        xs, gys = _all(x_shape, n, salt), _all(g_shape, n, salt + 500)
        return x, y, xs, gys

    # copy: forward identity, backward all-reduce
    x, y, xs, gys = run(mappings.copy_to_tp_region, shape, shape, 1)
    assert_close(y, x.detach(), what="copy fwd")
    assert_close(x.grad, sum(gys), what="copy bwd")
    # reduce: forward all-reduce, backward identity
    x, y, xs, gys = run(mappings.reduce_from_tp_region, shape, shape, 2)
    assert_close(y, sum(xs), what="reduce fwd")
    assert_close(x.grad, gys[r], what="reduce bwd")
    # scatter (last): forward split, backward all-gather
    x_full = _per_rank(shape, 0, 3).requires_grad_(True)  # same on all ranks
    y = mappings.scatter_to_tp_region(x_full, g)
    assert_close(y, x_full.detach().chunk(n, -1)[r], what="scatter fwd")
    gys = _all((4, 2, 8 // n), n, 4)
    y.backward(gys[r])
    assert_close(x_full.grad, torch.cat(gys, -1), what="scatter bwd")
    # gather (last): forward all-gather, backward split
    x, y, xs, gys = run(mappings.gather_from_tp_region, (4, 2, 8 // n), shape, 5)
    assert_close(y, torch.cat(xs, -1), what="gather fwd")
    assert_close(x.grad, gys[r].chunk(n, -1)[r], what="gather bwd")
    # sequence-parallel scatter (first): forward split, backward all-gather
    x_full = _per_rank(shape, 0, 6).requires_grad_(True)
    y = mappings.scatter_to_sequence_parallel_region(x_full, g)
    assert_close(y, x_full.detach().chunk(n, 0)[r], what="sp scatter fwd")
    gys = _all((4 // n, 2, 8), n, 7)
    y.backward(gys[r])
    assert_close(x_full.grad, torch.cat(gys, 0), what="sp scatter bwd")
    # sequence-parallel gather: forward all-gather, backward reduce-scatter
    x, y, xs, gys = run(mappings.gather_from_sequence_parallel_region, (4 // n, 2, 8), shape, 8)
    assert_close(y, torch.cat(xs, 0), what="sp gather fwd")
    assert_close(x.grad, sum(gys).chunk(n, 0)[r], what="sp gather bwd")
    # sequence-parallel gather without tp output grad: backward split only
    x = _per_rank((4 // n, 2, 8), r, 9).requires_grad_(True)
    y = mappings.gather_from_sequence_parallel_region(x, g, tensor_parallel_output_grad=False)
    gy = _per_rank(shape, 0, 10)  # complete gradient, same on all ranks
    y.backward(gy)
    assert_close(x.grad, gy.chunk(n, 0)[r], what="sp gather (split) bwd")
    # reduce-scatter: forward reduce-scatter, backward all-gather
    x, y, xs, gys = run(mappings.reduce_scatter_to_sequence_parallel_region, shape,
                        (4 // n, 2, 8), 11)
    assert_close(y, sum(xs).chunk(n, 0)[r], what="reduce-scatter fwd")
    assert_close(x.grad, torch.cat(gys, 0), what="reduce-scatter bwd")
    return True


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_mappings(tp):
    assert all(run_distributed(mapping_cases, tp, tp))


def test_copy_backward_does_not_corrupt_aliased_grad():
    assert all(run_distributed(case_copy_alias, 2))


def case_copy_alias():
    ps = ParallelState.build(tp_size=2)
    a = torch.ones(3, requires_grad=True)
    x = torch.ones(3, requires_grad=True)
    (a + mappings.copy_to_tp_region(x, ps.tp_group)).backward(torch.full((3,), 2.0))
    assert torch.equal(a.grad, torch.full((3,), 2.0)), a.grad
    assert torch.equal(x.grad, torch.full((3,), 4.0)), x.grad
    return True
