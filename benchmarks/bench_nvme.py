"""Optimizer states and parameters on NVMe against host memory: step time, RSS, a budget.

One process trains megazero's GPT-2 (``pretrain_gpt2.py``, mock data, dp 1) in fresh
subprocesses, in two pairs:

* ZeRO-1 with ``--cpu-offload`` (fp32 main values and Adam moments in host memory) against
  ``--offload-optimizer nvme --nvme-path DIR`` (the same in swap files, streamed through two
  sub-group slots by ``megazero.ops.aio``);
* ZeRO-3 with ``--cpu-offload`` against ``--offload-optimizer nvme --offload-param nvme``
  (ZeRO-Infinity: the parameter partition in a swap file too, read unit by unit when
  gathered).

The four runs go in ``--rounds`` rounds, one after another within a round and the order
rotated from round to round, so that load hits both runs of a pair alike; a run's step time is
the median "elapsed time per iteration" after its first two iterations over all rounds (its
ratio is to the host-memory run of its pair, from the same rounds), and it reports the
losses (identical within a pair: the NVMe step is the CPU-offloaded step), and, read by a
small wrapper: its peak RSS (``ru_maxrss``), its peak virtual size (``VmPeak``), and its
steady RSS: the anonymous resident bytes (``RssAnon``, after ``malloc_trim``) at the end of
each iteration from the third on, the largest. The steady RSS is what the process holds
between steps; the peak adds the transient of whichever phase is largest (with the states
gone, the backward's activations and gradient temporaries).

The RSS saved should be the optimizer-state bytes (3 x 4 bytes per parameter; at ZeRO-3 also
the parameters) less the slots. Then the ZeRO-1 pair runs again under an address-space limit
(``RLIMIT_AS``) halfway between the two runs' ``VmPeak``: the NVMe run must train, the
host-memory run must fail, and the table shows its error.

    python benchmarks/bench_nvme.py [--dir DIR] [--layers 8 --hidden 1024 --iters 6 --rounds 2]
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
if ROOT not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, ROOT)

from benchmarks import harness  # noqa: E402

WRAPPER = r"""
import atexit, os, resource, runpy, sys
limit = int(os.environ.get("BENCH_AS_LIMIT", "0"))
if limit:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

def report():
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    vm = [line for line in open("/proc/self/status") if line.startswith("VmPeak")][0]
    print(f"BENCH peak_rss {peak} vmpeak {int(vm.split()[1]) * 1024}", flush=True)

def report_steady():
    if steady:
        print(f"BENCH steady_rss {max(steady[2:] or steady)}", flush=True)

steady = []
from megazero.training import log, monitor
end = monitor.Monitor.iteration_end
def iteration_end(self, iteration):
    end(self, iteration)
    steady.append(log.resident_bytes(trim=True, anonymous=True))
