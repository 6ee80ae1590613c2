"""CPU LAMB (megazero.ops._lamb) against its PyTorch reference and a textbook LAMB.

Seeded random inputs (fixed seed per test, printed); every SIMD level forced in turn.
Moments and stage-2 parameters are bit-identical to the reference; the float64 norms agree to
float64 rounding; CPULamb follows the formula in megazero/ops/cpu_lamb.py to 1e-6.
"""

import copy
import math

import pytest
import torch

from megazero.ops import CPULamb, _cpu_ext, _loader
from megazero.ops.cpu_lamb import (
    fused_lamb_stage1,
    fused_lamb_stage1_reference,
    fused_lamb_stage2,
    fused_lamb_stage2_reference,
    lamb_stage1_,
    lamb_stage1_reference_,
    lamb_stage2_,
    lamb_stage2_reference_,
    lamb_trust_ratio,
    lamb_trust_ratios,
)

LEVELS = _cpu_ext.supported_simd_levels("lamb") or ["none"]
needs_kernel = pytest.mark.skipif(LEVELS == ["none"], reason="megazero.ops._lamb is not built")
SHAPES = [(), (0,), (1,), (15,), (17,), (3, 5, 7), (4099,)]
KW = dict(step=4, beta1=0.9, beta2=0.999, eps=1e-6)


def make_case(gen, shapes, pdt, gdt):
    params = [torch.randn(s, generator=gen).to(pdt) for s in shapes]
    grads = [torch.randn(s, generator=gen).to(gdt) for s in shapes]
    ms = [torch.randn(s, generator=gen) * 0.1 for s in shapes]
    vs = [(torch.randn(s, generator=gen) * 0.1).square() for s in shapes]
    return params, grads, ms, vs


def clone_case(case):
    return tuple([t.clone() for t in part] for part in case)


def assert_same(a, b, what):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True, msg=what)


@needs_kernel
@pytest.mark.parametrize("level", LEVELS)
def test_stages_match_reference(level, gen):
    for pdt in (torch.float32, torch.bfloat16, torch.float16):
        for gdt in (torch.float32, torch.bfloat16):
            case = make_case(gen, SHAPES, pdt, gdt)
            a, b = clone_case(case), clone_case(case)
            wds = [0.0 if k % 2 else 0.01 for k in range(len(SHAPES))]
            with _cpu_ext.forced_simd(level):
                w_a, u_a, found_a = lamb_stage1_(*a, weight_decay=wds, grad_scale=0.5, **KW)
            w_b, u_b, found_b = lamb_stage1_reference_(*b, weight_decay=wds, grad_scale=0.5,
                                                       **KW)
            assert found_a is found_b is False
            assert_same(a[2] + a[3], b[2] + b[3], f"{level} {pdt} {gdt} moments")
            assert w_a == pytest.approx(w_b, rel=1e-12, abs=0)
            assert u_a == pytest.approx(u_b, rel=1e-12, abs=0)
            ratios = [lamb_trust_ratio(w, u) for w, u in zip(w_a, u_a)]
            with _cpu_ext.forced_simd(level):
                lamb_stage2_(a[0], a[2], a[3], lr=0.01, trust_ratios=ratios, weight_decay=wds,
                             **KW)
            lamb_stage2_reference_(b[0], b[2], b[3], lr=0.01, trust_ratios=ratios,
                                   weight_decay=wds, **KW)
            assert_same(a[0], b[0], f"{level} {pdt} {gdt} params")


def textbook_lamb(params, grads_per_step, lr, betas, eps, wd, min_coeff=0.01, max_coeff=10.0):
    """LAMB written plainly from the formula (fp32, float64 norms)."""
    ms = [torch.zeros_like(p) for p in params]
    vs = [torch.zeros_like(p) for p in params]
    b1, b2 = betas
    for t, grads in enumerate(grads_per_step, start=1):
        for p, g, m, v in zip(params, grads, ms, vs):
            m.mul_(b1).add_(g * (1 - b1))
            v.mul_(b2).add_(g * g * (1 - b2))
            u = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps) + wd * p
            w_norm, u_norm = float(p.double().norm()), float(u.double().norm())
            r = 1.0 if w_norm == 0 or u_norm == 0 else min(max(w_norm / u_norm, min_coeff),
                                                           max_coeff)
            p.sub_(lr * r * u)
    return params


