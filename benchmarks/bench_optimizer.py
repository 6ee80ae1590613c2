"""CPU optimizer step: megazero's kernels against torch's, contenders interleaved in one process.

For 10M/50M/100M fp32 parameters, held as 1 tensor or as 100 tensors:

* Adam(W) step (wd 0.01): torch.optim.AdamW default (for-loop), foreach=True, fused=True,
  megazero CPUAdam, and DeepSpeedCPUAdam when ``deepspeed`` is importable and its op builds.
* The ZeRO optimizer step, with the global norm known first: megazero (norm pass +
  ``fused_adam_step`` writing the bf16 model copy) against torch's best composition of the
  same work (norm, fused AdamW with ``grad_scale`` = loss_scale/clip_coef and ``found_inf``,
  cast to bf16) and against the Megatron-order composition (unscale + inf check, norm, clip,
  fused AdamW, cast). Gradients fp32 (Megatron's main_grad) and bf16 (``--grad-dtypes``).
  Half of the 100 tensors have weight decay, half not (two torch param groups; megazero
  segments). Gradients are restored before every timed call of every contender, since torch's
  compositions unscale them in place.
* For scale, megazero CPULamb on the same tensors (two passes, 40 bytes per parameter).
* A bandwidth probe in the same rounds: ``a.add_(b)`` moves 12 bytes per element; every result
  is also given as a multiple of the floor, 28 bytes per parameter at that bandwidth.

Each round runs every contender once (in rotating order); the table shows medians and minima
over rounds after warm-up, and the speed against the base as the median of per-round ratios.
On a shared machine, rounds in which another job took CPU from this process are left out of
the medians (see ``Timings``); the last column says how many rounds were clean.
Threads: torch.get_num_threads() for everyone.

    python benchmarks/bench_optimizer.py [--sizes 10,50,100] [--layouts 1,100] [--rounds 7]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, REPO)

from benchmarks import harness  # noqa: E402
from megazero.ops import CPUAdam, CPULamb, _cpu_ext  # noqa: E402
from megazero.ops.fused_step import fused_adam_step, global_grad_norm_sq  # noqa: E402

LR, WD, LOSS_SCALE, MAX_NORM = 1e-6, 0.01, 1024.0, 1.0
FLOOR_BYTES = 28


def split(flat: torch.Tensor, layout: int) -> list[torch.Tensor]:
    return list(flat.chunk(layout))


def deepspeed_adam():
    """DeepSpeedCPUAdam class, or the reason it cannot be used."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: PLC0415
        probe = torch.zeros(16, requires_grad=True)
        probe.grad = torch.zeros(16)
        DeepSpeedCPUAdam([probe], lr=LR).step()
        return DeepSpeedCPUAdam, ""
    except Exception as exc:  # noqa: BLE001 - optional contender
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"


def adam_contenders(n: int, layout: int, ds_cls) -> tuple[dict, list]:
    flat = torch.randn(n) * 0.02
    params = [p.requires_grad_() for p in split(flat, layout)]
    for p in params:
        p.grad = torch.randn(p.shape) * 1e-3
    c = {
        "torch AdamW default": torch.optim.AdamW(params, lr=LR, weight_decay=WD, foreach=False),
        "torch AdamW foreach": torch.optim.AdamW(params, lr=LR, weight_decay=WD, foreach=True),
        "torch AdamW fused": torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True),
        "megazero CPUAdam": CPUAdam(params, lr=LR, weight_decay=WD),
    }
    if ds_cls is not None:
        c["DeepSpeedCPUAdam"] = ds_cls(params, lr=LR, weight_decay=WD, adamw_mode=True)
    c["megazero CPULamb (LAMB: 40 B/param)"] = CPULamb(params, lr=LR, weight_decay=WD)
    return {name: opt.step for name, opt in c.items()}, params


