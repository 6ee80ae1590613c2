"""Vocab-parallel cross entropy equals F.cross_entropy on the full (unpadded) logits."""

import pytest
import torch
import torch.nn.functional as F

from megazero.distributed.parallel_state import ParallelState
from megazero.tensor_parallel import padded_vocab_size, vocab_parallel_cross_entropy
from tests.common import assert_close
from tests.dist_helper import run_distributed


def ce_case(tp, vocab, dtype):
    ps = ParallelState.build(tp_size=tp)
    g, r = ps.tp_group, ps.tp_rank
    vp = padded_vocab_size(vocab, 4, tp)
    gen = torch.Generator().manual_seed(11)
    s, b = 6, 3
    full = torch.randn(s, b, vp, generator=gen) * 4
    target = torch.randint(0, vocab, (s, b), generator=gen)
    target[0, 0] = vocab - 1  # last real id, next to the padding
    grad = torch.rand(s, b, generator=gen)

    ref_logits = full[..., :vocab].clone().to(dtype).float().requires_grad_(True)
    ref = F.cross_entropy(ref_logits.view(-1, vocab), target.view(-1), reduction="none")
    ref.backward(grad.view(-1))

    shard = full.chunk(tp, -1)[r].clone().to(dtype).requires_grad_(True)
    loss = vocab_parallel_cross_entropy(shard, target, g, vocab_size=vocab)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    assert_close(loss, ref.detach().view(s, b), **tol, what="ce value")
    loss.backward(grad)
    exp_grad = torch.cat([ref_logits.grad, torch.zeros(s, b, vp - vocab)], -1).chunk(tp, -1)[r]
    assert shard.grad.dtype == dtype
    assert_close(shard.grad.float(), exp_grad, **tol, what="ce grad")
    # inplace=False must leave the caller's logits untouched
    assert torch.equal(shard.detach(), full.chunk(tp, -1)[r].to(dtype))
    return True


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_parallel_cross_entropy(tp):
    for vocab in (37, 48):  # padded and exact multiple
        for dtype in (torch.float32, torch.bfloat16):
            assert all(run_distributed(ce_case, tp, tp, vocab, dtype))


def test_padding_does_not_change_the_loss():
    # Megatron's CE includes padded columns in the softmax; megazero masks them.
    logits = torch.randn(2, 2, 40)
    logits[..., 37:] = 50.0  # huge padding logits must be ignored
    target = torch.randint(0, 37, (2, 2))
    loss = vocab_parallel_cross_entropy(logits, target, None, vocab_size=37)
    ref = F.cross_entropy(logits[..., :37].reshape(-1, 37), target.view(-1), reduction="none")
    assert_close(loss, ref.view(2, 2), what="padding masked")