monitor.Monitor.iteration_end = iteration_end
atexit.register(report)
atexit.register(report_steady)
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
    st = re.search(r"BENCH steady_rss (\d+)", out)
    error = None
    if proc.returncode != 0:
        lines = [ln for ln in out.splitlines() if "Error" in ln or "can't allocate" in ln]
        error = (lines[-1] if lines else out.strip().splitlines()[-1])[:150]
    return {"rc": proc.returncode, "times": times, "losses": losses,
            "rss": int(m.group(1)) if m else None, "vm": int(m.group(2)) if m else None,
            "steady": int(st.group(1)) if st else None,
            "error": error, "tail": out[-2000:]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=os.path.join(ROOT, "benchmarks", "out"),
                    help="the NVMe directory (default: benchmarks/out on this repo's disk)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the four runs")
    ap.add_argument("--sub-group", type=int, default=1 << 22,
                    help="--nvme-sub-group-size (elements per streamed sub-group)")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    base = ["--mock-data", "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
            "--num-attention-heads", "16", "--seq-length", "128",
            "--max-position-embeddings", "128", "--vocab-size", str(args.vocab),
            "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters",
            str(args.iters), "--log-interval", "1", "--eval-iters", "0", "--lr", "1e-4",
            "--lr-warmup-iters", "1", "--seed", "7"]
    with tempfile.TemporaryDirectory(dir=args.dir) as nvme_dir:
        nvme = ["--nvme-path", nvme_dir, "--nvme-sub-group-size", str(args.sub_group)]
        modes = {
            "ZeRO-1 cpu-offload": base + ["--zero-stage", "1", "--cpu-offload"],
            "ZeRO-1 nvme (states)": base + ["--zero-stage", "1", "--offload-optimizer",
                                            "nvme", *nvme],
            "ZeRO-3 cpu-offload": base + ["--zero-stage", "3", "--cpu-offload"],
            "ZeRO-3 nvme (states + params)": base + [
                "--zero-stage", "3", "--offload-optimizer", "nvme", "--offload-param", "nvme",
                *nvme]}
        names, rounds = list(modes), []
        for k in range(args.rounds):
            rounds.append({name: run(modes[name], {}) for name in harness.rotated(names, k)})
            failed = [n for n, r in rounds[-1].items() if r["rc"] != 0]
            if failed:
                print(f"{failed[0]} failed:\n{rounds[-1][failed[0]]['tail']}")
                return 1
        results = {name: {**rounds[-1][name], "times": [t for r in rounds
                                                        for t in r[name]["times"][2:]],
                          "steady": max(r[name]["steady"] for r in rounds),
                          "rss": max(r[name]["rss"] for r in rounds),
                          "vm": max(r[name]["vm"] for r in rounds)}
                   for name in names}
        cpu, nv = results[names[0]], results[names[1]]
        limit = (cpu["vm"] + nv["vm"]) // 2
        budget = {name: run(modes[name], {"BENCH_AS_LIMIT": str(limit)}) for name in names[:2]}
    n_params = 12 * args.layers * args.hidden ** 2 + (args.vocab + 128) * args.hidden
    states = 12 * n_params  # fp32 main + exp_avg + exp_avg_sq
    slots = 2 * 3 * 4 * args.sub_group
    mb = 1 / 2 ** 20
    print(f"GPT-2 {args.layers} layers x {args.hidden}, vocab {args.vocab}: about "
          f"{n_params / 1e6:.0f}M parameters, {states * mb:.0f} MiB of fp32 main values and "
          f"moments; {args.iters} iterations at dp 1, OMP_NUM_THREADS=2; sub-groups of "
          f"{args.sub_group} elements (slots {slots * mb:.0f} MiB); NVMe dir {args.dir}; "
          f"{args.rounds} interleaved rounds (step: median of iterations 3+ of every round; "
          "RSS and VmPeak: the largest of the rounds)")
    same, lines = True, []
    for pair in (names[:2], names[2:]):
        ref = statistics.median(results[pair[0]]["times"])
        for name in pair:
            r = results[name]
            t = statistics.median(r["times"])
            b = budget.get(name)
            under = "" if b is None else f"trains ({len(b['losses'])} iterations)" \
                if b["rc"] == 0 else f"fails: {b['error']}"
            lines.append([name, f"{t:.0f}", f"{t / ref:.2f}x", f"{r['steady'] * mb:.0f}",
                          f"{r['rss'] * mb:.0f}", f"{r['vm'] * mb:.0f}", under])
        same &= all(r[pair[0]]["losses"] == r[pair[1]]["losses"] for r in rounds)
    print(harness.markdown_table(
        ["run", "step ms (median, iters 3+)", "ratio", "steady RSS MiB", "peak RSS MiB",
         "VmPeak MiB", f"under RLIMIT_AS {limit * mb:.0f} MiB"], lines, align="lrrrrrl"))
    for pair, target in ((names[:2], states - slots),
                         (names[2:], states + 4 * n_params - slots)):
        a, b = results[pair[0]], results[pair[1]]
        print(f"{pair[1]}: steady RSS falls by {(a['steady'] - b['steady']) * mb:.0f} MiB, "
              f"peak RSS by {(a['rss'] - b['rss']) * mb:.0f} MiB (target: the bytes moved to "
              f"files less the slots, {target * mb:.0f} MiB)")
    print(f"losses identical within each pair (NVMe vs host memory): {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
