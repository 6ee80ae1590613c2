"""CUDA kernels: every .cu compiles with nvcc (here and wherever nvcc is on PATH, so the CUDA
sources cannot rot on machines without a GPU); correctness against the PyTorch references
where a GPU and the built extensions are present (the multi-tensor optimizers against the CPU
ops' references, cpu_adam.adam_update_reference_ and cpu_lamb.lamb_update_reference_); the
multi-tensor optimizers' fallback path (what CPU tensors take) against torch.optim.

nvcc compiles each .cu alone for sm_90 (they include only CUDA headers) with the flags torch's
extension builder passes; the torch-facing bindings (*_cuda.cc) are syntax-checked against the
installed torch's headers (with g++ -fsyntax-only; both run in parallel with each other).
"""

import math
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from megazero.ops import cuda_optim
from megazero.ops import fused_common as fc
from megazero.ops._loader import load_extension
from megazero.ops.cpu_adam import adam_update_reference_
from megazero.ops.cpu_lamb import lamb_update_reference_
from megazero.ops.fused_dropout import dropout_hash

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
NVCC = shutil.which("nvcc")
CU_FILES = sorted(CSRC.glob("*/*.cu"))
GPU = torch.cuda.is_available()


def _nvcc_flags():
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    return [*COMMON_NVCC_FLAGS, "-std=c++20", "-O3", "--use_fast_math", "-Xcompiler", "-fPIC",
            f"-I{CSRC}", f"-I{CSRC / 'include'}"]


