"""Optimizer states on NVMe against host memory: step time, peak RSS, and a memory budget.

One process trains megazero's GPT-2 (``pretrain_gpt2.py``, mock data, ZeRO stage 1 at dp 1)
twice, in fresh subprocesses: with ``--cpu-offload`` (fp32 main values and Adam moments in
host memory) and with ``--offload-optimizer nvme --nvme-path DIR`` (the same in swap files,
streamed through two sub-group slots by ``megazero.ops.aio``). Each run reports the median
"elapsed time per iteration" after its first two iterations, its peak RSS (``ru_maxrss``) and
its peak virtual size (``VmPeak``), read by a small wrapper at exit, and the losses (which must
be identical: the NVMe step is the CPU-offloaded step).

The RSS saved should be the optimizer-state bytes (3 x 4 bytes per parameter) less the slots.
Then both run again under an address-space limit (``RLIMIT_AS``) halfway between the two
runs' ``VmPeak``: the NVMe run must train, the host-memory run must fail, and the table shows
its error.

    python benchmarks/bench_nvme.py [--dir DIR] [--layers 8 --hidden 1024 --iters 6]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WRAPPER = r"""
import atexit, os, resource, runpy, sys
limit = int(os.environ.get("BENCH_AS_LIMIT", "0"))
if limit:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

def report():
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    vm = [line for line in open("/proc/self/status") if line.startswith("VmPeak")][0]
    print(f"BENCH peak_rss {peak} vmpeak {int(vm.split()[1]) * 1024}", flush=True)

atexit.register(report)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run(flags, env_extra, timeout=1800):
    env = {**os.environ, "OMP_NUM_THREADS": "2", **env_extra}
    proc = subprocess.run([sys.executable, "-c", WRAPPER, "pretrain_gpt2.py", *flags],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    times = [float(m) for m in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", out)]
    losses = re.findall(r" lm loss: ([0-9.E+-]+) \|", out)
    m = re.search(r"BENCH peak_rss (\d+) vmpeak (\d+)", out)
    error = None
    if proc.returncode != 0:
        lines = [ln for ln in out.splitlines() if "Error" in ln or "can't allocate" in ln]
        error = (lines[-1] if lines else out.strip().splitlines()[-1])[:150]
    return {"rc": proc.returncode, "times": times, "losses": losses,
            "rss": int(m.group(1)) if m else None, "vm": int(m.group(2)) if m else None,
            "error": error, "tail": out[-2000:]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=os.path.join(ROOT, "benchmarks", "out"),
                    help="the NVMe directory (default: benchmarks/out on this repo's disk)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=6)
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    base = ["--mock-data", "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
            "--num-attention-heads", "16", "--seq-length", "128",
            "--max-position-embeddings", "128", "--vocab-size", str(args.vocab),
            "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters",
            str(args.iters), "--log-interval", "1", "--eval-iters", "0", "--lr", "1e-4",
            "--lr-warmup-iters", "1", "--zero-stage", "1", "--seed", "7"]
    with tempfile.TemporaryDirectory(dir=args.dir) as nvme_dir:
        modes = {"cpu-offload": base + ["--cpu-offload"],
                 "nvme": base + ["--offload-optimizer", "nvme", "--nvme-path", nvme_dir]}
        results = {name: run(flags, {}) for name, flags in modes.items()}
        for name, r in results.items():
            if r["rc"] != 0:
                print(f"{name} failed:\n{r['tail']}")
                return 1
        cpu, nvme = results["cpu-offload"], results["nvme"]
        limit = (cpu["vm"] + nvme["vm"]) // 2
        budget = {name: run(flags, {"BENCH_AS_LIMIT": str(limit)})
                  for name, flags in modes.items()}
    n_params = 12 * args.layers * args.hidden ** 2 + (args.vocab + 128) * args.hidden
    states = 12 * n_params  # fp32 main + exp_avg + exp_avg_sq
    mb = 1 / 2 ** 20
    print(f"GPT-2 {args.layers} layers x {args.hidden}, vocab {args.vocab}: about "
          f"{n_params / 1e6:.0f}M parameters, {states * mb:.0f} MiB of fp32 main values and "
          f"moments; {args.iters} iterations, ZeRO-1 at dp 1, OMP_NUM_THREADS=2; NVMe dir "
          f"{args.dir}")
    print("| run | step ms (median, iters 3+) | ratio | peak RSS MiB | VmPeak MiB | "
          f"under RLIMIT_AS {limit * mb:.0f} MiB |")
    print("|---|---:|---:|---:|---:|---|")
    ref = statistics.median(cpu["times"][2:])
    for name in modes:
        r, b = results[name], budget[name]
        t = statistics.median(r["times"][2:])
        under = f"trains ({len(b['losses'])} iterations)" if b["rc"] == 0 else \
            f"fails: {b['error']}"
        print(f"| {name} | {t:.0f} | {t / ref:.2f}x | {r['rss'] * mb:.0f} | "
              f"{r['vm'] * mb:.0f} | {under} |")
    saved = cpu["rss"] - nvme["rss"]
    print(f"RSS saved by NVMe: {saved * mb:.0f} MiB (optimizer states {states * mb:.0f} MiB "
          f"less the two sub-group slots)")
    same = cpu["losses"] == nvme["losses"]
    print(f"losses identical (NVMe vs host memory): {same} ({nvme['losses'][-1]} at the end)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