def test_cpulamb_matches_textbook(gen):
    shapes = [(), (37,), (3, 5, 7), (1000,)]
    init = [torch.randn(s, generator=gen) for s in shapes]
    steps = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(20)]
    ours = [t.clone().requires_grad_() for t in init]
    opt = CPULamb(ours, lr=1e-2, eps=1e-6, weight_decay=0.01)
    for grads in steps:
        for p, g in zip(ours, grads):
            p.grad = g.clone()
        opt.step()
    want = textbook_lamb([t.clone() for t in init], steps, 1e-2, (0.9, 0.999), 1e-6, 0.01)
    for p, q in zip(ours, want):
        assert float((p.detach() - q).abs().max() / q.abs().max()) < 1e-6
    assert len(opt.get_lamb_coeffs()) == len(shapes)
    sd = opt.state_dict()
    assert set(sd["state"][1]) == {"step", "exp_avg", "exp_avg_sq"}
    assert float(sd["state"][1]["step"]) == 20.0


def test_trust_ratio_clamp_and_zero_norms():
    assert lamb_trust_ratio(1e6, 1.0) == 10.0
    assert lamb_trust_ratio(1e-8, 1.0) == 0.01
    assert lamb_trust_ratio(4.0, 1.0) == 2.0
    assert lamb_trust_ratio(0.0, 1.0) == 1.0 and lamb_trust_ratio(1.0, 0.0) == 1.0
    r = lamb_trust_ratios(torch.tensor([1e6, 1e-8, 4.0, 0.0]), [1.0, 1.0, 1.0, 1.0])
    assert r.dtype == torch.float64 and r.tolist() == [10.0, 0.01, 2.0, 1.0]
    # a zero parameter (fresh bias) is updated with ratio 1
    p = torch.zeros(8, requires_grad=True)
    p.grad = torch.ones(8)
    opt = CPULamb([p], lr=0.1)
    opt.step()
    assert opt.get_lamb_coeffs() == [1.0]
    assert torch.allclose(p.detach(), torch.full((8,), -0.1), rtol=1e-5)


def test_partitioned_stages_equal_whole_tensors(gen):
    """Two 'ranks' each holding half of a flat buffer: summed segment norms == per tensor."""
    sizes, wds = [300, 5, 1201], [0.01, 0.0, 0.01]
    n = sum(sizes)
    flat = [torch.randn(n, generator=gen) for _ in range(2)] + \
        [torch.randn(n, generator=gen) * 0.1, (torch.randn(n, generator=gen) * 0.1).square()]
    main, grad, m, v = flat
    offsets = [0, 300, 305, n]
    tensors = [[t[offsets[k]:offsets[k + 1]].clone() for k in range(3)] for t in flat]
    hyper = dict(step=3, beta1=0.9, beta2=0.999, eps=1e-6)
    w_t, u_t, _ = lamb_stage1_(tensors[0], tensors[1], tensors[2], tensors[3], weight_decay=wds,
                               grad_scale=0.5, **hyper)
    ratios_t = [lamb_trust_ratio(w, u) for w, u in zip(w_t, u_t)]
    lamb_stage2_(tensors[0], tensors[2], tensors[3], lr=0.01, trust_ratios=ratios_t,
                 weight_decay=wds, **hyper)

    half = n // 2  # rank 0: [0, half), rank 1: [half, n); the last tensor is split
    copies = torch.zeros(n, dtype=torch.bfloat16)
    ranks = []
    for lo, hi in ((0, half), (half, n)):
        segs = [(max(s, lo) - lo, min(e, hi) - lo, wd) for s, e, wd in
                zip(offsets[:-1], offsets[1:], wds)]
        segs = [(s, max(s, e), wd) for s, e, wd in segs]
        views = [t[lo:hi] for t in flat]
        w, u, found = fused_lamb_stage1(*views, segments=segs, grad_scale=0.5, **hyper)
        assert not found and w.shape == (3,)
        ranks.append((views, segs, w, u, copies[lo:hi]))
    w_sum = ranks[0][2] + ranks[1][2]  # the all-reduce
    u_sum = ranks[0][3] + ranks[1][3]
    assert w_sum.tolist() == pytest.approx(w_t, rel=1e-12)
    ratios = lamb_trust_ratios(w_sum, u_sum)
    for views, segs, _, _, out in ranks:
        fused_lamb_stage2(views[0], views[2], views[3], segments=segs, trust_ratios=ratios,
                          lr=0.01, model_param_out=out, **hyper)
    want = torch.cat(tensors[0])
    assert float((main - want).abs().max() / want.abs().max()) < 1e-6
    assert torch.equal(copies, main.bfloat16())


