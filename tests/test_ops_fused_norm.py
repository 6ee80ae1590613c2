"""Fused LayerNorm and scaled upper-triangular masked softmax (megazero.ops._fused) against
their PyTorch references, at every SIMD level this CPU supports (each forced in turn).

Seeded random inputs (fixed seed per test, printed), odd sizes, sizes off the SIMD width,
empty tensors; fp32 to rounding, bf16 (and bf16 activations with fp32 LayerNorm parameters)
within bf16 precision of the fp32 reference; gradients against the reference's autograd;
the PyTorch path when the extension is disabled.
"""

import pytest
import torch
import torch.nn.functional as F

from megazero.ops import fused_common as fc
from megazero.ops.fused_layer_norm import FusedLayerNorm, fused_layer_norm, layer_norm_reference
from megazero.ops.fused_softmax import (
    scaled_upper_triang_masked_softmax,
    softmax_eager,
    softmax_reference,
)

LEVELS = fc.supported_simd_levels()
needs_ext = pytest.mark.skipif(not LEVELS, reason="megazero.ops._fused is not built")
F32, BF16 = torch.float32, torch.bfloat16
pytestmark = pytest.mark.usefixtures("fused_kernels_at_any_size")


def leaf(t):
    return None if t is None else t.detach().clone().requires_grad_(True)


def rnd(gen, shape, dtype=F32, scale=1.0, shift=0.0):
    return (torch.randn(shape, generator=gen) * scale + shift).to(dtype)


def check(actual, expected, dtype, what):
    """Max error relative to the reference's magnitude: fp32 rounding, or bf16 precision."""
    tol = 2e-5 if dtype == F32 else 1.6e-2
    scale = max(1.0, expected.float().abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol * scale,
                               msg=lambda m: f"{what}: {m}")


# ------------------------------------------------------------------------------ LayerNorm
LN_SHAPES = [(1, 1), (3, 7), (5, 17), (2, 3, 33), (9, 768), (33, 1031)]
LN_DTYPES = [(F32, F32), (BF16, BF16), (BF16, F32)]  # (activations, parameters)


def _ln_case(gen, shape, xdt, wdt):
    h = shape[-1]
    x = rnd(gen, shape, xdt, scale=2.0, shift=0.5)
    w, b = rnd(gen, (h,), wdt, shift=1.0), rnd(gen, (h,), wdt)
    return x, w, b, rnd(gen, shape, xdt)


def _ln_reference_grads(x, w, b, dy, eps=1e-5, dtype=F32):
    """Reference output and grads, computed in ``dtype`` (fp32, or fp64 for tight checks)."""
    up = lambda t: None if t is None else leaf(t.to(dtype))
    xr, wr, br = up(x), up(w), up(b)
    mean = xr.mean(-1, keepdim=True)
    y = (xr - mean) * torch.rsqrt((xr - mean).pow(2).mean(-1, keepdim=True) + eps)
    y = y if wr is None else y * wr
    y = y if br is None else y + br
    y.backward(dy.to(dtype))
    return y, xr.grad, None if wr is None else wr.grad, None if br is None else br.grad


@needs_ext
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtypes", LN_DTYPES, ids=["fp32", "bf16", "bf16-fp32params"])
@pytest.mark.parametrize("shape", LN_SHAPES)
def test_layer_norm_matches_reference(gen, level, dtypes, shape, torch_threads):
    xdt, wdt = dtypes
    x, w, b, dy = _ln_case(gen, shape, xdt, wdt)
    with fc.forced_simd_level(level), torch_threads(2):
        xf, wf, bf = leaf(x), leaf(w), leaf(b)
        y = fused_layer_norm(xf, wf, bf, 1e-5)
        y.backward(dy)
    assert y.dtype == xdt and xf.grad.dtype == xdt and wf.grad.dtype == wdt
    ref, dx, dw, db = _ln_reference_grads(x, w, b, dy)
    check(y, ref, xdt, "y")
    check(xf.grad, dx, xdt, "dx")
    check(wf.grad, dw, wdt if xdt == F32 else BF16, "dweight")
    check(bf.grad, db, wdt if xdt == F32 else BF16, "dbias")
    if dtypes == (F32, F32):
        check(y, F.layer_norm(x, x.shape[-1:], w, b, 1e-5), F32, "vs F.layer_norm")
    check(layer_norm_reference(x, w, b), ref, xdt, "layer_norm_reference")


