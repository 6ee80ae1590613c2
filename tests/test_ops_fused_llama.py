"""Fused RMSNorm, bias + SwiGLU and RoPE (megazero.ops._fused) against their PyTorch references,
at every SIMD level this CPU supports (each forced in turn).

Seeded random inputs (fixed seed per test, printed), sizes off every SIMD width (h, f and
rot / 2 odd), SwiGLU without bias, RoPE with rot < hn, cos/sin broadcast over the batch and t
a permuted (and a non-dense) view. fp32 matches the reference evaluated in float64 to ~1e-6 of
the result's magnitude; bf16 (fp32 inside, rounded once) the fp32 reference within bf16
precision. Every input gradient is compared with the reference's autograd. The kernel path is
checked to have run (its autograd node), and the reference path to run, and agree, when the
extension is disabled, below the size threshold and on inputs the kernel does not take.
"""

import pytest
import torch

from megazero.ops import fused_common as fc
from megazero.ops import registry
from megazero.ops.fused_rms_norm import fused_rms_norm, rms_norm_reference
from megazero.ops.fused_rope import fused_rope, rope_reference
from megazero.ops.fused_swiglu import fused_bias_swiglu, swiglu_reference

LEVELS = fc.supported_simd_levels()
needs_ext = pytest.mark.skipif(not LEVELS, reason="megazero.ops._fused is not built")
F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
pytestmark = pytest.mark.usefixtures("fused_kernels_at_any_size")


def leaf(t):
    return None if t is None else t.detach().clone().requires_grad_(True)


def rnd(gen, shape, dtype=F32, scale=1.0, shift=0.0):
    return (torch.randn(shape, generator=gen) * scale + shift).to(dtype)


def check(actual, expected, dtype, what):
    """Max error relative to the reference's magnitude: ~1e-6 for fp32, bf16 precision."""
    tol = 1e-6 if dtype == F32 else 1.6e-2
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(actual.to(expected.dtype), expected, rtol=tol, atol=tol * scale,
                               msg=lambda m: f"{what}: {m}")


def reference_run(fn, inputs, dout, dtype):
    """fn on inputs cast to ``dtype`` (fp64 for fp32 checks, fp32 for bf16 ones): output and
    the gradients of the inputs that are tensors."""
    ref_dtype = F64 if dtype == F32 else F32
    leaves = [leaf(t.to(ref_dtype)) if torch.is_tensor(t) else t for t in inputs]
    out = fn(*leaves)
    out.backward(dout.to(ref_dtype))
    return out, [t.grad if torch.is_tensor(t) else None for t in leaves]


def fused_run(fn, inputs, dout, level, torch_threads):
    leaves = [leaf(t) if torch.is_tensor(t) else t for t in inputs]
    with fc.forced_simd_level(level), torch_threads(2):
        out = fn(*leaves)
        out.backward(dout)
    return out, [t.grad if torch.is_tensor(t) else None for t in leaves]


def node(t) -> str:
    return type(t.grad_fn).__name__


# -------------------------------------------------------------------------------- RMSNorm
RMS_SHAPES = [(1, 1), (3, 7), (5, 17), (2, 3, 33), (9, 768), (33, 1031)]


@needs_ext
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("shape", RMS_SHAPES)
def test_rms_norm_matches_reference(gen, level, dtype, shape, torch_threads):
    h = shape[-1]
    x, w = rnd(gen, shape, dtype, scale=2.0, shift=0.3), rnd(gen, (h,), dtype, shift=1.0)
    dy = rnd(gen, shape, dtype)
    y, (dx, dw, _) = fused_run(fused_rms_norm, (x, w, 1e-5), dy, level, torch_threads)
    assert "FusedRMSNorm" in node(y)  # the kernel ran
    ref, (rdx, rdw, _) = reference_run(rms_norm_reference, (x, w, 1e-5), dy, dtype)
    assert y.dtype == dtype and y.shape == x.shape and dw.dtype == dtype
    check(y, ref, dtype, "y")
    check(dx, rdx, dtype, "dx")
    check(dw, rdw, dtype, "dweight")


