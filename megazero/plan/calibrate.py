"""Measure this machine and write its SYSTEM.json (``python -m megazero.plan.calibrate``).

Micro-benchmarks, each rank's view (one thread per rank, as ``torchrun`` starts them):
matrix products at several sizes (peak FLOP/s per dtype and the GEMM size efficiency:
``gemm_max``, ``gemm_half_dim`` fitted to ``1 / (1 + k/M + k/K + k/N)``), a large copy
(memory bandwidth), a gloo all-reduce between two local processes at two sizes (bandwidth
and latency of the loopback "link"), the fixed cost of one training step, of one
micro-batch and of one layer per micro-batch (``step_overhead``, ``microbatch_overhead``,
``layer_overhead``, ``recompute_overhead``: a tiny model of one and three layers, one and four
micro-batches, with and without full recompute), and
what one blocking collective or exchange costs while twice as many ranks as cores compete
(``sync_cost``). The machine is one "node" whose ranks share its cores
(``ranks_share_cores``). ``--activations`` also refits ``activations.json`` from dry runs.

``--gpu-step BENCH.json --system SYSTEM.json --out NEW.json`` instead fits megazero's runtime
on a GPU system to its measured step (``benchmarks/bench_gpu_step.py``'s JSON; ``runtime``)
and writes the system with that ``megazero_runtime`` to ``--out``, which may not lie inside
the megazero package.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from megazero.plan.activations import calibrate
from megazero.plan.runtime import calibrate_system
from megazero.plan.system import (
    RUNTIME_VARIANTS,
    SYSTEMS_DIR,
    PlanInputError,
    read_system,
    system_from_dict,
)

logger = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parent.parent.parent
PACKAGE = Path(__file__).resolve().parent.parent  # the installed megazero package


def _best(fn, repeat: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def gemm_rates(dtype: torch.dtype, sizes=(32, 64, 128, 256, 512)) -> list[tuple]:
    """(M, K, N, FLOP/s) of square products on one thread."""
    out = []
    for n in sizes:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        reps = max(1, int(2e8 / (2 * n ** 3)))

        def run(a=a, b=b, reps=reps):
            for _ in range(reps):
                torch.mm(a, b)
        out.append((n, n, n, reps * 2 * n ** 3 / _best(run)))
    return out


def fit_gemm(rates: list[tuple]) -> tuple[float, float, float]:
    """(peak, gemm_max = 1, half_dim) with rate = peak / (1 + k/M + k/K + k/N)."""
    best = None
    for k in np.linspace(0, 256, 257):
        x = np.array([1 / (1 + k / m + k / kk + k / n) for m, kk, n, _ in rates])
        y = np.array([r for *_, r in rates])
        peak = float((x @ y) / (x @ x))
        err = float(np.sum(((peak * x - y) / y) ** 2))
        if best is None or err < best[0]:
            best = (err, peak, float(k))
    return best[1], 1.0, best[2]


def copy_bandwidth(nbytes: int = 256 << 20) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best(lambda: dst.copy_(src))


_ALLREDUCE = """
import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1],
                        rank=int(sys.argv[2]), world_size=2)
out = []
for n in (256, 4 << 20):
    t = torch.ones(n // 4)
    for _ in range(3):
        dist.all_reduce(t)
    best = 1e9
    for _ in range(10):
        dist.barrier(); s = time.perf_counter(); dist.all_reduce(t)
        best = min(best, time.perf_counter() - s)
    out.append(best)
if int(sys.argv[2]) == 0:
    sys.stdout.write("ALLREDUCE " + " ".join(map(str, out)) + "\\n")
dist.destroy_process_group()
"""


def gloo_link() -> tuple[float, float]:
    """(bandwidth, latency) of a two-rank gloo all-reduce on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", _ALLREDUCE, str(port), str(r)],
                              stdout=subprocess.PIPE, text=True, env=env) for r in (0, 1)]
    out = procs[0].communicate(timeout=120)[0]
    procs[1].wait(timeout=120)
    small, large = (float(x) for x in out.split("ALLREDUCE")[1].split())
    latency = small / 2  # 2 (n-1) steps for n = 2
    bandwidth = (4 << 20) / max(large - small, 1e-9)  # ring: 2 (n-1)/n bytes = bytes
    return bandwidth, latency