@needs_ext
@pytest.mark.parametrize("level", LEVELS)
def test_layer_norm_without_affine_and_large_mean(gen, level):
    x = rnd(gen, (6, 333), shift=1000.0)  # two-pass variance: no cancellation
    dy = rnd(gen, (6, 333))
    with fc.forced_simd_level(level):
        xf = leaf(x)
        y = fused_layer_norm(xf, None, None, 1e-5)
        y.backward(dy)
    ref, dx, _, _ = _ln_reference_grads(x, None, None, dy, dtype=torch.float64)
    torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(xf.grad.double(), dx, rtol=1e-3, atol=1e-3)


def test_fused_layer_norm_module_and_fallback(gen, ops_disabled):
    ln = FusedLayerNorm(45, eps=1e-6)
    with torch.no_grad():
        ln.weight.copy_(rnd(gen, (45,)))
        ln.bias.copy_(rnd(gen, (45,)))
    ref = torch.nn.LayerNorm(45, eps=1e-6)
    ref.load_state_dict(ln.state_dict())
    x = rnd(gen, (4, 3, 45))
    check(ln(x), ref(x), F32, "module")
    with ops_disabled("fused"):
        assert fc.cpu_extension() is None
        assert torch.equal(ln(x), F.layer_norm(x, (45,), ln.weight, ln.bias, 1e-6))
    assert "45, eps=1e-06" in repr(ln)


def test_layer_norm_empty_rows(gen):
    x, w, b = leaf(torch.zeros(0, 8)), leaf(torch.ones(8)), leaf(torch.zeros(8))
    y = fused_layer_norm(x, w, b)
    y.sum().backward()
    assert y.shape == (0, 8) and torch.equal(w.grad, torch.zeros(8))


# ---------------------------------------------------------------- causal (upper-tri) softmax
SM_SHAPES = [(1, 1, 1), (3, 5, 5), (2, 17, 17), (4, 33, 33), (2, 3, 9, 9), (6, 100, 100)]


@needs_ext
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("shape", SM_SHAPES)
@pytest.mark.parametrize("scale", [0.125, 1.0])
def test_causal_softmax_matches_reference(gen, level, dtype, shape, scale, torch_threads):
    s, dy = rnd(gen, shape, dtype, scale=4.0), rnd(gen, shape, dtype)
    with fc.forced_simd_level(level), torch_threads(2):
        sf = leaf(s)
        y = scaled_upper_triang_masked_softmax(sf, scale)
        y.backward(dy)
    sr = leaf(s.float())
    ref = softmax_eager(sr, scale)
    ref.backward(dy.float())
    assert y.dtype == dtype and y.shape == s.shape
    check(y, ref, dtype, "probs")
    check(sf.grad, sr.grad, dtype, "dscores")
    upper = torch.ones(shape[-2:], dtype=torch.bool).triu(1).expand(shape)
    assert torch.equal(y[upper], torch.zeros_like(y[upper]))  # masked: exact zeros
    assert torch.equal(sf.grad[upper], torch.zeros_like(sf.grad[upper]))


def test_causal_softmax_checks_and_fallback(gen, ops_disabled):
    with pytest.raises(ValueError, match="sq == sk"):
        scaled_upper_triang_masked_softmax(torch.zeros(2, 3, 4), 1.0)
    empty = scaled_upper_triang_masked_softmax(torch.zeros(0, 4, 4), 1.0)
    assert empty.shape == (0, 4, 4)
    s = rnd(gen, (3, 21, 21), scale=3.0)
    with ops_disabled("fused"):
        assert torch.equal(scaled_upper_triang_masked_softmax(s, 0.5), softmax_eager(s, 0.5))
    check(softmax_reference(s.to(BF16), 0.5), softmax_eager(s, 0.5), BF16, "bf16 reference")