@needs_ext
def test_rms_norm_frozen_weight_and_paths(gen, ops_disabled, monkeypatch):
    x, w = rnd(gen, (6, 40)), rnd(gen, (40,))
    xf = leaf(x)
    fused_rms_norm(xf, w, 1e-6).sum().backward()  # weight without grad: dx only
    xr = leaf(x)
    rms_norm_reference(xr.double(), w.double(), 1e-6).sum().backward()
    check(xf.grad, xr.grad.double(), F32, "dx, frozen weight")
    # bf16 activations with an fp32 weight: the reference's promotion, not the kernel
    mixed = fused_rms_norm(leaf(x.to(BF16)), w, 1e-6)
    assert mixed.dtype == F32 and "FusedRMSNorm" not in node(mixed)
    with ops_disabled("fused"):
        assert fc.cpu_extension() is None
        off = fused_rms_norm(leaf(x), leaf(w), 1e-6)
    assert "FusedRMSNorm" not in node(off)
    assert torch.equal(off, rms_norm_reference(x, w, 1e-6))
    from megazero.ops.fused_rms_norm import MIN_NUMEL

    monkeypatch.setattr(fc, "_force_kernels", False)  # the op's own size rule
    small = fused_rms_norm(leaf(x), leaf(w), 1e-6)
    big = fused_rms_norm(leaf(rnd(gen, (MIN_NUMEL // 64, 64))), leaf(rnd(gen, (64,))), 1e-6)
    assert "FusedRMSNorm" not in node(small) and "FusedRMSNorm" in node(big)


# ------------------------------------------------------------------------- bias + SwiGLU
SWIGLU_SHAPES = [(1, 2), (3, 14), (5, 34), (2, 3, 66), (4, 200), (33, 2062)]  # [..., 2f]


@needs_ext
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("shape", SWIGLU_SHAPES)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_swiglu_matches_reference(gen, level, dtype, shape, with_bias, torch_threads):
    y = rnd(gen, shape, dtype, scale=3.0)
    bias = rnd(gen, shape[-1:], dtype) if with_bias else None
    dout = rnd(gen, shape[:-1] + (shape[-1] // 2,), dtype)
    out, (dy, db) = fused_run(fused_bias_swiglu, (y, bias), dout, level, torch_threads)
    assert "FusedBiasSwiGLU" in node(out)
    ref, (rdy, rdb) = reference_run(
        lambda y, b: swiglu_reference(y if b is None else y + b), (y, bias), dout, dtype)
    assert out.dtype == dtype and out.shape == dout.shape
    check(out, ref, dtype, "out")
    check(dy, rdy, dtype, "dy")
    if with_bias:
        check(db, rdb, dtype, "dbias")


@needs_ext
@pytest.mark.parametrize("level", LEVELS)
def test_swiglu_extremes(level, torch_threads):
    y = torch.linspace(-100, 100, 2 * 997).reshape(1, -1)  # exp() clamps, sigmoid saturates
    dout = torch.ones(1, 997)
    out, (dy, _) = fused_run(fused_bias_swiglu, (y, None), dout, level, torch_threads)
    ref, (rdy,) = reference_run(swiglu_reference, (y,), dout, F32)
    assert torch.isfinite(out).all() and torch.isfinite(dy).all()
    check(out, ref, F32, "out")
    check(dy, rdy, F32, "dy")


def test_swiglu_fallbacks(gen, ops_disabled, monkeypatch):
    y, b = rnd(gen, (5, 38)), rnd(gen, (38,))
    with ops_disabled("fused"):
        out = fused_bias_swiglu(leaf(y), leaf(b))
    assert "FusedBiasSwiGLU" not in node(out)
    assert torch.equal(out, swiglu_reference(y + b))
    with pytest.raises(RuntimeError):  # an odd last dim is the reference's error, not a crash
        fused_bias_swiglu(torch.zeros(3, 5), None)
    if LEVELS:
        from megazero.ops.fused_swiglu import MIN_NUMEL

        monkeypatch.setattr(fc, "_force_kernels", False)
        assert "FusedBiasSwiGLU" not in node(fused_bias_swiglu(leaf(y), leaf(b)))
        big = fused_bias_swiglu(leaf(rnd(gen, (MIN_NUMEL // 64, 64))), None)
        assert "FusedBiasSwiGLU" in node(big)


# ---------------------------------------------------------------------------------- RoPE
# (b, heads, s, hn, rot, batch of cos/sin): rot < hn, rot / 2 odd, cos/sin broadcast (b 1)
ROPE_CASES = [(1, 1, 1, 2, 2, 1), (2, 3, 5, 8, 8, 2), (2, 3, 7, 12, 8, 1),
              (3, 2, 9, 34, 18, 3), (2, 4, 33, 64, 64, 2), (1, 5, 17, 40, 22, 1),
              (2, 4, 100, 64, 32, 1)]


def rope_inputs(gen, case, dtype, layout):
    """t [b, heads, s, hn] as a contiguous tensor, a permute of [s, b, heads, hn] (the model's
    q), or a non-dense slice of a wider tensor (its k); cos, sin [cb, 1, s, rot]."""
    b, heads, s, hn, rot, cb = case
    if layout == "contiguous":
        t = rnd(gen, (b, heads, s, hn), dtype)
    elif layout == "permuted":
        t = rnd(gen, (s, b, heads, hn), dtype).permute(1, 2, 0, 3)
    else:
        t = rnd(gen, (s, b, heads, 3, hn), dtype)[:, :, :, 1].permute(1, 2, 0, 3)
    angles = torch.rand((cb, 1, s, rot // 2), generator=gen) * 6.0
    angles = torch.cat((angles, angles * 0.5), dim=-1)  # halves differ: catches c1/c2 swaps
    return t, angles.cos().to(dtype), angles.sin().to(dtype)


@needs_ext
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("layout", ["contiguous", "permuted", "nondense"])
def test_rope_matches_reference(gen, level, dtype, case, layout, torch_threads):
    t, cos, sin = rope_inputs(gen, case, dtype, layout)
    dout = rnd(gen, t.shape, dtype)
    tf = t.detach().requires_grad_(True)  # keeps the view's strides (a clone may not)
    with fc.forced_simd_level(level), torch_threads(2):
        out = fused_rope(tf, cos, sin)
        out.backward(dout)
    assert "FusedRope" in node(out)
    ref, (rdt, _, _) = reference_run(rope_reference, (t, cos, sin), dout, dtype)
    assert out.dtype == dtype and out.shape == t.shape and tf.grad.shape == t.shape
    check(out, ref, dtype, "out")
    check(tf.grad, rdt, dtype, "dt")


@needs_ext
def test_rope_exact_in_fp32_and_strided_gradient(gen):
    """fp32: the kernel rounds each product and sum as the reference does (bitwise equal);
    a gradient that is itself a strided view is read through its strides."""
    t, cos, sin = rope_inputs(gen, (2, 3, 11, 24, 16, 1), F32, "permuted")
    tf, tr = leaf(t), leaf(t)
    out = fused_rope(tf, cos, sin)
    ref = rope_reference(tr, cos, sin)
    assert torch.equal(out, ref)
    dout = rnd(gen, (11, 2, 3, 24)).permute(1, 2, 0, 3)
    out.backward(dout)
    ref.backward(dout)
    torch.testing.assert_close(tf.grad, tr.grad, rtol=1e-6, atol=1e-6)
    tf, tr = leaf(t), leaf(t)
    fused_rope(tf, cos, sin).sum().backward()  # an expanded (stride 0) gradient
    rope_reference(tr, cos, sin).sum().backward()
    torch.testing.assert_close(tf.grad, tr.grad, rtol=1e-6, atol=1e-6)


def test_rope_reference_paths(gen, ops_disabled, monkeypatch):
    t, cos, sin = rope_inputs(gen, (2, 3, 9, 16, 8, 2), F32, "permuted")
    with ops_disabled("fused"):
        off = fused_rope(leaf(t), cos, sin)
    assert "FusedRope" not in node(off)
    assert torch.equal(off, rope_reference(t, cos, sin))
    # cos/sin that need a gradient: the reference path, which gives them one
    cg, tl = leaf(cos), leaf(t)
    out = fused_rope(tl, cg, sin)
    assert "FusedRope" not in node(out)
    out.sum().backward()
    assert cg.grad is not None and tl.grad is not None
    # inputs the kernel does not take: mixed dtypes, per-head tables, odd rot, 3-d t
    assert fused_rope(t.to(BF16), cos, sin).dtype == F32
    per_head = torch.ones(2, 3, 9, 8)
    assert torch.equal(fused_rope(t, per_head, per_head * 0), rope_reference(t, per_head,
                                                                             per_head * 0))
    odd = torch.ones(2, 1, 9, 3)
    assert fused_rope(t[..., :6], odd, odd).shape == (2, 3, 9, 6)
    if LEVELS:
        from megazero.ops.fused_rope import MIN_NUMEL

        monkeypatch.setattr(fc, "_force_kernels", False)
        assert "FusedRope" not in node(fused_rope(leaf(t), cos, sin))
        tb, cb, sb = rope_inputs(gen, (1, 4, MIN_NUMEL // 256, 64, 64, 1), F32, "permuted")
        assert "FusedRope" in node(fused_rope(leaf(tb), cb, sb))


# ---------------------------------------------------------------------------------- report
def test_ops_registered_and_built():
    registry.import_op_modules()
    specs = {spec.name: spec for spec in registry.registered_ops()}
    for name in ("rms_norm", "bias_swiglu", "rope"):
        status = registry.op_status(specs[name])
        assert status["built"] == bool(LEVELS), status
        assert status["built"] or status["reason"]
        if LEVELS:
            assert status["simd"] in LEVELS