_SYNC = """
import os, sys, time, torch, torch.distributed as dist
torch.set_num_threads(1)
rank, world = int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=rank,
                        world_size=world)
pairs = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)]
pair = pairs[rank // 2]
a = torch.randn(96, 96)
def busy():  # about a layer's worth of small operators
    for _ in range(40):
        torch.mm(a, a)
t = torch.ones(8)
peer = rank ^ 1
def ex():
    r = torch.empty(8)
    for q in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, peer),
                                     dist.P2POp(dist.irecv, r, peer)]):
        q.wait()
calls = {"none": lambda: None, "2": lambda: dist.all_reduce(t, group=pair),
         str(world): lambda: dist.all_reduce(t), "p2p": ex}
n, out = 60, {}
for rep in range(3):
    for name, call in calls.items():
        dist.barrier()
        s = time.perf_counter()
        for _ in range(n):
            busy(); call()
        dist.barrier()
        out.setdefault(name, []).append((time.perf_counter() - s) / n)
if rank == 0:
    best = {k: sorted(v)[len(v) // 2] for k, v in out.items()}
    sys.stdout.write("SYNC " + " ".join(f"{k}={v - best['none']}" for k, v in best.items()
                                        if k != "none") + "\\n")
dist.destroy_process_group()
"""


def sync_costs(cores: int) -> dict:
    """Seconds one blocking call costs while 2 x ``cores`` ranks share the cores, each
    alternating ~a layer's worth of small matrix products with the call: a tiny all-reduce
    over pairs and over all ranks, and a pair's point-to-point exchange, less the same loop
    without calls (median of 3)."""
    world = max(2, 2 * cores)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", _SYNC, str(port), str(r), str(world)],
                              stdout=subprocess.PIPE, text=True, env=env)
             for r in range(world)]
    out = procs[0].communicate(timeout=300)[0]
    for p in procs[1:]:
        p.wait(timeout=300)
    pairs = dict(item.split("=") for item in out.split("SYNC")[1].split())
    return {k: max(0.0, float(v)) for k, v in pairs.items()}


def step_overheads(iters: int = 8) -> tuple[float, float, float, float]:
    """(seconds per step, per micro-batch, per layer and micro-batch, per layer and
    micro-batch recomputed) beyond the modelled compute: a hidden-64 model of one layer
    trained with one and with four micro-batches, and of three layers with four, without
    and with full recompute."""
    times = {}
    for layers, m, full in ((1, 1, False), (1, 4, False), (3, 4, False), (3, 4, True)):
        cmd = [sys.executable, "pretrain_gpt2.py", "--num-layers", str(layers),
               "--hidden-size", "64",
               "--num-attention-heads", "4", "--seq-length", "32",
               "--max-position-embeddings", "32", "--micro-batch-size", "1",
               "--global-batch-size", str(m), "--train-iters", str(iters), "--log-interval",
               "1", "--mock-data", "--vocab-size", "256", "--eval-iters", "0"] + \
            (["--recompute-granularity", "full"] if full else [])
        env = dict(os.environ, OMP_NUM_THREADS="1")
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
        ms = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([\d.]+)",
                                            done.stdout + done.stderr)]
        if len(ms) < 3:
            raise RuntimeError(f"overhead run failed: {done.stderr[-2000:]}")
        times[layers, m, full] = statistics.median(ms[2:]) / 1e3
    per_mb = max(0.0, (times[1, 4, False] - times[1, 1, False]) / 3)
    per_layer = max(0.0, (times[3, 4, False] - times[1, 4, False]) / (2 * 4))
    recompute = max(0.0, (times[3, 4, True] - times[3, 4, False]) / (3 * 4))
    return max(0.0, times[1, 1, False] - per_mb), per_mb, per_layer, recompute