class Partition:
    """A ZeRO rank's flat buffers; ``layout`` tensors alternate weight decay / none."""

    def __init__(self, n: int, layout: int, grad_dtype: torch.dtype):
        self.n, self.layout = n, layout
        self.main = torch.randn(n) * 0.02
        self.saved_grad = (torch.randn(n) * 1e-3 * LOSS_SCALE).to(grad_dtype)
        self.grad = self.saved_grad.clone()
        self.model = torch.empty(n, dtype=torch.bfloat16)
        bounds = [0]
        for t in split(self.main, layout):
            bounds.append(bounds[-1] + t.numel())
        self.segments = [(bounds[k], bounds[k + 1], WD if k % 2 == 0 else 0.0)
                         for k in range(layout)]

    def restore(self) -> None:
        self.grad.copy_(self.saved_grad)


def megazero_step(part: Partition):
    m, v = torch.zeros(part.n), torch.zeros(part.n)
    state = {"step": 0}

    def step():
        state["step"] += 1
        sq = global_grad_norm_sq([part.grad])
        if not math.isfinite(sq):
            return
        coef = min(1.0, MAX_NORM / (math.sqrt(sq) / LOSS_SCALE + 1e-6))
        fused_adam_step(part.main, part.grad, m, v, step=state["step"], lr=LR, beta1=0.9,
                        beta2=0.999, eps=1e-8, weight_decay=part.segments,
                        grad_scale=coef / LOSS_SCALE, model_param_out=part.model)
    return step


def torch_groups(part: Partition, params: list[torch.Tensor]):
    if part.layout == 1:
        return [{"params": params, "weight_decay": WD}]
    return [{"params": params[0::2], "weight_decay": WD},
            {"params": params[1::2], "weight_decay": 0.0}]


def torch_best_step(part: Partition):
    """norm of the scaled grads -> fused AdamW(grad_scale, found_inf) -> cast to bf16."""
    params = split(part.main, part.layout)
    fp32_grad = part.grad if part.grad.dtype == torch.float32 else torch.empty(part.n)
    for p, g in zip(params, split(fp32_grad, part.layout)):
        p.grad = g
    opt = torch.optim.AdamW(torch_groups(part, params), lr=LR, fused=True)
    models = split(part.model, part.layout)
    opt.found_inf = torch.zeros(())

    def step():
        if part.grad.dtype != torch.float32:
            fp32_grad.copy_(part.grad)
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm([p.grad for p in params])))
        coef = torch.clamp(MAX_NORM / (norm / LOSS_SCALE + 1e-6), max=1.0)
        opt.grad_scale = LOSS_SCALE / coef
        opt.found_inf.fill_(float(not torch.isfinite(norm)))
        opt.step()
        torch._foreach_copy_(models, params)
    return step


def torch_megatron_step(part: Partition):
    """unscale + inf check -> norm -> clip -> fused AdamW -> cast to bf16 (Megatron's order)."""
    params = split(part.main, part.layout)
    fp32_grad = part.grad if part.grad.dtype == torch.float32 else torch.empty(part.n)
    grads = split(fp32_grad, part.layout)
    for p, g in zip(params, grads):
        p.grad = g
    opt = torch.optim.AdamW(torch_groups(part, params), lr=LR, fused=True)
    models = split(part.model, part.layout)
    found_inf, inv_scale = torch.zeros(1), torch.full((1,), 1.0 / LOSS_SCALE)

    def step():
        if part.grad.dtype != torch.float32:
            fp32_grad.copy_(part.grad)
        found_inf.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        if found_inf.item():
            return
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        coef = torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef)
        opt.step()
        torch._foreach_copy_(models, params)
    return step


def bandwidth_probe(n: int):
    a, b = torch.ones(n), torch.full((n,), 1e-9)
    return lambda: a.add_(b)


class Timings:
    """Per-round wall times of one contender, and which rounds ran uncontended.

    A round is clean when this process got at least CLEAN_SHARE of its threads' worth of CPU
    time during the call (time.process_time() over wall time): on a machine shared with other
    jobs, a preempted OpenMP thread shows up as a lower share. Statistics use clean rounds when
    there are at least three, else all rounds (flagged).
    """

    CLEAN_SHARE = 0.85

    def __init__(self):
        self.wall: list[float] = []
        self.clean: list[bool] = []

    def add(self, wall: float, cpu: float) -> None:
        self.wall.append(wall)
        self.clean.append(cpu >= self.CLEAN_SHARE * torch.get_num_threads() * wall)

    def kept(self) -> list[float]:
        clean = [w for w, c in zip(self.wall, self.clean) if c]
        return clean if len(clean) >= 3 else self.wall

    def median(self) -> float:
        return statistics.median(self.kept())

    def clean_label(self) -> str:
        n = sum(self.clean)
        return f"{n}/{len(self.wall)}" + ("" if n >= 3 else " (all used)")


