"""Benchmark megazero's fused model ops against the eager PyTorch they replace.

Each op runs forward and forward+backward (``torch.autograd.grad``) on GPT-2-like shapes;
contenders are interleaved round by round in one process so machine noise hits all of them
alike, and the table gives the median (and the minimum) per contender with the speed-up of
the fused op over the eager baseline. The end-to-end section times one GPT-2-style
transformer block step (forward + backward) built with and without the fused ops.

    python benchmarks/bench_fused_ops.py                       # all ops, fp32 and bf16
    python benchmarks/bench_fused_ops.py --ops gelu,softmax --dtypes bf16 --reps 30
    python benchmarks/bench_fused_ops.py --e2e-only --seq 512 --hidden 1024 --heads 16
    python benchmarks/bench_fused_ops.py --threads 1 --max-load 0.1   # on a shared machine
    python benchmarks/bench_fused_ops.py --device cuda --ops layernorm,softmax,adam  # GPU

Baselines (same math, eager PyTorch): bias_gelu: ``F.gelu(x + b, approximate="tanh")`` (and
the op-by-op tanh formula); bias_dropout_add: ``r + F.dropout(x + b, p)``; layer_norm:
``F.layer_norm``; causal softmax: ``softmax((s * scale).masked_fill(triu, -inf))``. The Llama
family's ops on Llama-like shapes (``--llama-*``): rms_norm, bias_swiglu and rope against their
eager references (``rms_norm_reference``, ``swiglu_reference(y + b)``, ``rope_reference``; RoPE
on t as the model passes it, a permute of [s, b, heads, hn], cos/sin [b, 1, s, hn]).

    python benchmarks/bench_fused_ops.py --ops rmsnorm,swiglu,rope --no-e2e
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from megazero.ops import fused_common
from megazero.ops.fused_bias_gelu import bias_gelu_reference, fused_bias_gelu
from megazero.ops.fused_dropout import fused_bias_dropout_add
from megazero.ops.fused_layer_norm import FusedLayerNorm, fused_layer_norm
from megazero.ops.fused_rms_norm import fused_rms_norm, rms_norm_reference
from megazero.ops.fused_rope import fused_rope, rope_reference
from megazero.ops.fused_softmax import scaled_upper_triang_masked_softmax, softmax_eager
from megazero.ops.fused_swiglu import fused_bias_swiglu, swiglu_reference

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEVICE = torch.device("cpu")  # --device


def _busy_seconds() -> float | None:
    """CPU seconds all processes spent busy so far (Linux /proc/stat), or None."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(fields[:3]) + sum(fields[5:8])) / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """Cores kept busy by other processes while the block ran (a noisy-neighbour gauge)."""

    def __enter__(self):
        self.busy, self.own, self.wall = _busy_seconds(), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        busy = _busy_seconds()
        wall = time.perf_counter() - self.wall
        self.cores = None
        if busy is not None and self.busy is not None and wall > 0:
            own = time.process_time() - self.own
            self.cores = max(0.0, (busy - self.busy - own) / wall)

    def __str__(self):
        return "?" if self.cores is None else f"{self.cores:.2f}"


def _sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _time(fn) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return (time.perf_counter() - t0) * 1e3


def _fwd_bwd(fn, inputs, grad_out):
    def run():
        out = fn(*inputs)
        torch.autograd.grad(out, [t for t in inputs if torch.is_tensor(t) and t.requires_grad],
                            grad_out)
    return run


def _fwd(fn, inputs):
    def run():
        with torch.no_grad():
            fn(*inputs)
    return run


def measure(contenders: dict, inputs, grad_out, reps: int, warmup: int = 3) -> dict:
    """{name: {"fwd": [ms...], "fwdbwd": [ms...]}} with contenders interleaved per round."""
    runs = {name: {"fwd": _fwd(fn, inputs), "fwdbwd": _fwd_bwd(fn, inputs, grad_out)}
            for name, fn in contenders.items()}
    for _ in range(warmup):
        for r in runs.values():
            r["fwd"](), r["fwdbwd"]()
    times = {name: {"fwd": [], "fwdbwd": []} for name in runs}
    for _ in range(reps):
        for name, r in runs.items():
            for kind in ("fwd", "fwdbwd"):
                times[name][kind].append(_time(r[kind]))
    return times


def op_cases(args, dtype):
    """(op, shape text, contenders {name: fn}, inputs, grad) per op; 'fused' is measured
    against 'eager' (the first other contender)."""
    s, b, h, heads, ffn = args.seq, args.batch, args.hidden, args.heads, 4 * args.hidden
    rand = lambda *shape, grad=True: torch.randn(*shape, dtype=dtype, device=DEVICE
                                                 ).requires_grad_(grad)
    grad_like = lambda *shape: torch.randn(*shape, dtype=dtype, device=DEVICE)
    cases = []
    if "gelu" in args.ops:
        x, bias = rand(s, b, ffn), rand(ffn)
        contenders = {"fused": fused_bias_gelu,
                      "eager": lambda x, bias: F.gelu(x + bias, approximate="tanh")}
        if args.formula:  # the tanh formula op by op, as Megatron's unfused openai_gelu
            contenders["eager-formula"] = bias_gelu_reference
        cases.append(("bias_gelu", f"[{s},{b},{ffn}]", contenders, (x, bias),
                      grad_like(s, b, ffn)))
    if "dropout" in args.ops:
        x, bias, res = rand(s, b, h), rand(h), rand(s, b, h)
        cases.append(("bias_dropout_add p=0.1", f"[{s},{b},{h}]", {
            "fused": lambda x, bias, r: fused_bias_dropout_add(x, bias, r, 0.1, True),
            "eager": lambda x, bias, r: r + F.dropout(x + bias, p=0.1, training=True),
        }, (x, bias, res), grad_like(s, b, h)))
        cases.append(("bias_add_residual (eval)", f"[{s},{b},{h}]", {
            "fused": lambda x, bias, r: fused_bias_dropout_add(x, bias, r, 0.1, False),
            "eager": lambda x, bias, r: r + F.dropout(x + bias, p=0.1, training=False),
        }, (x, bias, res), grad_like(s, b, h)))
    if "layernorm" in args.ops:
        x, w, bias = rand(s, b, h), rand(h), rand(h)
        cases.append(("layer_norm", f"[{s},{b},{h}]", {
            # on a GPU fused_layer_norm is ATen's (megazero's CUDA LayerNorm was retired)
            "fused": lambda x, w, bias: fused_layer_norm(x, w, bias, 1e-5),
            "eager": lambda x, w, bias: F.layer_norm(x, (h,), w, bias, 1e-5),
        }, (x, w, bias), grad_like(s, b, h)))
    if "softmax" in args.ops:
        scores = rand(b * heads, s, s)
        scale = 1.0 / math.sqrt(h // heads)
        cases.append(("causal_softmax", f"[{b * heads},{s},{s}]", {
            "fused": lambda t: scaled_upper_triang_masked_softmax(t, scale),
            "eager": lambda t: softmax_eager(t, scale),
        }, (scores,), grad_like(b * heads, s, s)))
    return cases + llama_cases(args, rand, grad_like)


def llama_cases(args, rand, grad_like):
    """RMSNorm, SwiGLU (with and without bias) and RoPE on the --llama-* shapes."""
    s, b, h, f = args.llama_seq, args.batch, args.llama_hidden, args.llama_ffn
    heads = args.llama_heads
    cases = []
    if "rmsnorm" in args.ops:
        x, w = rand(s, b, h), rand(h)
        cases.append(("rms_norm", f"[{s},{b},{h}]", {
            "fused": lambda x, w: fused_rms_norm(x, w, 1e-5),
            "eager": lambda x, w: rms_norm_reference(x, w, 1e-5),
        }, (x, w), grad_like(s, b, h)))
    if "swiglu" in args.ops:
        y, bias = rand(s, b, 2 * f), rand(2 * f)
        cases.append(("bias_swiglu", f"[{s},{b},2*{f}]", {
            "fused": fused_bias_swiglu,
            "eager": lambda y, bias: swiglu_reference(y + bias),
        }, (y, bias), grad_like(s, b, f)))
        cases.append(("swiglu (no bias)", f"[{s},{b},2*{f}]", {
            "fused": lambda y: fused_bias_swiglu(y, None),
            "eager": swiglu_reference,
        }, (y,), grad_like(s, b, f)))
    if "rope" in args.ops:
        hn = h // heads
        t = rand(s, b, heads, hn, grad=False).permute(1, 2, 0, 3).requires_grad_(True)
        angles = torch.arange(s, dtype=torch.float32, device=DEVICE)[:, None] * torch.rand(
            hn // 2, device=DEVICE)
        angles = torch.cat((angles, angles), dim=-1).expand(b, 1, s, hn)
        cos, sin = angles.cos().to(t.dtype), angles.sin().to(t.dtype)
        cases.append(("rope", f"[{b},{heads},{s},{hn}] (permuted)", {
            "fused": fused_rope, "eager": rope_reference,
        }, (t, cos, sin), grad_like(b, heads, s, hn)))
    return cases


def optim_cases(args):
    """Multi-tensor optimizer steps on the GPU against torch's fused and foreach AdamW: FusedAdam
    (torch's kernel for fp32) and megazero's own kernel (with bias correction off)."""
    from megazero.ops.cuda_optim import FusedAdam, FusedLamb

    shapes = [(args.hidden, 4 * args.hidden)] * 48 + [(4 * args.hidden,)] * 48
    def params():
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(s, device=DEVICE)) for s in shapes]
        for p in ps:
            p.grad = torch.randn_like(p)
        return ps
    opts = {"megazero FusedAdam": FusedAdam(params(), lr=1e-4, weight_decay=0.01),
            "megazero Adam kernel (no bias correction)": FusedAdam(
                params(), lr=1e-4, weight_decay=0.01, bias_correction=False),
            "torch AdamW fused": torch.optim.AdamW(params(), lr=1e-4, weight_decay=0.01,
                                                   fused=True),
            "torch AdamW foreach": torch.optim.AdamW(params(), lr=1e-4, weight_decay=0.01,
                                                     foreach=True),
            "megazero FusedLamb": FusedLamb(params(), lr=1e-4, weight_decay=0.01)}
    for opt in opts.values():
        opt.step()
    times = {name: [] for name in opts}
    for _ in range(args.reps):
        for name, opt in opts.items():
            times[name].append(_time(opt.step))
    numel = sum(math.prod(s) for s in shapes)
    return f"{len(shapes)} tensors, {numel / 1e6:.1f}M params", times


# ------------------------------------------------------------------ end-to-end block step
class Block(torch.nn.Module):
    """GPT-2 pre-LN transformer block on [s, b, h]; ``fused`` picks megazero's fused ops."""

    def __init__(self, h: int, heads: int, fused: bool, dropout: float = 0.1):
        super().__init__()
        self.h, self.heads, self.fused, self.p = h, heads, fused, dropout
        self.ln1, self.ln2 = FusedLayerNorm(h), FusedLayerNorm(h)
        self.qkv = torch.nn.Linear(h, 3 * h)
        self.proj = torch.nn.Linear(h, h, bias=False)
        self.proj_bias = torch.nn.Parameter(torch.zeros(h))
        self.fc1 = torch.nn.Linear(h, 4 * h, bias=False)
        self.fc1_bias = torch.nn.Parameter(torch.zeros(4 * h))
        self.fc2 = torch.nn.Linear(4 * h, h, bias=False)
        self.fc2_bias = torch.nn.Parameter(torch.zeros(h))

    def _ln(self, ln, x):
        if self.fused:
            return ln(x)
        return F.layer_norm(x, (self.h,), ln.weight, ln.bias, ln.eps)

    def _bias_dropout_add(self, x, bias, residual):
        if self.fused:
            return fused_bias_dropout_add(x, bias, residual, self.p, self.training)
        return residual + F.dropout(x + bias, p=self.p, training=self.training)

    def forward(self, x):  # [s, b, h]
        s, b, h = x.shape
        hd = h // self.heads
        q, k, v = self.qkv(self._ln(self.ln1, x)).chunk(3, dim=-1)  # [s, b, h] each
        q, k, v = (t.reshape(s, b * self.heads, hd).transpose(0, 1) for t in (q, k, v))
        scores = torch.bmm(q, k.transpose(1, 2))  # [b*np, s, s]
        if self.fused:
            probs = scaled_upper_triang_masked_softmax(scores, 1.0 / math.sqrt(hd))
        else:
            probs = softmax_eager(scores, 1.0 / math.sqrt(hd))
        probs = F.dropout(probs, p=self.p, training=self.training)
        ctx = torch.bmm(probs, v).transpose(0, 1).reshape(s, b, h)  # [s, b, h]
        x = self._bias_dropout_add(self.proj(ctx), self.proj_bias, x)
        y = self.fc1(self._ln(self.ln2, x))  # [s, b, 4h]
        y = fused_bias_gelu(y, self.fc1_bias) if self.fused else F.gelu(
            y + self.fc1_bias, approximate="tanh")
        return self._bias_dropout_add(self.fc2(y), self.fc2_bias, x)


def e2e(args, dtype):
    torch.manual_seed(0)
    unfused = Block(args.hidden, args.heads, fused=False).to(DEVICE, dtype)
    fused = Block(args.hidden, args.heads, fused=True).to(DEVICE, dtype)
    fused.load_state_dict(unfused.state_dict())
    x = torch.randn(args.seq, args.batch, args.hidden, dtype=dtype, device=DEVICE)
    grad = torch.randn_like(x)
    with torch.no_grad():  # same math: without dropout both blocks agree
        unfused.eval(), fused.eval()
        diff = (unfused(x).float() - fused(x).float()).abs().max().item()
        unfused.train(), fused.train()
    tol = 1e-3 if dtype == torch.float32 else 0.1
    assert diff < tol, f"fused and eager blocks disagree by {diff}"

    def step(block):
        def run():
            block.zero_grad(set_to_none=True)
            block(x).backward(grad)
        return run

    runs = {"eager": step(unfused), "fused": step(fused)}
    for _ in range(2):
        for r in runs.values():
            r()
    times = {name: [] for name in runs}
    for _ in range(max(3, args.reps // 3)):
        for name, r in runs.items():
            times[name].append(_time(r))
    return times


def _fmt(ts):
    return f"{statistics.median(ts):8.2f} ({min(ts):7.2f})"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", default="gelu,dropout,layernorm,softmax,rmsnorm,swiglu,rope")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--llama-seq", type=int, default=1024, help="rmsnorm, swiglu, rope")
    parser.add_argument("--llama-hidden", type=int, default=1024)
    parser.add_argument("--llama-ffn", type=int, default=2816)
    parser.add_argument("--llama-heads", type=int, default=16)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (CUDA kernels, "
                        "and the multi-tensor optimizers against torch's fused AdamW)")
    parser.add_argument("--max-load", type=float, default=float("inf"),
                        help="re-measure a case while other processes keep more cores busy")
    parser.add_argument("--retries", type=int, default=10)
    parser.add_argument("--retry-pause", type=float, default=5.0)
    parser.add_argument("--formula", action="store_true",
                        help="also time bias_gelu as the eager tanh formula op by op")
    parser.add_argument("--e2e-only", action="store_true")
    parser.add_argument("--no-e2e", action="store_true")
    args = parser.parse_args()
    args.ops = args.ops.split(",")
    if args.threads:
        torch.set_num_threads(args.threads)
    global DEVICE
    DEVICE = torch.device(args.device)

    where = (torch.cuda.get_device_name() if DEVICE.type == "cuda"
             else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} "
                  f"threads, SIMD {fused_common.simd_level()}")
    print(f"# fused ops benchmark: {where}, torch {torch.__version__}")
    print("# times in ms: median (min) over interleaved rounds; speed-up = eager / fused, "
          "from the medians (and from the minima); [load L]: cores other processes kept busy "
          "meanwhile\n")
    print("| op | dtype | shape | contender | fwd ms | fwd+bwd ms | fwd speed-up | "
          "fwd+bwd speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname]
        if not args.e2e_only:
            for op, shape, contenders, inputs, grad in op_cases(args, dtype):
                times, load = _quiet(args, measure, contenders, inputs, grad, args.reps)
                op = f"{op} [load {load}]"
                for name, t in times.items():
                    speed = {k: _speedup(t[k], times["fused"][k]) if name != "fused" else ""
                             for k in ("fwd", "fwdbwd")}
                    print(f"| {op} | {dname} | {shape} | {name} | {_fmt(t['fwd'])} | "
                          f"{_fmt(t['fwdbwd'])} | {speed['fwd']} | {speed['fwdbwd']} |",
                          flush=True)
        if "adam" in args.ops and DEVICE.type == "cuda" and dname == "fp32":
            what, times = optim_cases(args)
            for name, t in times.items():
                speed = _speedup(t, times["megazero FusedAdam"]) if "torch" in name else ""
                print(f"| optimizer step | fp32 | {what} | {name} |  | {_fmt(t)} |  | {speed} |",
                      flush=True)
        if not args.no_e2e:
            times, load = _quiet(args, e2e, args, dtype)
            shape = f"s={args.seq} b={args.batch} h={args.hidden} np={args.heads}"
            for name, t in times.items():
                speed = _speedup(t, times["fused"]) if name != "fused" else ""
                print(f"| GPT-2 block step [load {load}] | {dname} | {shape} | {name} |  | "
                      f"{_fmt(t)} |  | "
                      f"{speed} |", flush=True)


def _quiet(args, run, *run_args):
    """run(*run_args) until other processes kept fewer than --max-load cores busy meanwhile (up to
    --retries tries, a pause between); the least disturbed attempt is returned with its load."""
    best = None
    for attempt in range(args.retries + 1):
        with OtherLoad() as load:
            result = run(*run_args)
        if best is None or (load.cores is not None and load.cores < best[1].cores):
            best = (result, load)
        if load.cores is None or load.cores <= args.max_load:
            break
        if attempt < args.retries:
            time.sleep(args.retry_pause)
    return best


def _speedup(base, fused) -> str:
    med = statistics.median(base) / statistics.median(fused)
    return f"{med:.2f} ({min(base) / min(fused):.2f})"


if __name__ == "__main__":
    main()
