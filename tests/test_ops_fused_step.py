"""Fused ZeRO optimizer step and global gradient norm against their PyTorch references.

Seeded random inputs (fixed seed per test, printed); every SIMD level forced in turn;
the fused step is bit-identical to its reference in fp32 and equals unscale + clip + AdamW +
cast composed with torch ops to 1e-6.
"""

import math

import pytest
import torch

from megazero.ops import _cpu_ext, _loader
from megazero.ops.fused_step import (
    fused_adam_step,
    fused_adam_step_reference,
    global_grad_norm_sq,
    global_grad_norm_sq_reference,
)

LEVELS = _cpu_ext.supported_simd_levels("adam") or ["none"]
needs_kernel = pytest.mark.skipif(LEVELS == ["none"], reason="megazero.ops._adam is not built")
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, adam_w_mode=True)


def partition(gen, n, gdt, copy_dtype, grad_scale=1024.0):
    """(main fp32, grad, exp_avg, exp_avg_sq, model copy) of a partition with n elements."""
    main = torch.randn(n, generator=gen)
    grad = (torch.randn(n, generator=gen) * grad_scale).to(gdt)
    m = torch.randn(n, generator=gen) * 0.1
    v = (torch.randn(n, generator=gen) * 0.1).square()
    copy = None if copy_dtype is None else torch.zeros(n, dtype=copy_dtype)
    return [main, grad, m, v, copy]


def clone(parts):
    return [None if t is None else t.clone() for t in parts]


def assert_same(a, b, what):
    for x, y in zip(a, b):
        if x is not None:  # bitwise, NaN == NaN
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True, msg=what)


