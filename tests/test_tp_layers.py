"""Tensor-parallel layers against the dense torch computation on the gathered weights."""

import pytest
import torch
import torch.nn.functional as F

from megazero.distributed.parallel_state import ParallelState
from megazero.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    mappings,
)
from megazero.tensor_parallel.meta import meta_of
from tests.common import assert_close, gather_along
from tests.dist_helper import run_distributed

S, B, H, OUT = 8, 3, 12, 20
KEY = 12345


def _chunk(t, dim, rank, n):
    return t.chunk(n, dim=dim)[rank]


def column_case(tp, gather_output, skip_bias_add, sequence_parallel):
    ps = ParallelState.build(tp_size=tp)
    g, r = ps.tp_group, ps.tp_rank
    layer = ColumnParallelLinear(H, OUT, tp_group=g, gather_output=gather_output,
                                 skip_bias_add=skip_bias_add, sequence_parallel=sequence_parallel,
                                 init_key=KEY)
    with torch.no_grad():
        full_b = torch.randn(OUT, generator=torch.Generator().manual_seed(7))
        layer.bias.copy_(_chunk(full_b, 0, r, tp))
    w = gather_along(layer.weight, 0, g)
    dense = ColumnParallelLinear(H, OUT, tp_group=None, init_key=KEY)
    assert_close(w, dense.weight.detach(), rtol=0, atol=0, what="layout-invariant weight")

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(S, B, H, generator=gen)
    grad_out = torch.randn(S, B, OUT, generator=gen)
    x_ref = x.clone().requires_grad_(True)
    w_ref = w.clone().requires_grad_(True)
    y_ref = F.linear(x_ref, w_ref, full_b)
    (y_ref * grad_out).sum().backward()

    inp = _chunk(x, 0, r, tp).clone() if sequence_parallel else x.clone()
    inp.requires_grad_(True)
    out, bias = layer(inp)
    if skip_bias_add:
        assert bias is layer.bias
        out = out + bias
    else:
        assert bias is None
    expected = y_ref.detach() if gather_output else _chunk(y_ref.detach(), -1, r, tp)
    assert_close(out, expected, what="column forward")
    local_grad = grad_out if gather_output else _chunk(grad_out, -1, r, tp)
    (out * local_grad).sum().backward()
    exp_xgrad = _chunk(x_ref.grad, 0, r, tp) if sequence_parallel else x_ref.grad
    assert_close(inp.grad, exp_xgrad, what="column input grad")
    assert_close(layer.weight.grad, _chunk(w_ref.grad, 0, r, tp), what="column weight grad")
    assert_close(layer.bias.grad, _chunk(grad_out.sum((0, 1)), 0, r, tp), what="column bias grad")
    return True


def row_case(tp, input_is_parallel, sequence_parallel, break_reduce=False):
    ps = ParallelState.build(tp_size=tp)
    g, r = ps.tp_group, ps.tp_rank
    if break_reduce:  # prove the comparison can fail: drop the all-reduce of partial sums
        mappings_reduce = mappings.reduce_from_tp_region
        mappings.reduce_from_tp_region = lambda x, group: x
    try:
        layer = RowParallelLinear(OUT, H, tp_group=g, input_is_parallel=input_is_parallel,
                                  sequence_parallel=sequence_parallel, init_key=KEY)
        with torch.no_grad():
            layer.bias.copy_(torch.randn(H, generator=torch.Generator().manual_seed(7)))
        w = gather_along(layer.weight, 1, g)
        assert_close(w, RowParallelLinear(OUT, H, init_key=KEY).weight.detach(), rtol=0, atol=0,
                     what="layout-invariant weight")
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(S, B, OUT, generator=gen)
        grad_out = torch.randn(S, B, H, generator=gen)
        x_ref = x.clone().requires_grad_(True)
        w_ref = w.clone().requires_grad_(True)
        b_ref = layer.bias.detach().clone().requires_grad_(True)
        y_ref = F.linear(x_ref, w_ref, b_ref)
        (y_ref * grad_out).sum().backward()

        inp = (_chunk(x, -1, r, tp) if input_is_parallel else x).clone().requires_grad_(True)
        out, bias = layer(inp)
        assert bias is None
        exp_out = _chunk(y_ref.detach(), 0, r, tp) if sequence_parallel else y_ref.detach()
        assert_close(out, exp_out, what="row forward")
        local_grad = _chunk(grad_out, 0, r, tp) if sequence_parallel else grad_out
        (out * local_grad).sum().backward()
        exp_xgrad = _chunk(x_ref.grad, -1, r, tp) if input_is_parallel else x_ref.grad
        assert_close(inp.grad, exp_xgrad, what="row input grad")
        assert_close(layer.weight.grad, _chunk(w_ref.grad, 1, r, tp), what="row weight grad")
        bgrad = layer.bias.grad.clone()
        if sequence_parallel:  # partial over this rank's sequence chunk: sum over tp
            assert meta_of(layer.bias).sequence_parallel
            torch.distributed.all_reduce(bgrad, group=g) if tp > 1 else None
        assert_close(bgrad, b_ref.grad, what="row bias grad")
    finally:
        if break_reduce:
            mappings.reduce_from_tp_region = mappings_reduce
    return True