def run_rounds(fns: dict, rounds: int, warmup: int, before=None) -> dict[str, Timings]:
    times = {name: Timings() for name in fns}
    for r in range(warmup + rounds):
        for name in harness.rotated(fns, r):
            if before is not None:
                before(name)
            c0, t0 = time.process_time(), time.perf_counter()
            fns[name]()
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if r >= warmup:
                times[name].add(dt, dc)
    return times


def paired_speed(base: Timings, other: Timings) -> float:
    """Median over rounds of base / contender, each pair timed in the same round (robust to
    load that changes between rounds); rounds where both ran clean when there are three."""
    pairs = [(b, t, bc and tc) for b, t, bc, tc in
             zip(base.wall, other.wall, base.clean, other.clean)]
    clean = [b / t for b, t, ok in pairs if ok]
    return statistics.median(clean if len(clean) >= 3 else [b / t for b, t, _ in pairs])


def bench_zero_step(n: int, layout: int, grad_dtype: torch.dtype, args) -> dict[str, Timings]:
    part = Partition(n, layout, grad_dtype)
    fns = {"megazero fused step": megazero_step(part),
           "torch best composition": torch_best_step(part),
           "torch Megatron-order composition": torch_megatron_step(part)}
    return run_rounds(fns, args.rounds, args.warmup, before=lambda _: part.restore())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="10,50,100", help="millions of parameters")
    ap.add_argument("--layouts", default="1,100", help="number of tensors")
    ap.add_argument("--grad-dtypes", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()

    ds_cls, ds_reason = deepspeed_adam()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor()}, "
          f"megazero SIMD {_cpu_ext.simd_level('adam') or 'not built (reference path)'}")
    print(f"DeepSpeedCPUAdam: {'included' if ds_cls else 'skipped (' + ds_reason + ')'}")
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        n = size * 1_000_000
        for layout in (int(x) for x in args.layouts.split(",")):
            fns, params = adam_contenders(n, layout, ds_cls)
            fns["bandwidth probe"] = bandwidth_probe(n)
            res = run_rounds(fns, args.rounds, args.warmup)
            bw = 12 * n / res.pop("bandwidth probe").median()
            floor = FLOOR_BYTES * n / bw
            for name, ts in res.items():
                t = ts.median()
                rows.append((size, layout, "adam", name, t, min(ts.wall), t / floor,
                             paired_speed(res["torch AdamW fused"], ts), bw, ts.clean_label()))
            del fns, params
            for gdt in (getattr(torch, d) for d in args.grad_dtypes.split(",")):
                res = bench_zero_step(n, layout, gdt, args)
                tag = f"step, {str(gdt).replace('torch.', '')} grads"
                for name, ts in res.items():
                    t = ts.median()
                    rows.append((size, layout, tag, name, t, min(ts.wall), t / floor,
                                 paired_speed(res["torch best composition"], ts), bw,
                                 ts.clean_label()))
    print_table(rows)


def print_table(rows) -> None:
    print()
    print(harness.markdown_table(
        ["params", "tensors", "kind", "contender", "median ms", "min ms", "x 28B floor",
         "speed vs base", "probe GB/s", "clean rounds"],
        ([f"{size}M", layout, kind, name, f"{t * 1e3:.1f}", f"{t_min * 1e3:.1f}",
          f"{x_floor:.2f}", f"{speed:.2f}x", f"{bw / 1e9:.1f}", clean]
         for size, layout, kind, name, t, t_min, x_floor, speed, bw, clean in rows),
        align="rrllrrrrrr"))
    print("\nspeed vs base: median over rounds of (base time / contender time) within a round; "
          "base: torch AdamW fused (adam rows), torch best composition (step rows); > 1 is "
          "faster. x 28B floor: median / (28 B x params / probe bandwidth). Medians over clean "
          "rounds (this process had >= 85% of its threads' CPU time; see Timings).")


if __name__ == "__main__":
    main()