@needs_kernel
def test_fused_stages_match_references(gen):
    n = 5000
    parts = [torch.randn(n, generator=gen), torch.randn(n, generator=gen).bfloat16(),
             torch.randn(n, generator=gen) * 0.1, (torch.randn(n, generator=gen) * 0.1).square()]
    parts[1][17] = float("nan")
    a, b = [t.clone() for t in parts], [t.clone() for t in parts]
    segs = [(0, 1000, 0.01), (1000, 1010, 0.0), (1010, 4000, 0.01), (4100, n, 0.0)]
    hyper = dict(step=2, beta1=0.9, beta2=0.999, eps=1e-6)
    wa, ua, fa = fused_lamb_stage1(*a, segments=segs, **hyper)
    wb, ub, fb = fused_lamb_stage1_reference(*b, segments=segs, **hyper)
    assert fa is fb is True
    assert torch.equal(a[2][17:18], parts[2][17:18])  # masked element keeps its moments
    torch.testing.assert_close(wa, wb, rtol=1e-12, atol=0)
    torch.testing.assert_close(ua, ub, rtol=1e-12, atol=0)
    ca, cb = torch.zeros(n, dtype=torch.float16), torch.zeros(n, dtype=torch.float16)
    ratios = lamb_trust_ratios(wa, ua)
    fused_lamb_stage2(a[0], a[2], a[3], segments=segs, trust_ratios=ratios, lr=0.02,
                      model_param_out=ca, **hyper)
    fused_lamb_stage2_reference(b[0], b[2], b[3], segments=segs, trust_ratios=ratios, lr=0.02,
                                model_param_out=cb, **hyper)
    assert_same(a + [ca], b + [cb], "fused LAMB stages")
    assert torch.equal(a[0][4000:4100], parts[0][4000:4100])  # outside every segment


def test_fallback_and_state_dict_roundtrip(gen, ops_disabled):
    shapes = [(13,), (2, 9)]
    init = [torch.randn(s, generator=gen) for s in shapes]
    steps = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(4)]

    def run(params, opt, grads_list):
        for grads in grads_list:
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()

    a = [t.clone().requires_grad_() for t in init]
    opt_a = CPULamb(a, lr=1e-2, weight_decay=0.01)
    run(a, opt_a, steps)
    b = [t.clone().requires_grad_() for t in init]
    with ops_disabled("lamb"):
        assert _loader.load_extension("lamb") is None
        opt_b = CPULamb(b, lr=1e-2, weight_decay=0.01)
        run(b, opt_b, steps[:2])
        c = [p.detach().clone().requires_grad_() for p in b]
        opt_c = CPULamb(c, lr=1e-2, weight_decay=0.01)
        opt_c.load_state_dict(copy.deepcopy(opt_b.state_dict()))
    run(c, opt_c, steps[2:])  # resumed, with the kernel again
    for x, y in zip(a, c):
        assert float((x.detach() - y.detach()).abs().max() / y.detach().abs().max()) < 1e-6
    assert math.isclose(opt_a.get_lamb_coeffs()[0], opt_c.get_lamb_coeffs()[0], rel_tol=1e-6)
