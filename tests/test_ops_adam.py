"""CPU Adam kernel (megazero.ops._adam) against its PyTorch reference and torch.optim.

Inputs are random tensors from a fixed, printed seed per test (tests/conftest.py). The kernel is
bit-identical to the reference in fp32 at every SIMD level (each level forced in turn);
100 CPUAdam steps match torch.optim.AdamW/Adam to 1e-6 relative.
"""

import copy
import os

import pytest
import torch

from megazero.ops import CPUAdam, _cpu_ext, _loader
from megazero.ops.cpu_adam import adam_update_, adam_update_reference_

LEVELS = _cpu_ext.supported_simd_levels("adam") or ["none"]
SHAPES = [(), (0,), (1,), (7,), (15,), (16,), (17,), (33,), (3, 5, 7), (1000,), (4099,)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
needs_kernel = pytest.mark.skipif(LEVELS == ["none"], reason="megazero.ops._adam is not built")


def make_case(gen, shapes, pdt, gdt):
    def rnd(shape, scale=1.0):
        return torch.randn(shape, generator=gen) * scale

    params = [rnd(s).to(pdt) for s in shapes]
    grads = [rnd(s).to(gdt) for s in shapes]
    ms = [rnd(s, 0.1) for s in shapes]
    vs = [rnd(s, 0.1).square() for s in shapes]
    return params, grads, ms, vs


def clone_case(case):
    return tuple([t.clone() for t in part] for part in case)


def assert_same(a, b, what):
    for x, y in zip(a, b):
        assert torch.equal(x, y), f"{what}: max diff {(x.double() - y.double()).abs().max()}"


def max_rel(a, b):
    if b.numel() == 0:
        return 0.0
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@needs_kernel
@pytest.mark.parametrize("level", LEVELS)
def test_kernel_matches_reference_bitwise(level, gen):
    for pdt in DTYPES:
        for gdt in DTYPES:
            for adam_w_mode in (True, False):
                case = make_case(gen, SHAPES, pdt, gdt)
                a, b = clone_case(case), clone_case(case)
                kw = dict(step=int(torch.randint(1, 50, (), generator=gen)), lr=1e-3,
                          beta1=0.9, beta2=0.95, eps=1e-8,
                          weight_decay=[0.0 if k % 3 == 0 else 0.05 for k in range(len(SHAPES))],
                          adam_w_mode=adam_w_mode, grad_scale=0.25)
                with _cpu_ext.forced_simd(level):
                    adam_update_(*a, **kw)
                adam_update_reference_(*b, **kw)
                for part_a, part_b, name in zip(a, b, ("param", "grad", "exp_avg", "exp_avg_sq")):
                    assert_same(part_a, part_b, f"{level} {pdt} {gdt} w={adam_w_mode} {name}")


@needs_kernel
def test_kernel_without_bias_correction_and_two_threads(gen, torch_threads):
    case = make_case(gen, [(200_003,), (70_001,), (5,)], torch.float32, torch.float32)
    a, b = clone_case(case), clone_case(case)
    kw = dict(step=7, lr=3e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1,
              bias_correction=False)
    with torch_threads(2):
        adam_update_(*a, **kw)
    adam_update_reference_(*b, **kw)
    for part_a, part_b in zip(a, b):
        assert_same(part_a, part_b, "no bias correction, 2 threads")


def _run_steps(opt_cls, params, grads_per_step, **kw):
    opt = opt_cls(params, **kw)
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    return opt


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_100_steps_match_torch(adam_w_mode, gen):
    shapes = [(), (0,), (37,), (3, 5, 7), (1000,), (64, 33)]
    init = [torch.randn(s, generator=gen) for s in shapes]
    steps = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(100)]
    ours = [t.clone().requires_grad_() for t in init]
    theirs = [t.clone().requires_grad_() for t in init]
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    opt = _run_steps(CPUAdam, ours, steps, adam_w_mode=adam_w_mode, **hyper)
    ref = _run_steps(torch.optim.AdamW if adam_w_mode else torch.optim.Adam, theirs, steps,
                     **hyper)
    def close(a, b):
        # relative 1e-6 of the tensor's largest value; a 0-d moment that ends small after
        # passing through O(1) values carries an ulp of those (torch's own kernels order the
        # arithmetic differently): an absolute floor of 1e-7, about one ulp of 1.0
        return max_rel(a, b) < 1e-6 or float((a.double() - b.double()).abs().max()) < 1e-7

    for p, q in zip(ours, theirs):
        assert close(p.detach(), q.detach())
        for key in ("exp_avg", "exp_avg_sq"):
            assert close(opt.state[p][key], ref.state[q][key]), key
        assert float(opt.state[p]["step"]) == float(ref.state[q]["step"]) == 100.0