def measure(name: str = "cpu-local") -> dict:
    torch.set_num_threads(1)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else os.cpu_count()
    flops, fits = {}, {}
    for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        rates = gemm_rates(dtype)
        peak, gmax, half = fit_gemm(rates)
        flops[label], fits[label] = peak, half
    hbm = copy_bandwidth()
    bw, lat = gloo_link()
    step, per_mb, per_layer, recompute = step_overheads()
    sync = sync_costs(cores)
    link = {"bandwidth": bw, "latency": lat}
    return {"name": name, "gpus_per_node": 64, "memory_bytes": float(
        os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        "flops": flops, "hbm_bandwidth": hbm, "intra_node": link, "inter_node": link,
        "efficiency": {"gemm_max": 1.0, "gemm_half_dim": fits["fp32"], "hbm": 1.0,
                       "network": 1.0},
        "cores": cores, "ranks_share_cores": True, "step_overhead": step,
        "microbatch_overhead": per_mb, "layer_overhead": per_layer,
        "recompute_overhead": recompute, "sync_cost": sync,
        "_sources": {"measured": f"python -m megazero.plan.calibrate on {socket.gethostname()}"
                                 f" at {time.strftime('%Y-%m-%d %H:%M')}",
                     "flops": "one-thread torch.mm, square sizes 32-512, peak and "
                              "gemm_half_dim fitted (bf16's half dim: "
                              f"{fits['bf16']:.0f})",
                     "hbm_bandwidth": "256 MiB float32 copy, read + write",
                     "links": "two-process gloo all-reduce on loopback, 256 B and 4 MiB",
                     "overheads": "hidden-64 model: 1 layer with 1 and 4 micro-batches "
                                  "per step, 3 layers with 4 without and with full "
                                  "recompute",
                     "sync_cost": f"{max(2, 2 * cores)} one-thread ranks on {cores} cores, "
                                  "~1 ms of small products then a blocking call, less "
                                  "the loop without calls"}}


def gpu_step(bench_path: str, system: str, out: str, variant: str) -> dict:
    """Fit ``system``'s megazero runtime to the bench JSON at ``bench_path`` and write the
    result to ``out`` (never inside the package: a shipped system stays as shipped)."""
    target = Path(out).resolve()
    if target.is_relative_to(PACKAGE):
        raise PlanInputError(f"--out {out}: inside the megazero package ({PACKAGE}); write "
                             f"the calibrated system elsewhere and pass it to --gpu")
    try:
        bench = json.loads(Path(bench_path).read_text())
    except FileNotFoundError:
        raise PlanInputError(f"--gpu-step: no such file {bench_path!r}") from None
    except json.JSONDecodeError as exc:
        raise PlanInputError(f"--gpu-step: {bench_path} is not valid JSON ({exc})") from None
    path, data = read_system(system, "--system")
    new = calibrate_system(bench, data, variant=variant, bench_name=bench_path,
                           system_name=str(path))
    target.write_text(json.dumps(new, indent=1) + "\n")
    return new


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m megazero.plan.calibrate",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None,
                   help="where to write SYSTEM.json (this machine: default "
                        "systems/cpu-local.json; with --gpu-step: required)")
    p.add_argument("--name", default=None, help="this machine's system name (cpu-local)")
    p.add_argument("--activations", action="store_true",
                   help="also refit activations.json from dry runs (a few minutes)")
    p.add_argument("--gpu-step", default=None, metavar="BENCH.json",
                   help="fit megazero's GPU runtime to bench_gpu_step.py's JSON instead of "
                        "measuring this machine")
    p.add_argument("--system", default=None, metavar="SYSTEM.json",
                   help="with --gpu-step: the GPU system to calibrate (a shipped name or a "
                        "path)")
    p.add_argument("--variant", default=None, choices=RUNTIME_VARIANTS,
                   help="with --gpu-step: the factor the planner applies (default eager, "
                        "the runtime of its launch lines; compile adds --compile to them)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.gpu_step is not None:
        for flag, value in (("--name", args.name), ("--activations", args.activations)):
            if value:
                p.error(f"{flag} measures this machine; it does not go with --gpu-step")
        if args.system is None or args.out is None:
            p.error("--gpu-step needs --system (the GPU system to calibrate) and --out "
                    "(where to write it)")
        try:
            new = gpu_step(args.gpu_step, args.system, args.out, args.variant or "eager")
        except PlanInputError as exc:
            p.error(str(exc))
        for v, f in new["megazero_runtime"]["factors"].items():
            loo = f["leave_one_out"]
            score = f"{100 * loo['error']:.1f}%" if loo["error"] is not None else \
                f"none ({loo['reason']})"
            sys.stdout.write(f"{v}: factor {f['factor']:.3f}, leave-one-out error {score}\n")
        sys.stdout.write(system_from_dict(new, args.out).runtime_line() + "\n")
        sys.stdout.write(f"wrote {args.out}\n")
        return 0
    for flag, value in (("--system", args.system), ("--variant", args.variant)):
        if value is not None:
            p.error(f"{flag} goes with --gpu-step")
    args.out = args.out or str(SYSTEMS_DIR / "cpu-local.json")
    data = measure(args.name or "cpu-local")
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    sys.stdout.write(json.dumps(data, indent=1) + "\n")
    if args.activations:
        calibrate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