def segments_for(n):
    """Weights with decay, biases without, a gap (padding) left untouched."""
    cut = [0, n // 5, n // 5 + 3, n // 2, n - 7]
    return [(cut[0], cut[1], 0.1), (cut[1], cut[2], 0.0), (cut[2], cut[3], 0.1),
            (cut[3] + 2, cut[4], 0.0)]


def test_grad_norm_sq_matches_reference(gen):
    grads = [torch.randn(s, generator=gen).to(dt) for s, dt in
             [((), torch.float32), ((0,), torch.float32), ((17,), torch.bfloat16),
              ((3, 5, 7), torch.float16), ((70_001,), torch.float32), ((33,), torch.bfloat16)]]
    got, want = global_grad_norm_sq(grads), global_grad_norm_sq_reference(grads)
    assert got == pytest.approx(want, rel=1e-12)
    assert global_grad_norm_sq([]) == 0.0


@needs_kernel
def test_grad_norm_sq_identical_across_levels_and_threads(gen, torch_threads):
    grads = [torch.randn(200_003, generator=gen), torch.randn(999, generator=gen).bfloat16()]
    results = set()
    for threads in (1, 2):
        for level in LEVELS:
            with torch_threads(threads), _cpu_ext.forced_simd(level):
                results.add(global_grad_norm_sq(grads))
    assert len(results) == 1
    assert results.pop() == pytest.approx(global_grad_norm_sq_reference(grads), rel=1e-12)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_grad_norm_sq_reports_nonfinite(bad, gen):
    g = torch.randn(1000, generator=gen)
    g[611] = bad
    got = global_grad_norm_sq([torch.ones(5), g])
    assert not math.isfinite(got)
    assert math.isnan(got) == math.isnan(global_grad_norm_sq_reference([g]))


@needs_kernel
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("stream", [False, True], ids=["cached", "streamed"])
def test_fused_step_matches_reference_bitwise(level, stream, gen):
    ext = _cpu_ext.get_extension("adam")
    previous = ext.set_stream_min_bytes(0 if stream else 1 << 62)  # non-temporal copy stores
    try:
        for gdt in (torch.float32, torch.bfloat16, torch.float16):
            for copy_dtype in (None, torch.bfloat16, torch.float16):
                for n in (0, 1, 31, 4099):
                    parts = partition(gen, n, gdt, copy_dtype)
                    a, b = clone(parts), clone(parts)
                    wd = segments_for(n) if n > 50 else 0.1
                    kw = dict(HYPER, step=5, weight_decay=wd, grad_scale=0.5 / 1024,
                              adam_w_mode=gdt != torch.float16)  # fp16 grads: the L2 mode
                    with _cpu_ext.forced_simd(level):
                        found = fused_adam_step(*a[:4], model_param_out=a[4], **kw)
                    found_ref = fused_adam_step_reference(*b[:4], model_param_out=b[4], **kw)
                    assert found is found_ref is False
                    assert_same(a, b, f"{level} grad {gdt} copy {copy_dtype} n={n}")
                    if n > 50:  # the gap between segments is untouched
                        s0, s1 = segments_for(n)[2][1], segments_for(n)[3][0]
                        assert torch.equal(a[0][s0:s1], parts[0][s0:s1])
    finally:
        ext.set_stream_min_bytes(previous)


@needs_kernel
@pytest.mark.parametrize("level", LEVELS)
def test_fused_step_masks_nonfinite_grads(level, gen):
    parts = partition(gen, 1000, torch.bfloat16, torch.bfloat16)
    parts[1][[3, 500, 999]] = torch.tensor([float("inf"), float("nan"), float("-inf")],
                                           dtype=torch.bfloat16)
    a, b = clone(parts), clone(parts)
    kw = dict(step=2, weight_decay=0.01, grad_scale=1.0, **HYPER)
    with _cpu_ext.forced_simd(level):
        assert fused_adam_step(*a[:4], model_param_out=a[4], **kw) is True
    assert fused_adam_step_reference(*b[:4], model_param_out=b[4], **kw) is True
    assert_same(a, b, "masked step")
    bad = torch.zeros(1000, dtype=torch.bool)
    bad[[3, 500, 999]] = True
    for k in (0, 2, 3):
        assert torch.equal(a[k][bad], parts[k][bad])
        assert not torch.equal(a[k][~bad], parts[k][~bad])


def test_fused_step_equals_torch_composition(gen):
    """unscale + clip + AdamW (torch) + cast to bf16 == norm + one fused call."""
    n, loss_scale, max_norm = 5003, 4096.0, 1.0
    parts = partition(gen, n, torch.float32, torch.bfloat16, grad_scale=loss_scale)
    m0, v0 = parts[2].clone(), parts[3].clone()
    ref_p = parts[0].clone().requires_grad_()
    opt = torch.optim.AdamW([ref_p], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt.state[ref_p] = {"step": torch.tensor(4.0), "exp_avg": m0, "exp_avg_sq": v0}
    g = parts[1] / loss_scale
    clip = min(1.0, max_norm / (float(g.norm()) + 1e-6))
    ref_p.grad = g * clip
    opt.step()

    norm = math.sqrt(global_grad_norm_sq([parts[1]])) / loss_scale
    coef = min(1.0, max_norm / (norm + 1e-6))
    assert coef == pytest.approx(clip, rel=1e-6)
    found = fused_adam_step(*parts[:4], step=5, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8,
                            weight_decay=0.1, grad_scale=coef / loss_scale,
                            model_param_out=parts[4])
    assert not found
    want = ref_p.detach()
    assert float((parts[0] - want).abs().max() / want.abs().max()) < 1e-6
    assert torch.equal(parts[4], parts[0].bfloat16())


def test_fused_step_per_segment_calls_equal_one_call(gen):
    parts = partition(gen, 3000, torch.bfloat16, torch.bfloat16)
    a, b = clone(parts), clone(parts)
    kw = dict(step=3, grad_scale=1e-3, **HYPER)
    segments = segments_for(3000)
    fused_adam_step(*a[:4], model_param_out=a[4], weight_decay=segments, **kw)
    for s, e, wd in segments:
        fused_adam_step(*(t[s:e] for t in b[:4]), model_param_out=b[4][s:e], weight_decay=wd,
                        **kw)
    assert_same(a, b, "one call vs per-segment calls")


def test_fused_step_argument_checks(gen):
    parts = partition(gen, 10, torch.float32, torch.bfloat16)
    with pytest.raises(ValueError):
        fused_adam_step(*parts[:4], step=1, weight_decay=[(5, 8, 0.1), (2, 4, 0.0)], **HYPER)
    with pytest.raises(ValueError):
        fused_adam_step(*parts[:4], step=1, weight_decay=[(0, 11, 0.1)], **HYPER)
    with pytest.raises(ValueError):
        fused_adam_step(parts[0].double(), *parts[1:4], step=1, weight_decay=0.0, **HYPER)


def test_fused_step_fallback_when_extension_missing(gen, ops_disabled):
    parts = partition(gen, 777, torch.bfloat16, torch.float16)
    a, b = clone(parts), clone(parts)
    kw = dict(step=9, weight_decay=segments_for(777), grad_scale=1e-3, **HYPER)
    fused_adam_step(*a[:4], model_param_out=a[4], **kw)
    norm_a = global_grad_norm_sq([a[1]])
    with ops_disabled("all"):
        assert _loader.load_extension("adam") is None
        fused_adam_step(*b[:4], model_param_out=b[4], **kw)
        norm_b = global_grad_norm_sq([b[1]])
    assert_same(a, b, "kernel vs fallback")
    assert norm_a == pytest.approx(norm_b, rel=1e-12)