def embedding_case(tp, sequence_parallel):
    V, DIV = 37, 4
    ps = ParallelState.build(tp_size=tp)
    g, r = ps.tp_group, ps.tp_rank
    emb = VocabParallelEmbedding(V, H, tp_group=g, make_vocab_size_divisible_by=DIV,
                                 sequence_parallel=sequence_parallel, init_key=KEY)
    assert emb.padded_vocab_size % (DIV * tp) == 0 and emb.padded_vocab_size >= V
    w = gather_along(emb.weight, 0, g)  # [Vp, H]
    assert torch.count_nonzero(w[V:]) == 0, "padding rows must be zero"
    ref = VocabParallelEmbedding(V, H, make_vocab_size_divisible_by=DIV, init_key=KEY)
    assert_close(w[:V], ref.weight.detach()[:V], rtol=0, atol=0, what="layout-invariant table")

    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, V, (S, B), generator=gen)
    grad_out = torch.randn(S, B, H, generator=gen)
    w_ref = w.clone().requires_grad_(True)
    y_ref = F.embedding(ids, w_ref)
    (y_ref * grad_out).sum().backward()
    out = emb(ids)
    exp = _chunk(y_ref.detach(), 0, r, tp) if sequence_parallel else y_ref.detach()
    assert_close(out, exp, what="embedding forward")
    local = _chunk(grad_out, 0, r, tp) if sequence_parallel else grad_out
    (out * local).sum().backward()
    assert_close(emb.weight.grad, _chunk(w_ref.grad, 0, r, tp), what="embedding weight grad")
    return True


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_parallel_linear(tp):
    def cases():
        return [(go, sk, sp) for go in (True, False) for sk in (False, True)
                for sp in (False, True) if not (sp and go) and not (sk and go)]
    for go, sk, sp in cases():
        run_distributed(column_case, tp, tp, go, sk, sp)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_row_parallel_linear(tp):
    for iip, sp in [(False, False), (True, False), (True, True)]:
        run_distributed(row_case, tp, tp, iip, sp)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_parallel_embedding(tp):
    for sp in (False, True):
        run_distributed(embedding_case, tp, tp, sp)


def test_broken_reduction_is_detected():
    with pytest.raises(RuntimeError, match="row forward"):
        run_distributed(row_case, 2, 2, False, False, True)


def _tp2_in_world8():
    # tp=2 inside a world of 8 (dp=4): each replica's layer must use only its own tp group.
    ps = ParallelState.build(tp_size=2)
    torch.manual_seed(100 + ps.dp_rank)  # different inputs per replica
    layer = ColumnParallelLinear(H, OUT, tp_group=ps.tp_group, gather_output=True, init_key=KEY)
    x = torch.randn(S, B, H)
    out, _ = layer(x)
    dense = F.linear(x, ColumnParallelLinear(H, OUT, init_key=KEY).weight.detach(),
                     torch.zeros(OUT))
    assert_close(out, dense, what="tp2 within world 8")
    return ps.dp_rank


def test_tp_groups_are_independent_in_world_of_8():
    assert sorted(run_distributed(_tp2_in_world8, 8)) == [0, 0, 1, 1, 2, 2, 3, 3]
