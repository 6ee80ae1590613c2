"""Fused bias+GELU and bias+dropout+residual-add (megazero.ops._fused) against their PyTorch
references, at every SIMD level this CPU supports (each forced in turn).

Inputs are random tensors from a fixed, printed seed per test (tests/conftest.py), with odd
sizes and sizes that are not a multiple of any SIMD width, empty and 0-d tensors. fp32 matches the
reference to rounding; bf16 (computed in fp32, rounded once) matches the fp32 reference on
the same inputs within bf16 precision. Gradients are compared with the reference's autograd.
Dropout masks are a pure function of (seed, index): the kernel's masks equal the PyTorch
reference's exactly, come from the RNG tracker's stream, and replay under recompute.
"""

import pytest
import torch
import torch.nn.functional as F

from megazero.ops import _loader
from megazero.ops import fused_common as fc
from megazero.ops.fused_bias_gelu import bias_gelu_reference, fused_bias_gelu
from megazero.ops.fused_dropout import (
    bias_dropout_add_reference,
    dropout_hash,
    dropout_keep_mask,
    dropout_params,
    fused_bias_dropout_add,
)
from megazero.tensor_parallel.random import RNGStatesTracker, checkpoint

LEVELS = fc.supported_simd_levels()
needs_ext = pytest.mark.skipif(not LEVELS, reason="megazero.ops._fused is not built")
# (33, 1031) has > 16384 elements, so the kernels start two threads under two_threads()
SHAPES = [(1, 1), (3, 7), (5, 17), (2, 3, 33), (4, 100), (33, 1031)]
DTYPES = [torch.float32, torch.bfloat16]
pytestmark = pytest.mark.usefixtures("fused_kernels_at_any_size")


def leaf(t):
    return t.detach().clone().requires_grad_(True)


def rnd(gen, shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def check(actual, expected, dtype, what, scale=1.0):
    """fp32: rounding-level agreement; bf16: within bf16 precision of the fp32 reference."""
    tol = 2e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol * scale,
                               msg=lambda m: f"{what}: {m}")


# ----------------------------------------------------------------------------- bias + GELU
@needs_ext
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_bias_gelu_matches_reference(gen, level, dtype, shape, torch_threads):
    x, b, dy = rnd(gen, shape, dtype, 2.0), rnd(gen, shape[-1:], dtype), rnd(gen, shape, dtype)
    with fc.forced_simd_level(level), torch_threads(2):
        xf, bf = leaf(x), leaf(b)
        y = fused_bias_gelu(xf, bf)
        y.backward(dy)
    xr, br = leaf(x.float()), leaf(b.float())
    ref = bias_gelu_reference(xr, br)
    ref.backward(dy.float())
    assert y.dtype == dtype and y.shape == x.shape
    check(y, ref, dtype, "y")
    check(xf.grad, xr.grad, dtype, "dx")
    check(bf.grad, br.grad, dtype, "dbias", scale=max(1.0, br.grad.abs().max().item()))


@needs_ext
@pytest.mark.parametrize("level", LEVELS)
def test_bias_gelu_extremes_and_no_bias(gen, level):
    x = torch.linspace(-30, 30, 997).reshape(1, 997)  # exp() clamps, sigmoid saturates
    with fc.forced_simd_level(level):
        xf = leaf(x)
        y = fused_bias_gelu(xf, None)
        y.sum().backward()
    xr = leaf(x)
    ref = bias_gelu_reference(xr, None)
    ref.sum().backward()
    check(y, ref, torch.float32, "y")
    check(xf.grad, xr.grad, torch.float32, "dx")


def test_bias_gelu_empty_and_0d(gen):
    for shape in [(0, 5), (4, 0), (2, 0, 3)]:
        x, b = leaf(torch.zeros(shape)), leaf(torch.zeros(shape[-1:]))
        y = fused_bias_gelu(x, b)
        y.sum().backward()
        assert y.shape == shape and x.grad.shape == shape
        assert torch.equal(b.grad, torch.zeros(shape[-1:]))
    x, b = leaf(torch.tensor(0.7)), leaf(torch.tensor(-0.2))
    y = fused_bias_gelu(x, b)
    y.backward()
    check(y, bias_gelu_reference(torch.tensor(0.7), torch.tensor(-0.2)), torch.float32, "0-d")


