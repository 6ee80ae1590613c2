"""megazero's Adam step with multi-tensor ops (the GPU's path, ops/foreach_adam.py) against the
per-tensor PyTorch reference it replaces, bit for bit: fp32 and bf16 gradients, AdamW and L2,
weight decay per tensor, model-dtype copies, batches split by size, empty tensors, and
non-finite gradients (masked elementwise, as the reference does). On CPU here; the same checks
on a GPU are in tests/test_ops_cuda.py."""

import pytest
import torch

from megazero.ops.cpu_adam import adam_update_reference_
from megazero.ops.foreach_adam import _batches, adam_update_foreach_

SIZES = [1000, 0, 7, 4096, 1, 3 * 1024 + 5, 64]


def _state(gen, sizes, grad_dtype, device="cpu"):
    def r(n, scale=1.0):
        return (scale * torch.randn(n, generator=gen)).to(device)

    p = [r(n) for n in sizes]
    g = [r(n, 0.1).to(grad_dtype) for n in sizes]
    m = [r(n, 0.01) for n in sizes]
    v = [r(n, 0.01).abs() for n in sizes]
    return p, g, m, v


def _clone(lists):
    return [[t.clone() for t in lst] for lst in lists]


def _reference_with_copies(p, g, m, v, copies, **kw):
    found = adam_update_reference_(p, g, m, v, mask_nonfinite=True, **kw)
    for c, t in zip(copies, p):
        if c is not None:
            c.copy_(t)
    return found


def _bits(t):
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def _assert_identical(a_lists, b_lists):
    for a_list, b_list in zip(a_lists, b_lists):
        for a, b in zip(a_list, b_list):
            assert (a is None) == (b is None)
            if a is not None:
                assert a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("batch_numel", [1 << 26, 2000])
def test_foreach_step_equals_the_reference_bit_for_bit(gen, grad_dtype, adam_w_mode,
                                                       batch_numel):
    p, g, m, v = _state(gen, SIZES, grad_dtype)
    wds = [0.1, 0.0, 0.1, 0.0, 0.05, 0.1, 0.0]
    copies = [torch.empty(n, dtype=torch.bfloat16) if i % 3 else None
              for i, n in enumerate(SIZES)]
    ours, ref = _clone([p, m, v]), _clone([p, m, v])
    ours_copies = [None if c is None else c.clone() for c in copies]
    ref_copies = [None if c is None else c.clone() for c in copies]
    for step in (1, 2, 3):
        kw = dict(step=step, lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=wds,
                  adam_w_mode=adam_w_mode, bias_correction=True, grad_scale=0.37)
        assert not adam_update_foreach_(ours[0], g, ours[1], ours[2], copies=ours_copies,
                                        batch_numel=batch_numel, **kw)
        assert not _reference_with_copies(ref[0], g, ref[1], ref[2], ref_copies, **kw)
    _assert_identical([ours[0], ours[1], ours[2], ours_copies], [*ref, ref_copies])
    # and it moved: the step did something
    assert not torch.equal(ours[0][0], p[0])


def test_non_finite_gradients_are_masked_like_the_reference(gen):
    p, g, m, v = _state(gen, SIZES, torch.float32)
    g[0][3] = float("nan")
    g[5][0] = float("inf")
    ours, ref = _clone([p, m, v]), _clone([p, m, v])
    kw = dict(step=4, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
              adam_w_mode=True, bias_correction=True, grad_scale=1.0)
    assert adam_update_foreach_(ours[0], g, ours[1], ours[2], batch_numel=5000, **kw)
    assert adam_update_reference_(ref[0], g, ref[1], ref[2], mask_nonfinite=True, **kw)
    _assert_identical(ours, ref)
    assert ours[0][0][3] == p[0][3] and ours[0][5][0] == p[5][0]  # left unchanged
    assert ours[0][0][4] != p[0][4]  # the finite neighbours were stepped
    # a batch without the bad values took the multi-tensor path and still matches
    assert not adam_update_foreach_(ours[0][1:5], g[1:5], ours[1][1:5], ours[2][1:5], **kw)


def test_batches_are_bounded_and_keep_order():
    assert _batches([5, 5, 5], 10) == [[0, 1], [2]]
    assert _batches([20, 1, 1], 10) == [[0], [1, 2]]  # a large tensor alone
    assert _batches([], 10) == []


def test_the_log_line_names_the_gpu_step():
    """"Using ... optimizer" says which step runs where the main values live."""
    from megazero.optim.rules import AdamRule, describe_rule

    rule = AdamRule()
    assert "multi-tensor (torch._foreach) on the GPU" in describe_rule(rule, torch.device("cuda"))
    assert "GPU" not in describe_rule(rule, torch.device("cpu"))
    assert "GPU" not in describe_rule(rule)