def _cuda_include_dir():
    """The CUDA include folder nvcc uses (from its --dryrun INCLUDES line)."""
    out = subprocess.run([NVCC, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                         capture_output=True, text=True).stderr
    for word in out.replace('"', " ").split():
        if word.startswith("-I") and (Path(word[2:]) / "cuda_runtime_api.h").exists():
            return Path(word[2:])
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and (Path(home) / "include" / "cuda_runtime_api.h").exists():
            return Path(home) / "include"
    return None


def _binding_commands(tmp):
    """g++ -fsyntax-only of every *_cuda.cc against the installed torch's headers."""
    from torch.utils.cpp_extension import include_paths

    cuda_inc = _cuda_include_dir()
    if shutil.which("g++") is None or cuda_inc is None:
        return {}
    # a CPU torch wheel lacks this generated header of its CUDA build; an empty one will do
    stub = tmp / "stub" / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    incs = [f"-I{tmp / 'stub'}", *(f"-I{p}" for p in include_paths()), f"-I{cuda_inc}",
            f"-I{sysconfig.get_paths()['include']}", f"-I{CSRC}", f"-I{CSRC / 'include'}"]
    return {cc: ["g++", "-std=c++20", "-fsyntax-only", "-DTORCH_EXTENSION_NAME=_test",
                 "-DTORCH_API_INCLUDE_EXTENSION_H", *incs, str(cc)]
            for cc in sorted(CSRC.glob("*/*_cuda.cc"))}


@pytest.fixture(scope="module")
def compile_jobs(tmp_path_factory):
    """Start every compile at once (nvcc per .cu, g++ per binding); tests wait on theirs."""
    if NVCC is None:
        pytest.skip("nvcc is not on PATH")
    tmp = tmp_path_factory.mktemp("cuda_build")
    cmds = {cu: [NVCC, *_nvcc_flags(), "-arch=sm_90", "-c", str(cu), "-o",
                 str(tmp / f"{cu.stem}.o")] for cu in CU_FILES}
    cmds.update(_binding_commands(tmp))
    jobs = {src: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for src, cmd in cmds.items()}
    yield jobs
    for proc in jobs.values():
        if proc.poll() is None:
            proc.kill()


def _failures(jobs, sources):
    failures = []
    for src in sources:
        out, _ = jobs[src].communicate(timeout=600)
        if jobs[src].returncode != 0:
            failures.append(f"{src.relative_to(ROOT)}:\n{out[-4000:]}")
    return failures


def test_every_cu_file_compiles_with_nvcc(compile_jobs):
    assert CU_FILES, "no .cu sources found"
    failures = _failures(compile_jobs, CU_FILES)
    assert not failures, "\n".join(failures)


def test_cuda_bindings_compile_against_torch_headers(compile_jobs):
    bindings = [src for src in compile_jobs if src.suffix == ".cc"]
    if not bindings:
        pytest.skip("needs g++ and the CUDA headers next to nvcc")
    failures = _failures(compile_jobs, bindings)
    assert not failures, "\n".join(failures)


# ------------------------------------------- the kernels' scalar math, compiled for the host
HOST_HARNESS = r"""
#include <cstdio>
#include <cstring>
#include <vector>
#include "fused/cuda_math.cuh"
using namespace megazero_cuda;
int main() {  // one query per input line, one answer per output line
  char op[16];
  while (std::scanf("%15s", op) == 1) {
    if (!std::strcmp(op, "drop")) {
      unsigned long long seed, i;
      std::scanf("%llu %llu", &seed, &i);
      std::printf("%u\n", mix32(mix32(static_cast<uint32_t>(i) ^ dropout_key(seed, i >> 32))));
    } else if (!std::strcmp(op, "gelu")) {
      float x;
      std::scanf("%a", &x);
      std::printf("%a %a\n", gelu_fwd(x), gelu_grad(x));
    } else if (!std::strcmp(op, "swiglu")) {
      float g, u, d, dg, du;
      std::scanf("%a %a %a", &g, &u, &d);
      silu_mul_grad(g, u, d, &dg, &du);
      std::printf("%a %a %a\n", silu_mul(g, u), dg, du);
    } else {  // online n x...: (m, s) in one pass, and as two halves merged
      int n;
      std::scanf("%d", &n);
      std::vector<float> x(n);
      for (float& v : x) std::scanf("%a", &v);
      MaxSum all{-INFINITY, 0.0f}, a{-INFINITY, 0.0f}, b{-INFINITY, 0.0f};
      for (int k = 0; k < n; ++k) {
        online_add(all, x[k]);
        online_add(k < n / 3 ? a : b, x[k]);
      }
      const MaxSum m = online_merge(b, a);
      std::printf("%a %a %a %a\n", all.m, all.s, m.m, m.s);
    }
  }
  return 0;
}
"""


def _host_math(tmp_path, queries: list[str]) -> list[list[str]]:
    src = tmp_path / "host_math.cu"
    src.write_text(HOST_HARNESS)
    exe = tmp_path / "host_math"
    build = subprocess.run([NVCC, "-std=c++17", "-O2", f"-I{CSRC}", str(src), "-o", str(exe)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    done = subprocess.run([str(exe)], input="\n".join(queries) + "\n", capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [line.split() for line in done.stdout.splitlines()]


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
def test_kernel_math_on_the_host_matches_the_references(tmp_path, gen):
    # the dropout hash: the CPU kernels' and dropout_keep_mask's, across 2^32 boundaries
    seeds = [0, 1, 12345, 2**62 - 1, int(torch.randint(0, 2**62, (1,), generator=gen))]
    idx = [0, 1, 7, 2**31, 2**32 - 2, 2**32 - 1, 2**32, 2**32 + 5, 3 * 2**32 + 11]
    xs = torch.linspace(-9, 9, 181, dtype=torch.float32).tolist() + [0.0, -0.0]
    gud = (3 * torch.randn(40, 3, generator=gen)).tolist()
    rows = [torch.randn(n, generator=gen) * 20 for n in (1, 2, 5, 33, 100)]
    rows.append(torch.tensor([float("-inf"), 1.0, float("-inf"), -3.0]))
    queries = ([f"drop {s} {i}" for s in seeds for i in idx]
               + [f"gelu {x.hex()}" for x in xs]
               + ["swiglu " + " ".join(float(v).hex() for v in t) for t in gud]
               + [f"online {len(r)} " + " ".join(float(v).hex() for v in r.tolist())
                  for r in rows])
    out = iter(_host_math(tmp_path, queries))
    for s in seeds:
        for i in idx:
            assert int(next(out)[0]) == int(dropout_hash(s, 1, offset=i)[0]), (s, i)
    x = torch.tensor(xs, dtype=torch.float64, requires_grad=True)
    ref = torch.nn.functional.gelu(x, approximate="tanh")
    (dref,) = torch.autograd.grad(ref.sum(), x)
    got = torch.tensor([[float.fromhex(v) for v in next(out)] for _ in xs], dtype=torch.float64)
    torch.testing.assert_close(got[:, 0], ref.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[:, 1], dref, rtol=1e-5, atol=1e-6)
    for g, u, d in gud:
        t = torch.tensor([g, u], dtype=torch.float64, requires_grad=True)
        y = torch.nn.functional.silu(t[0]) * t[1]
        dg, du = torch.autograd.grad(y * d, t)[0]
        got = [float.fromhex(v) for v in next(out)]
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                                   torch.stack([y.detach(), dg, du]), rtol=1e-5, atol=1e-5)
    for r in rows:
        m, s, m2, s2 = (float.fromhex(v) for v in next(out))
        lse = torch.logsumexp(r.double(), 0).item()
        assert m == m2 == r.max().item()
        assert abs(m + math.log(s) - lse) < 1e-5 * max(1.0, abs(lse))
        assert abs(m2 + math.log(s2) - lse) < 1e-5 * max(1.0, abs(lse))


# ------------------------------------------------------------- multi-tensor reference path
def _params(gen, shapes, dtype=torch.float32, device="cpu"):
    return [torch.randn(s, generator=gen).to(device=device, dtype=dtype) for s in shapes]


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_reference_matches_torch(gen, adam_w_mode):
    shapes = [(7,), (3, 5), (129,), ()]
    init = _params(gen, shapes)
    ours = [torch.nn.Parameter(p.clone()) for p in init]
    theirs = [torch.nn.Parameter(p.clone()) for p in init]
    opt = cuda_optim.FusedAdam(ours, lr=1e-2, weight_decay=0.1, adam_w_mode=adam_w_mode)
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ref = cls(theirs, lr=1e-2, weight_decay=0.1)
    for _ in range(100):
        grads = _params(gen, shapes)
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    # 100 steps of fp32 rounding in a different operation order (H200: one element of 1023 at
    # 2.4e-6 relative); a wrong formula is off by far more than 1e-5 within a few steps
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("grad_scale", [1.0, 0.5])
def test_torch_fused_route_matches_reference(gen, adam_w_mode, grad_scale):
    # the fp32 CUDA route of FusedAdam (torch's fused kernel), run here on CPU tensors: the
    # reference's step within fp32 rounding, the gradients left as they were
    shapes = [(7,), (3, 5), (129,), (0,)]
    params, grads = _params(gen, shapes), _params(gen, shapes)
    ms = [torch.zeros_like(p) for p in params]
    vs = [torch.zeros_like(p) for p in params]
    ref = [[t.clone() for t in lst] for lst in (params, grads, ms, vs)]
    before = [g.clone() for g in grads]
    for step in (1, 2, 3):
        cuda_optim.torch_fused_adam_(params, grads, ms, vs, lr=1e-2, beta1=0.9, beta2=0.999,
                                     eps=1e-8, weight_decay=0.1, step=step,
                                     adam_w_mode=adam_w_mode, grad_scale=grad_scale)
        adam_update_reference_(*ref, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                               weight_decay=0.1, step=step, adam_w_mode=adam_w_mode,
                               grad_scale=grad_scale)
    for a, b in zip([*params, *ms, *vs], [*ref[0], *ref[2], *ref[3]]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(g, b) for g, b in zip(grads, before))


def test_torch_fused_route_is_taken_for_fp32_cuda_only():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # fake CUDA tensors: no device needed to check the choice
        f32 = [torch.empty(4, device="cuda")]
        bf16 = [torch.empty(4, device="cuda", dtype=torch.bfloat16)]
        assert cuda_optim.takes_torch_fused(f32, f32, f32, f32, bias_correction=True)
        assert not cuda_optim.takes_torch_fused(f32, f32, f32, f32, bias_correction=False)
        assert not cuda_optim.takes_torch_fused(bf16, bf16, f32, f32, bias_correction=True)
    cpu = [torch.zeros(4)]
    assert not cuda_optim.takes_torch_fused(cpu, cpu, cpu, cpu, bias_correction=True)
    assert not cuda_optim.takes_torch_fused([], [], [], [], bias_correction=True)


@pytest.mark.parametrize("lamb", [cuda_optim.multi_tensor_lamb, lamb_update_reference_])
def test_fused_lamb_reference_step(gen, lamb):
    p = torch.randn(50, generator=gen)
    g = torch.randn(50, generator=gen)
    m, v = torch.zeros(50), torch.zeros(50)
    q = p.clone()
    lamb([q], [g], [m], [v], lr=0.1, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, step=1)
    # first step: m_hat = g, v_hat = g^2, so u = g / (|g| + eps) + wd * p
    u = g / (g.abs() + 1e-6) + 0.01 * p
    ratio = min(max(p.norm() / u.norm(), 0.01), 10.0)
    torch.testing.assert_close(q, p - 0.1 * ratio * u)
    # a zero parameter tensor takes ratio 1
    z = torch.zeros(4)
    lamb([z], [torch.ones(4)], [torch.zeros(4)], [torch.zeros(4)], lr=0.1, beta1=0.9,
         beta2=0.999, eps=0.0, weight_decay=0.0, step=1)
    torch.testing.assert_close(z, torch.full((4,), -0.1))


# ---------------------------------------------------------------------- on a GPU (skipped here)
needs_gpu_fused = pytest.mark.skipif(not GPU or fc.cuda_extension() is None,
                                     reason="needs a GPU and megazero.ops._fused_cuda")
needs_gpu_optim = pytest.mark.skipif(
    not GPU or (GPU and load_extension(cuda_optim.EXTENSION) is None),
    reason="needs a GPU and megazero.ops._multi_tensor_cuda")


def gpu_check(actual, expected, dtype, what, scale=1.0):
    """Within dtype's tolerance, absolute part scaled by the larger of ``scale`` and |expected|."""
    tol = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    assert actual.shape == expected.shape, f"{what}: {actual.shape} != {expected.shape}"
    if expected.numel() == 0:
        return
    scale = max(scale, expected.float().abs().max().item())
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol * scale,
                               msg=lambda m: f"{what}: {m}")


@needs_gpu_optim
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_multi_tensor_adam_and_lamb_match_reference(gen, dtype):
    # > 36 tensors and > 320 chunks: several launches, tensors split across launches
    shapes = [(1000,)] * 40 + [(3 * 65536 + 7,)] * 120 + [(0,), (5,)]
    for op, ref_op, kw in [
        (cuda_optim.multi_tensor_adam, adam_update_reference_, dict(adam_w_mode=True)),
        (cuda_optim.multi_tensor_lamb, lamb_update_reference_, {}),
    ]:
        params = _params(gen, shapes, dtype, "cuda")
        grads = _params(gen, shapes, dtype, "cuda")
        ms = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        vs = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        clones = [[t.clone() for t in lst] for lst in (params, grads, ms, vs)]
        for step in (1, 2, 3):
            op(params, grads, ms, vs, lr=1e-2, weight_decay=0.01, step=step, grad_scale=0.5,
               **kw)
            ref_op(*clones, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8 if "adam_w_mode" in kw
                   else 1e-6, weight_decay=0.01, step=step, grad_scale=0.5, **kw)
        for a, b in zip(params, clones[0]):
            gpu_check(a, b, dtype, op.__name__)


@needs_gpu_optim
def test_cuda_fused_adam_matches_torch_adamw(gen):
    init = _params(gen, [(1023,), (64, 65), (70000,)])
    ours = [torch.nn.Parameter(p.cuda()) for p in init]
    theirs = [torch.nn.Parameter(p.cuda()) for p in init]
    opt = cuda_optim.FusedAdam(ours, lr=1e-3, weight_decay=0.1)
    ref = torch.optim.AdamW(theirs, lr=1e-3, weight_decay=0.1)
    for _ in range(100):
        for p, q in zip(ours, theirs):
            g = torch.randn(p.shape, generator=gen).cuda()
            p.grad, q.grad = g.clone(), g
        opt.step()
        ref.step()
    # 100 steps of fp32 rounding in a different operation order (H200: one element of 1023 at
    # 2.4e-6 relative); a wrong formula is off by far more than 1e-5 within a few steps
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not GPU, reason="needs a GPU")
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_cuda_adam_rule_takes_the_multi_tensor_path_bit_for_bit(gen, grad_dtype):
    # megazero's default step on GPU segments (ops/foreach_adam.py) against the per-segment
    # reference on the same GPU: fp32 sqrt is correctly rounded on CUDA, so bits agree
    from megazero.optim.rules import AdamRule, SegmentView

    sizes = [3000, 0, 5, 70000, 1]
    wds = [0.1, 0.0, 0.0, 0.1, 0.1]

    def segments():
        g2 = torch.Generator().manual_seed(1234)
        return [SegmentView(
            main=torch.randn(n, generator=g2).cuda(),
            grad=(0.1 * torch.randn(n, generator=g2)).to(grad_dtype).cuda(),
            model_out=torch.empty(n, dtype=torch.bfloat16, device="cuda") if i % 2 else None,
            weight_decay=wd, state={"exp_avg": torch.zeros(n, device="cuda"),
                                    "exp_avg_sq": torch.zeros(n, device="cuda")})
            for i, (n, wd) in enumerate(zip(sizes, wds))]

    ours, ref = segments(), segments()
    rule = AdamRule(0.9, 0.95, 1e-8)
    for step in (1, 2, 3):
        rule.apply(ours, step=step, lr=1e-2, grad_scale=0.5)
        for s in ref:
            adam_update_reference_([s.main], [s.grad], [s.state["exp_avg"]],
                                   [s.state["exp_avg_sq"]], step=step, lr=1e-2, beta1=0.9,
                                   beta2=0.95, eps=1e-8, weight_decay=s.weight_decay,
                                   grad_scale=0.5, mask_nonfinite=True,
                                   copies=None if s.model_out is None else [s.model_out])
    for a, b in zip(ours, ref):
        for x, y in [(a.main, b.main), (a.state["exp_avg"], b.state["exp_avg"]),
                     (a.state["exp_avg_sq"], b.state["exp_avg_sq"]), (a.model_out, b.model_out)]:
            assert x is None or torch.equal(x, y)
    assert not torch.equal(ours[0].main, segments()[0].main)


def test_report_lists_the_cuda_ops():
    out = subprocess.run([sys.executable, "-m", "megazero.ops"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    for name in ("cuda_bias_gelu", "cuda_bias_dropout_add", "cuda_bias_swiglu", "cuda_rope",
                 "cuda_vocab_cross_entropy", "cuda_causal_softmax", "cuda_fused_adam",
                 "bias_gelu"):
        assert name in out.stdout
    assert "cuda_layer_norm" not in out.stdout  # retired: ATen's is faster