@needs_ext
def test_small_tensors_take_eager_gelu_and_large_the_kernel(gen, monkeypatch):
    from megazero.ops.fused_bias_gelu import MIN_NUMEL

    monkeypatch.setattr(fc, "_force_kernels", False)  # the ops' own size rule
    small = fused_bias_gelu(leaf(rnd(gen, (4, 16))), leaf(rnd(gen, (16,))))
    big = fused_bias_gelu(leaf(rnd(gen, (MIN_NUMEL // 64, 64))), leaf(rnd(gen, (64,))))
    assert "Gelu" in type(small.grad_fn).__name__ and "Fused" not in type(small.grad_fn).__name__
    assert "FusedBiasGelu" in type(big.grad_fn).__name__


def test_bias_gelu_fallback_when_disabled(gen, ops_disabled):
    x, b = rnd(gen, (5, 19)), rnd(gen, (19,))
    with ops_disabled("fused"):
        assert fc.cpu_extension() is None
        y = fused_bias_gelu(x, b)
        assert _loader.status()["fused"]["reason"].startswith("disabled")
    check(y, bias_gelu_reference(x, b), torch.float32, "fallback")


# ------------------------------------------------------------- bias + dropout + residual add
@needs_ext
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_mask_equals_reference_exactly(gen, level, dtype, p, torch_threads):
    shape = (37, 3, 501)  # rows x cols not a multiple of any vector width, > 16384 elements
    x, bias, res = torch.ones(shape, dtype=dtype), torch.zeros(501, dtype=dtype), torch.zeros(
        shape, dtype=dtype)
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    torch.manual_seed(seed)
    with fc.forced_simd_level(level), torch_threads(2):
        out = fused_bias_dropout_add(x, bias, res, p, True)
    torch.manual_seed(seed)
    ref = bias_dropout_add_reference(x, bias, res, p, True)
    assert torch.equal(out, ref)
    keep = out != 0
    assert 0 < keep.sum() < keep.numel()


@needs_ext
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_bias_dropout_add_matches_reference(gen, level, dtype, shape, torch_threads):
    x, b, r = rnd(gen, shape, dtype), rnd(gen, shape[-1:], dtype), rnd(gen, shape, dtype)
    dy = rnd(gen, shape, dtype)
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    torch.manual_seed(seed)
    with fc.forced_simd_level(level), torch_threads(2):
        xf, bf, rf = leaf(x), leaf(b), leaf(r)
        out = fused_bias_dropout_add(xf, bf, rf, 0.3, True)
        out.backward(dy)
    torch.manual_seed(seed)
    xr, br, rr = leaf(x.float()), leaf(b.float()), leaf(r.float())
    ref = bias_dropout_add_reference(xr, br, rr, 0.3, True)
    ref.backward(dy.float())
    check(out, ref, dtype, "out", scale=2.0)
    check(xf.grad, xr.grad, dtype, "dx", scale=2.0)
    check(rf.grad, rr.grad, dtype, "dresidual")
    check(bf.grad, br.grad, dtype, "dbias", scale=max(1.0, br.grad.abs().max().item()))


@needs_ext
@pytest.mark.parametrize("level", LEVELS)
def test_dropout_index_crosses_2_to_the_32(gen, level):
    """The 64-bit element index's high word keys the hash (checked with an index offset)."""
    ext = fc.cpu_extension()
    rows, cols, offset = 4, 25, 2**32 - 37
    x, out = torch.ones(rows, cols), torch.empty(rows, cols)
    zeros = torch.zeros(rows, cols)
    seed, (threshold, scale) = 987654321987, dropout_params(0.5)
    with fc.forced_simd_level(level):
        ext.bias_dropout_add_fwd(x.data_ptr(), 0, zeros.data_ptr(), out.data_ptr(), rows, cols,
                                 seed, threshold, scale, True, 0, 1, offset=offset)
    keep = dropout_hash(seed, rows * cols, offset=offset) >= threshold
    assert torch.equal(out.flatten() != 0, keep)
    # the same indices without the offset give a different mask
    assert not torch.equal(keep, dropout_hash(seed, rows * cols) >= threshold)


def test_dropout_mask_statistics(gen):
    p, n = 0.3, 1 << 20
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    keep = dropout_keep_mask(seed, (n,), p).float()
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(keep.mean().item() - (1 - p)) < 5 * sigma
    # neighbours and other seeds independent: agreement rate p^2 + (1-p)^2
    agree = p * p + (1 - p) ** 2
    assert abs((keep[1:] == keep[:-1]).float().mean().item() - agree) < 5 * sigma * 2
    other = dropout_keep_mask(seed + 1, (n,), p).float()
    assert abs((keep == other).float().mean().item() - agree) < 5 * sigma * 2
    # columns of a [rows, 1024] view keep at the same rate (no stripes)
    cols = keep.view(-1, 1024).mean(0)
    assert cols.min() > 1 - p - 0.1 and cols.max() < 1 - p + 0.1


@pytest.mark.parametrize("dtype", DTYPES)
def test_eval_or_p0_is_exact_residual_add(gen, dtype):
    x, b, r = rnd(gen, (7, 3, 45), dtype), rnd(gen, (45,), dtype), rnd(gen, (7, 3, 45), dtype)
    exact = r + (x + b)
    for p, training in [(0.5, False), (0.0, True)]:
        out = fused_bias_dropout_add(x, b, r, p, training)
        if dtype == torch.float32:
            assert torch.equal(out, exact)
        else:  # one rounding instead of two
            check(out, r.float() + x.float() + b.float(), dtype, "eval")
    xf, bf, rf = leaf(x), leaf(b), leaf(r)
    fused_bias_dropout_add(xf, bf, rf, 0.5, False).backward(torch.ones_like(x))
    assert torch.equal(xf.grad, torch.ones_like(x)) and torch.equal(rf.grad, torch.ones_like(r))
    assert torch.equal(bf.grad, torch.full((45,), 21.0, dtype=dtype))


def test_p1_drops_everything(gen):
    x, b, r = leaf(rnd(gen, (3, 11))), leaf(rnd(gen, (11,))), leaf(rnd(gen, (3, 11)))
    out = fused_bias_dropout_add(x, b, r, 1.0, True)
    assert torch.equal(out, r.detach())
    out.sum().backward()
    assert torch.equal(x.grad, torch.zeros(3, 11)) and torch.equal(b.grad, torch.zeros(11))


def test_dropout_seed_from_tracker_stream_and_recompute(gen):
    x, b, r = rnd(gen, (6, 2, 40)), rnd(gen, (40,)), rnd(gen, (6, 2, 40))
    tracker = RNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    default_before = torch.get_rng_state()
    with tracker.fork():
        in_fork = fused_bias_dropout_add(x, b, r, 0.5, True)
    assert torch.equal(torch.get_rng_state(), default_before)  # default stream untouched
    torch.manual_seed(1234)
    assert torch.equal(fused_bias_dropout_add(x, b, r, 0.5, True), in_fork)

    # recompute in backward replays the same masks: grads equal the plain run's
    def fn(x_):
        return fused_bias_dropout_add(x_, b, r, 0.5, True)

    torch.manual_seed(7)
    xa = leaf(x)
    fn(xa).backward(torch.ones_like(x))
    torch.manual_seed(7)
    xb = leaf(x)
    checkpoint(fn, xb).backward(torch.ones_like(x))
    assert torch.equal(xa.grad, xb.grad)


@needs_ext
def test_dropout_keeps_no_mask_tensor(gen):
    x, b, r = leaf(rnd(gen, (4, 64))), leaf(rnd(gen, (64,))), leaf(rnd(gen, (4, 64)))
    out = fused_bias_dropout_add(x, b, r, 0.5, True)
    assert out.grad_fn.saved_tensors == ()


def test_bias_dropout_add_none_bias_empty_and_0d(gen):
    x, r = rnd(gen, (3, 17)), rnd(gen, (3, 17))
    torch.manual_seed(3)
    out = fused_bias_dropout_add(x, None, r, 0.2, True)
    torch.manual_seed(3)
    check(out, bias_dropout_add_reference(x, None, r, 0.2, True), torch.float32, "no bias")
    for shape in [(0, 5), (4, 0)]:
        xe, be, re_ = leaf(torch.zeros(shape)), leaf(torch.zeros(shape[-1:])), leaf(
            torch.zeros(shape))
        out = fused_bias_dropout_add(xe, be, re_, 0.1, True)
        out.sum().backward()
        assert out.shape == shape and torch.equal(be.grad, torch.zeros(shape[-1:]))
    x0, r0 = torch.tensor(2.0), torch.tensor(1.0)
    out = fused_bias_dropout_add(x0, None, r0, 0.0, True)
    assert out.item() == 3.0


def test_dropout_fallback_same_masks_as_kernel(gen, ops_disabled):
    x, b, r = rnd(gen, (9, 77)), rnd(gen, (77,)), rnd(gen, (9, 77))
    torch.manual_seed(11)
    fused = fused_bias_dropout_add(x, b, r, 0.4, True)
    with ops_disabled("fused"):
        assert fc.cpu_extension() is None
        torch.manual_seed(11)
        fallback = fused_bias_dropout_add(x, b, r, 0.4, True)
    check(fallback, fused, torch.float32, "fallback vs kernel")
    assert torch.equal(fallback != r, fused != r)


def test_cuda_tensors_take_eager_dropout():
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    x = torch.randn(4, 8, device="cuda")
    out = fused_bias_dropout_add(x, None, torch.zeros_like(x), 0.0, True)
    assert torch.equal(out, F.dropout(x, 0.0))
