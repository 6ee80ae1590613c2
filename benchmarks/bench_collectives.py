"""Reduce-scatter and all-gather on gloo: the backend's own against megazero's ring.

On n gloo processes (one thread each) and for fp32 buffers of B bytes, times

* gloo native reduce-scatter (``dist.reduce_scatter_single``) and megazero's ring
  reduce-scatter (``megazero.ring.Ring.reduce_scatter``, with ``overwrite_input=True`` as ZeRO
  calls it), B in, B/n out, over shared memory (``ring``: the processes share this host) and
  over TCP loopback (``tcp-ring``: ``transport="tcp"``, what ranks on different hosts use);
* gloo native all-gather (``dist.all_gather_single``) and the ring all-gathers, B/n in, B out;
* ``dist.all_reduce`` of the same B bytes: the baseline. A reduce-scatter moves half an
  all-reduce's bytes, so a good one should take about half its time.

Every repetition runs the five operations back to back in a rotated order (interleaved, so
machine noise hits all alike), each after a barrier; an operation's time in a repetition is
the slowest rank's, and the table shows the median over repetitions. Bus bandwidth is that of
the ring algorithm (nccl-tests' busbw): (n-1)/n B / t for reduce-scatter and all-gather,
2 (n-1)/n B / t for all-reduce; the ring moves exactly these bytes. Ratios: ring / native
time, and each operation's time / all-reduce's. Results are checked once per size (ring ==
native). The last lines show what ``megazero.ring.choose`` (the one-time measurement that
``comm`` runs per group, on a 16 MiB buffer) picks on each world.

    python benchmarks/bench_collectives.py [--world 2 4] [--sizes-mib 1 4 16 64] [--reps 9]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, REPO)

from benchmarks import harness  # noqa: E402

OPS = ("native reduce_scatter", "ring reduce_scatter", "tcp-ring reduce_scatter",
       "native all_gather", "ring all_gather", "tcp-ring all_gather", "all_reduce")


def _bench_size(numel, reps, warmup, ring, tcp, n):
    """This rank's times {operation: [seconds per measured repetition]} at ``numel``."""
    from megazero.distributed import comm

    big = torch.randn(numel)
    ring_in = big.clone()
    part = torch.empty(numel // n)
    gathered = torch.empty(numel)
    ar = torch.randn(numel)
    # correctness once: ring results equal gloo's
    ref = torch.empty_like(part)
    comm._native_rs(ref, big, None)
    ring.reduce_scatter(part, big.clone())
    torch.testing.assert_close(part, ref, rtol=1e-5, atol=1e-5)
    src = torch.randn(numel // n)
    comm._native_ag(gathered, src, None)
    ref_ag = gathered.clone()
    ring.all_gather(gathered, src)
    assert torch.equal(gathered, ref_ag), "ring all-gather differs from gloo's"
    tcp_part = torch.empty_like(part)
    tcp.reduce_scatter(tcp_part, big.clone())
    ring.reduce_scatter(part, big.clone())
    assert torch.equal(part, tcp_part), "the transports' reduce-scatters differ"

    fns = {
        "native reduce_scatter": lambda: comm._native_rs(part, big, None),
        "ring reduce_scatter": lambda: ring.reduce_scatter(part, ring_in, overwrite_input=True),
        "tcp-ring reduce_scatter": lambda: tcp.reduce_scatter(part, ring_in,
                                                              overwrite_input=True),
        "native all_gather": lambda: comm._native_ag(gathered, part, None),
        "ring all_gather": lambda: ring.all_gather(gathered, part),
        "tcp-ring all_gather": lambda: tcp.all_gather(gathered, part),
        "all_reduce": lambda: dist.all_reduce(ar),
    }
    times = {k: [] for k in OPS}
    for rep in range(warmup + reps):
        for name in harness.rotated(OPS, rep):
            dist.barrier()
            t0 = time.perf_counter()
            fns[name]()
            dt = time.perf_counter() - t0
            if rep >= warmup:
                times[name].append(dt)
            if name.endswith("ring reduce_scatter"):
                ring_in.copy_(big)  # keep values bounded (outside the timed region)
    return times


def _rank(args):
    """One rank (``harness.spawn``): its times per size, and what ``ring.choose`` picked."""
    from megazero.distributed import comm, ring

    world = dist.get_world_size()
    group = dist.group.WORLD
    r = ring.Ring(group)  # shared memory between these processes of one host
    tcp = ring.Ring(group, transport="tcp")
    results = {}
    for mib in args.sizes_mib:
        numel = int(mib * (1 << 20)) // 4
        numel -= numel % world
        results[mib] = _bench_size(numel, args.reps, args.warmup, r, tcp, world)
    choice = ring.choose(group, comm._native_rs, comm._native_ag, policy="auto")
    return results, choice


def run_world(world, args):
    """{MiB: {operation: median over repetitions of the slowest rank's time}}, and rank 0's
    ``ring.choose`` decision."""
    ranks = harness.spawn(_rank, world, args, timeout=1800)
    results = {mib: {k: statistics.median(harness.slowest_rank([r[mib][k] for r, _ in ranks]))
                     for k in OPS} for mib in ranks[0][0]}
    return results, ranks[0][1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--reps", type=int, default=9, help="timed repetitions per operation")
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    t_start = time.perf_counter()
    print(f"gloo collectives, fp32, {args.world} processes x 1 thread, median of {args.reps} "
          f"interleaved repetitions (slowest rank each), torch {torch.__version__}")
    print("| n | MiB | operation | ms | busbw GB/s | vs all_reduce | ring / native |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    choices = {}
    for world in args.world:
        results, choices[world] = run_world(world, args)
        for mib, t in results.items():
            nbytes = int(mib * (1 << 20)) // 4 * 4
            for name in OPS:
                moved = (2 if name == "all_reduce" else 1) * (world - 1) / world * nbytes
                ratio = ""
                if "ring" in name:
                    ratio = f"{t[name] / t[name.split()[-1].join(('native ', ''))]:.2f}"
                print(f"| {world} | {mib:g} | {name} | {t[name] * 1e3:.1f} | "
                      f"{moved / t[name] / 1e9:.2f} | {t[name] / t['all_reduce']:.2f} | "
                      f"{ratio} |")
    print()
    print("megazero.ring.choose (16 MiB, median of 3, decided on rank 0) -> what comm uses "
          f"for buffers >= {1 << 20} bytes:")
    for world, c in choices.items():
        tm = c["timings"]
        picks = {k: "ring" if c[k] else "native" for k in ("reduce_scatter", "all_gather")}
        print(f"  n={world}: reduce_scatter -> {picks['reduce_scatter']} (native "
              f"{tm['native_rs'] * 1e3:.1f} ms, ring {tm['ring_rs'] * 1e3:.1f} ms); "
              f"all_gather -> {picks['all_gather']} (native {tm['native_ag'] * 1e3:.1f} ms, "
              f"ring {tm['ring_ag'] * 1e3:.1f} ms)")
    print(f"total time {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