@pytest.mark.parametrize("pdt", [torch.bfloat16, torch.float16])
def test_low_precision_params_within_precision(pdt, gen):
    """bf16/fp16 params are updated in their dtype: each step adds at most half an ulp of
    rounding to the fp32 trajectory of torch.optim.AdamW."""
    steps, lr = 10, 1e-2
    init = torch.randn(3001, generator=gen).to(pdt)
    grads = [torch.randn(3001, generator=gen).to(pdt) for _ in range(steps)]
    low = [init.clone().requires_grad_()]
    full = [init.float().requires_grad_()]
    opt = _run_steps(CPUAdam, low, [[g] for g in grads], lr=lr, weight_decay=0.01)
    _run_steps(torch.optim.AdamW, full, [[g.float()] for g in grads], lr=lr, weight_decay=0.01)
    assert low[0].dtype == pdt and opt.state[low[0]]["exp_avg"].dtype == torch.float32
    half_ulp = 2.0 ** -8 if pdt == torch.bfloat16 else 2.0 ** -11
    bound = 2 * steps * half_ulp * (init.float().abs() + steps * lr)
    err = (low[0].detach().float() - full[0].detach()).abs()
    assert bool((err <= bound).all()), float((err / bound).max())


def test_state_dict_interoperates_with_torch(gen):
    shapes = [(11,), (4, 3)]
    init = [torch.randn(s, generator=gen) for s in shapes]
    steps = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(6)]
    hyper = dict(lr=1e-2, weight_decay=0.1)
    ours = [t.clone().requires_grad_() for t in init]
    opt = _run_steps(CPUAdam, ours, steps[:3], **hyper)
    sd = copy.deepcopy(opt.state_dict())  # as if saved: no aliasing of live moments
    assert set(sd["state"]) == {0, 1}
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert sd["state"][0]["step"].dim() == 0 and sd["state"][0]["step"].dtype == torch.float32

    # ours -> torch.optim.AdamW, and torch.optim.AdamW -> ours, continue 3 steps each
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    ref = torch.optim.AdamW(theirs, **hyper)
    ref.load_state_dict(sd)
    back = [p.detach().clone().requires_grad_() for p in ours]
    opt2 = CPUAdam(back, **hyper)
    opt2.load_state_dict(copy.deepcopy(ref.state_dict()))
    for opt_x, params in ((opt, ours), (ref, theirs), (opt2, back)):
        for grads in steps[3:]:
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt_x.step()
    for a, b, c in zip(ours, theirs, back):
        assert max_rel(a.detach(), b.detach()) < 1e-6
        assert max_rel(c.detach(), b.detach()) < 1e-6


def test_loaded_moments_stay_fp32_for_bf16_params(gen):
    p = torch.randn(9, generator=gen).bfloat16().requires_grad_()
    opt = _run_steps(CPUAdam, [p], [[torch.randn(9, generator=gen).bfloat16()]])
    sd = opt.state_dict()
    q = p.detach().clone().requires_grad_()
    opt2 = CPUAdam([q])
    opt2.load_state_dict(sd)
    for key in ("exp_avg", "exp_avg_sq"):
        assert opt2.state[q][key].dtype == torch.float32
        assert torch.equal(opt2.state[q][key], sd["state"][0][key])
        assert opt2.state[q][key].data_ptr() != sd["state"][0][key].data_ptr()


