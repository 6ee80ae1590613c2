"""megazero's fused CUDA ops against their PyTorch references, on a GPU with the built extension
(``megazero.ops._fused_cuda``; every test here is skipped elsewhere: tests/test_ops_cuda.py
compiles the sources with nvcc and checks their scalar math on the host, and
tests/test_ops_cuda_fake.py the ops' fake implementations and launch counts on fake CUDA).

Per op: forward and gradients against the reference in float64 on the same (rounded) inputs,
fp32/bf16/fp16, shapes with and without 16-byte packs (odd widths: the scalar path); bias-dropout
-add's masks equal ``dropout_keep_mask`` for the op's seed, and its seed follows the CUDA
generator (restored state, tracker fork, recompute: the same masks); the cross entropy at tp1
and as two vocabulary shards combined as the tp all-reduces would; ``torch.library.opcheck``
(fake against real, autograd registration); and torch.profiler's kernel count per call against
the documented one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megazero.ops import cuda_cross_entropy, cuda_elementwise, cuda_ops
from megazero.ops import fused_common as fc
from megazero.ops.fused_bias_gelu import fused_bias_gelu
from megazero.ops.fused_dropout import dropout_keep_mask, dropout_params, fused_bias_dropout_add
from megazero.ops.fused_rms_norm import fused_rms_norm, rms_norm_reference
from megazero.ops.fused_rope import fused_rope, rope_reference
from megazero.ops.fused_softmax import scaled_upper_triang_masked_softmax, softmax_eager
from megazero.ops.fused_swiglu import fused_bias_swiglu, swiglu_reference
from megazero.tensor_parallel.cross_entropy import (
    _VocabParallelCrossEntropy,
    vocab_parallel_cross_entropy,
)
from megazero.tensor_parallel.random import RNGStatesTracker, checkpoint
from tests.test_ops_cuda import gpu_check

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or fc.cuda_extension() is None,
                                reason="needs a GPU and megazero.ops._fused_cuda")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# rows 8200: 256 chunks of 33 rows, the last 7 empty (their partials must be zeros)
SHAPES = [(1, 1), (5, 17), (3, 7, 768), (300, 1031), (64, 4096), (2, 1, 8200), (8200, 24)]


def cuda(gen, *shape, dtype=torch.float32, scale=1.0, grad=True):
    return (scale * torch.randn(*shape, generator=gen)).to(dtype).cuda().requires_grad_(grad)


def f64(*tensors):
    return [t.detach().double().requires_grad_(t.requires_grad) for t in tensors]


def check_grads(got, want, dtype, names):
    for g, w, n in zip(got, want, names):
        gpu_check(g, w, dtype, n)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_bias_gelu(gen, dtype, shape, bias):
    x, b = cuda(gen, *shape, dtype=dtype, scale=3), cuda(gen, shape[-1], dtype=dtype)
    b = b if bias else None
    assert cuda_elementwise.takes_bias_gelu(x, b)
    dy = cuda(gen, *shape, dtype=dtype, grad=False)
    y = fused_bias_gelu(x, b)
    ins = [t for t in (x, b) if t is not None]
    got = torch.autograd.grad(y, ins, dy)
    rins = f64(*ins)
    ref = F.gelu(rins[0] + rins[1] if bias else rins[0], approximate="tanh")
    gpu_check(y, ref, dtype, "y")
    check_grads(got, torch.autograd.grad(ref, rins, dy.double()), dtype, ["dx", "dbias"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("p", [0.1, 0.5, 1.0])
def test_bias_dropout_add_masks_are_the_cpu_kernels(gen, dtype, shape, p):
    x, r = cuda(gen, *shape, dtype=dtype), cuda(gen, *shape, dtype=dtype)
    b = cuda(gen, shape[-1], dtype=dtype)
    threshold, scale = dropout_params(p)
    out, seed = torch.ops.megazero.bias_dropout_add(x, b, r, threshold, scale, True)
    assert seed.device.type == "cpu" and 0 <= int(seed) < 2**62
    keep = dropout_keep_mask(int(seed), shape, p, device="cuda")
    dy = cuda(gen, *shape, dtype=dtype, grad=False)
    dx, db, dr = torch.autograd.grad(out, (x, b, r), dy)
    rx, rb, rr = f64(x, b, r)
    ref = rr + (rx + rb) * keep * scale
    gpu_check(out, ref, dtype, "out")
    check_grads((dx, db, dr), torch.autograd.grad(ref, (rx, rb, rr), dy.double()), dtype,
                ["dx", "dbias", "dresidual"])
    if 0 < p < 1:  # a plausible mask: neither all kept nor all dropped at these sizes
        assert keep.numel() < 20 or 0 < keep.sum() < keep.numel()


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_dropout_add_without_dropout(gen, dtype):
    x, r, b = cuda(gen, 9, 3, 40, dtype=dtype), cuda(gen, 9, 3, 40, dtype=dtype), \
        cuda(gen, 40, dtype=dtype)
    for p, training in ((0.1, False), (0.0, True)):
        out = fused_bias_dropout_add(x, b, r, p, training)
        dx, db, dr = torch.autograd.grad(out, (x, b, r), torch.ones_like(out))
        gpu_check(out, r.double() + (x.double() + b.double()), dtype, "out")
        assert torch.equal(dx, torch.ones_like(x)) and torch.equal(dr, torch.ones_like(r))
        gpu_check(db, torch.full((40,), 27.0, dtype=torch.float64), dtype, "dbias")


def test_dropout_seed_follows_the_cuda_generator(gen):
    x, r, b = (cuda(gen, 64, 4, 128, grad=False) for _ in range(3))
    b = b[0, 0]
    run = lambda: fused_bias_dropout_add(x, b, r, 0.3, True)  # noqa: E731
    torch.cuda.manual_seed(7)
    state = torch.cuda.get_rng_state()
    first, second = run(), run()
    assert not torch.equal(first, second)  # the offset advanced
    torch.cuda.set_rng_state(state)
    assert torch.equal(run(), first)  # a restored state draws the same mask
    tracker = RNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    with tracker.fork("model-parallel-rng"):
        forked = run()  # the tracker's stream
    after = run()  # the default stream goes on where it was: its second draw
    assert torch.equal(after, second) and not torch.equal(forked, first)
    with tracker.fork("model-parallel-rng"):
        assert not torch.equal(run(), forked)  # the tracker's stream advanced too


def test_recompute_replays_the_masks(gen):
    x = cuda(gen, 32, 2, 64)
    r, b = cuda(gen, 32, 2, 64), cuda(gen, 64)
    fn = lambda x_, r_, b_: fused_bias_dropout_add(x_ * 2, b_, r_, 0.3, True)  # noqa: E731
    state = torch.cuda.get_rng_state()
    plain = torch.autograd.grad(fn(x, r, b).square().sum(), (x, r, b))
    torch.cuda.set_rng_state(state)
    recomputed = torch.autograd.grad(checkpoint(fn, x, r, b).square().sum(), (x, r, b))
    for a, c in zip(plain, recomputed):
        assert torch.equal(a, c)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (5, 34), (3, 7, 256), (300, 2062), (16, 2, 8192)])
@pytest.mark.parametrize("bias", [True, False])
def test_bias_swiglu(gen, dtype, shape, bias):
    y, b = cuda(gen, *shape, dtype=dtype, scale=2), cuda(gen, shape[-1], dtype=dtype)
    b = b if bias else None
    assert cuda_elementwise.takes_bias_swiglu(y, b)
    out = fused_bias_swiglu(y, b)
    dout = cuda(gen, *out.shape, dtype=dtype, grad=False)
    ins = [t for t in (y, b) if t is not None]
    got = torch.autograd.grad(out, ins, dout)
    rins = f64(*ins)
    ref = swiglu_reference(rins[0] + rins[1] if bias else rins[0])
    gpu_check(out, ref, dtype, "out")
    check_grads(got, torch.autograd.grad(ref, rins, dout.double()), dtype, ["dy", "dbias"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hn,rot", [(64, 64), (128, 64), (80, 40), (6, 2)])
def test_rope_on_permuted_q(gen, dtype, hn, rot):
    s, b, heads = 37, 3, 5
    base = cuda(gen, s, b, heads, hn, dtype=dtype, grad=False)
    t = base.permute(1, 2, 0, 3).requires_grad_()  # [b, heads, s, hn], as the model's q
    ang = torch.arange(s, dtype=torch.float32)[:, None] * torch.rand(rot // 2, generator=gen)
    ang = torch.cat((ang, ang), -1).cuda()[None, None].expand(b, 1, s, rot)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    out = fused_rope(t, cos, sin)
    dout = cuda(gen, b, heads, s, hn, dtype=dtype, grad=False)
    (dt,) = torch.autograd.grad(out, t, dout)
    (rt,) = f64(t)
    ref = rope_reference(rt, cos.double(), sin.double())
    gpu_check(out, ref, dtype, "out")
    gpu_check(dt, torch.autograd.grad(ref, rt, dout.double())[0], dtype, "dt")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 4), (7, 3, 64), (300, 1030), (16, 2, 4096)])
def test_rms_norm(gen, dtype, shape):
    x, w = cuda(gen, *shape, dtype=dtype, scale=2), cuda(gen, shape[-1], dtype=dtype)
    y = fused_rms_norm(x, w, 1e-5)
    dy = cuda(gen, *shape, dtype=dtype, grad=False)
    got = torch.autograd.grad(y, (x, w), dy)
    rx, rw = f64(x, w)
    ref = rms_norm_reference(rx, rw, 1e-5)
    gpu_check(y, ref, dtype, "y")
    check_grads(got, torch.autograd.grad(ref, (rx, rw), dy.double()), dtype, ["dx", "dw"])


def _ce_inputs(gen, dtype, s=13, b=3, v=96):
    logits = cuda(gen, s, b, v, dtype=dtype, scale=4)
    labels = torch.randint(0, 90, (b, s), generator=gen).cuda()
    return logits, labels.transpose(0, 1)  # [s, b] target, strided as the model passes it


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v", [96, 1001, 50304])
def test_cross_entropy_one_rank(gen, dtype, v):
    logits, target = _ce_inputs(gen, dtype, v=v)
    assert cuda_cross_entropy.takes(logits, target)
    loss = vocab_parallel_cross_entropy(logits, target, None, vocab_size=v - 5)
    dloss = torch.rand(target.shape, generator=gen).cuda().t().contiguous().t()  # strided
    (dl,) = torch.autograd.grad(loss, logits, dloss)
    (rl,) = f64(logits)
    ref = _VocabParallelCrossEntropy.apply(rl, target, None, v - 5, False)
    gpu_check(loss, ref, torch.float32, "loss")  # fp32 math on the same values either way
    gpu_check(dl, torch.autograd.grad(ref, rl, dloss)[0], dtype, "dlogits")  # ref: fp32 loss
    assert loss.dtype == torch.float32 and dl.dtype == dtype
    assert torch.count_nonzero(dl[..., v - 5:]) == 0  # padding columns


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_two_shards_combined_as_tp2(gen, dtype):
    v, vocab = 1024, 1000  # shard 1 holds 488 real columns and 24 of padding
    logits, target = _ce_inputs(gen, dtype, v=v)
    full = vocab_parallel_cross_entropy(logits, target, None, vocab_size=vocab)
    (dfull,) = torch.autograd.grad(full.sum(), logits)
    shards = logits.detach().chunk(2, -1)
    parts = [cuda_cross_entropy.stats(sh.contiguous(), target, i * 512, min(vocab - i * 512, 512))
             for i, sh in enumerate(shards)]
    gmax = torch.maximum(parts[0][1], parts[1][1])  # the MAX all-reduce
    reduced = sum(cuda_cross_entropy.rescale(p[0], gmax, p[2]) for p in parts)  # the SUM
    loss = cuda_cross_entropy.loss(reduced).view(target.shape)
    gpu_check(loss, full.detach(), torch.float32, "loss")
    grads = [cuda_cross_entropy.backward(torch.ones_like(full), sh.contiguous(), target, gmax,
                                         reduced[1], i * 512, min(vocab - i * 512, 512))
             for i, sh in enumerate(shards)]
    gpu_check(torch.cat(grads, -1), dfull, dtype, "dlogits")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq", [1, 31, 33, 100, 1024, 1025, 2000])
def test_cuda_causal_softmax(gen, dtype, sq):
    s = cuda(gen, 3, sq, sq, dtype=dtype, scale=4)
    dy = cuda(gen, 3, sq, sq, dtype=dtype, grad=False)
    y = scaled_upper_triang_masked_softmax(s, 0.125)
    (dx,) = torch.autograd.grad(y, s, dy)
    (sr,) = f64(s)
    ref = softmax_eager(sr, 0.125)
    gpu_check(y, ref, dtype, "probs")
    gpu_check(dx, torch.autograd.grad(ref, sr, dy.double())[0], dtype, "dscores")
    upper = torch.ones(sq, sq, dtype=torch.bool, device="cuda").triu(1).expand(3, sq, sq)
    assert torch.count_nonzero(y[upper]) == 0


def _op_samples(gen):
    """(op, args, opcheck utilities) per custom op (random ops skip the eager/compiled
    comparison: two calls draw two masks)."""
    x, b = cuda(gen, 40, 96, dtype=torch.bfloat16), cuda(gen, 96, dtype=torch.bfloat16)
    r = cuda(gen, 40, 96, dtype=torch.bfloat16)
    logits, target = _ce_inputs(gen, torch.bfloat16)
    t = cuda(gen, 2, 3, 9, 16, dtype=torch.bfloat16)
    cos = torch.rand(2, 1, 9, 16, generator=gen).to(torch.bfloat16).cuda()
    parts = torch.randn(4, 96, generator=gen).cuda()
    ops = torch.ops.megazero
    no_aot = ("test_schema", "test_autograd_registration", "test_faketensor")
    return [(ops.bias_gelu.default, (x, b), None), (ops.bias_swiglu.default, (x, b), None),
            (ops.bias_dropout_add.default, (x, b, r, 2**30, 4 / 3, True), no_aot),
            (ops.column_sum.default, (parts, torch.bfloat16), None),
            (ops.rope.default, (t, cos, cos), None),
            (ops.rms_norm.default, (x, b, 1e-5), None),
            (ops.causal_softmax.default, (cuda(gen, 2, 9, 9), 0.5), None),
            # no autograd of their own (tensor_parallel.cross_entropy's Function wraps them)
            (ops.vocab_ce_forward.default, (logits.detach(), target, 0, 90), None),
            (ops.vocab_ce_stats.default, (logits.detach(), target, 0, 90), None)]


def test_opcheck_fake_against_real(gen):
    cuda_ops.register_cuda_ops()
    for op, args, utils in _op_samples(gen):
        kwargs = {} if utils is None else {"test_utils": utils}
        torch.library.opcheck(op, args, **kwargs)


def _kernels(fn) -> int:
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not any(k in e.name for k in ("Memcpy", "Memset")))


def test_kernels_per_call_match_the_documented_counts(gen):
    """torch.profiler's kernels per fused forward (1) and backward (1, + 1 for a bias gradient,
    ATen's RMSNorm backward 2) against what the dry run counts (tests/test_ops_cuda_fake.py)."""
    x, b, r = cuda(gen, 64, 2, 256), cuda(gen, 256), cuda(gen, 64, 2, 256)
    t = cuda(gen, 2, 4, 64, 32)
    cos = torch.rand(2, 1, 64, 32, generator=gen).cuda()
    logits, target = _ce_inputs(gen, torch.float32)
    rms_bwd = cuda_ops.KERNELS_PER_CALL["megazero.rms_norm_backward.default"]
    cases = [(lambda: fused_bias_gelu(x, b), (x, b), 2),
             (lambda: fused_bias_dropout_add(x, b, r, 0.1, True), (x, b, r), 2),
             (lambda: fused_bias_swiglu(x, b), (x, b), 2),
             (lambda: fused_rope(t, cos, cos), (t,), 1),
             (lambda: fused_rms_norm(x, b, 1e-5), (x, b), rms_bwd),
             (lambda: vocab_parallel_cross_entropy(logits, target, None, 90), (logits,), 1)]
    for fn, inputs, backward in cases:
        dy = torch.ones_like(fn())

        def step(fn=fn, inputs=inputs, dy=dy):
            torch.autograd.grad(fn(), inputs, dy)

        assert _kernels(fn) == 1
        assert _kernels(step) == 1 + backward