def test_non_contiguous_param_takes_reference_path(gen):
    init = torch.randn(8, 6, generator=gen).t()
    steps = [[torch.randn(6, 8, generator=gen)] for _ in range(5)]
    ours = [init.clone().t().contiguous().t().requires_grad_()]
    assert not ours[0].is_contiguous()
    theirs = [init.clone().requires_grad_()]
    _run_steps(CPUAdam, ours, steps, lr=1e-2)
    _run_steps(torch.optim.AdamW, theirs, steps, lr=1e-2, weight_decay=0.0)
    assert max_rel(ours[0].detach(), theirs[0].detach()) < 1e-6


def test_fallback_when_extension_missing(gen, ops_disabled):
    case = make_case(gen, SHAPES, torch.float32, torch.bfloat16)
    a, b = clone_case(case), clone_case(case)
    kw = dict(step=3, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    adam_update_(*a, **kw)
    with ops_disabled("adam"):
        assert _loader.load_extension("adam") is None
        adam_update_(*b, **kw)
    for part_a, part_b in zip(a, b):
        assert_same(part_a, part_b, "kernel vs fallback")


@needs_kernel
def test_simd_level_controls(monkeypatch, caplog):
    ext = _cpu_ext.get_extension("adam")
    assert ext.simd_level() in _cpu_ext.SIMD_LEVELS
    with pytest.raises(ValueError):
        ext.set_simd_level("sse9")
    previous = ext.simd_level()
    try:
        monkeypatch.setenv("MEGAZERO_SIMD", "avx2")
        _cpu_ext._apply_env_simd("adam", ext)
        assert ext.simd_level() == ("avx2" if "avx2" in LEVELS else "scalar")
        monkeypatch.setenv("MEGAZERO_SIMD", "bogus")
        _cpu_ext._apply_env_simd("adam", ext)
        assert "ignoring MEGAZERO_SIMD" in caplog.text
    finally:
        ext.set_simd_level(previous)


@needs_kernel
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_one_openmp_runtime_shared_with_torch(gen, torch_threads):
    """The extension links libgomp.so.1, the soname torch's bundled copy carries, so one
    OpenMP runtime (one thread pool) serves both; calls interleave with torch's parallel ops."""
    for threads in (2, 1, 2):
        with torch_threads(threads):
            case = make_case(gen, [(100_003,)], torch.float32, torch.float32)
            a, b = clone_case(case), clone_case(case)
            adam_update_(*a, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
            torch.mm(torch.randn(64, 64), torch.randn(64, 64)).sum()  # torch's OpenMP team
            adam_update_reference_(*b, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
            assert_same(a[0], b[0], f"{threads} threads")
    with open("/proc/self/maps", encoding="utf-8") as f:
        gomp = {line.split()[-1] for line in f if "libgomp" in line}
    # Other wheels may bundle their own renamed copy (sentencepiece.libs/libgomp-<hash>.so);
    # what matters is that megazero's extensions add none besides torch's libgomp.so.1.
    ours = {g for g in gomp if "sentencepiece" not in g and ".libs/" not in g}
    assert len(ours) == 1, gomp


@pytest.mark.parametrize("name", ["CPUAdam", "CPULamb"])
def test_bad_params_are_named(name):
    import megazero.ops as ops

    cls = getattr(ops, name)
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.zeros(4).to_sparse()
    with pytest.raises(RuntimeError, match=f"{name} does not support sparse gradients"):
        cls([p]).step()
    meta = torch.nn.Parameter(torch.zeros(4, device="meta"))
    meta.grad = torch.zeros(4, device="meta")
    with pytest.raises(ValueError, match=f"{name} steps CPU tensors only, got one on meta"):
        cls([meta]).step()
