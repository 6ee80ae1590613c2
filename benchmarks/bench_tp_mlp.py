"""Cost of tensor parallelism on this machine: a tp=2 MLP against the dense MLP.

ColumnParallelLinear -> GELU -> RowParallelLinear at tp=2 (two gloo processes, one thread
each) against the same MLP as plain ``torch.nn`` in one process with one thread, same shapes,
forward + backward. Each tp rank does half the FLOPs, plus one all-reduce of the [s, b, h]
output forward and one of the input gradient backward. Prints a table and the ratio; it records
what tp communication costs here, it is not a target.

    python benchmarks/bench_tp_mlp.py [--seq 512 --batch 4 --hidden 1024 --iters 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, REPO)

from benchmarks import harness  # noqa: E402


def _time_steps(step, iters, warmup=2):
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def dense(args):
    torch.set_num_threads(1)
    h, f = args.hidden, 4 * args.hidden
    fc1, fc2 = torch.nn.Linear(h, f), torch.nn.Linear(f, h)
    x = torch.randn(args.seq, args.batch, h, requires_grad=True)

    def step():
        y = fc2(F.gelu(fc1(x)))
        y.sum().backward()

    return _time_steps(step, args.iters)


def _tp_rank(args):
    """One tp rank (``harness.spawn``): its median step time and the bytes one step sends."""
    from megazero.distributed.parallel_state import ParallelState
    from megazero.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    ps = ParallelState.build(tp_size=dist.get_world_size())
    h, f = args.hidden, 4 * args.hidden
    fc1 = ColumnParallelLinear(h, f, tp_group=ps.tp_group, gather_output=False)
    fc2 = RowParallelLinear(f, h, tp_group=ps.tp_group, input_is_parallel=True)
    x = torch.randn(args.seq, args.batch, h, requires_grad=True)

    def step():
        y, _ = fc2(F.gelu(fc1(x)[0]))
        y.sum().backward()

    dist.barrier()
    t = _time_steps(step, args.iters)
    ps.comm.stats.reset()
    step()
    return t, ps.comm.stats.total_sent()


def tensor_parallel(args, world=2):
    """(the slowest rank's median step time, the bytes rank 0 sends in one step)."""
    ranks = harness.spawn(_tp_rank, world, args, timeout=600, pg_timeout=300)
    return max(t for t, _ in ranks), ranks[0][1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    tokens = args.seq * args.batch
    t_dense = dense(args)
    t_tp, sent = tensor_parallel(args)
    print(f"MLP fwd+bwd, s={args.seq} b={args.batch} h={args.hidden} ffn={4 * args.hidden}, "
          f"median of {args.iters} (torch {torch.__version__}, gloo)")
    print(f"{'layout':<28}{'step ms':>10}{'tokens/s':>12}{'MB sent/rank':>14}")
    print(f"{'dense, 1 proc x 1 thread':<28}{t_dense * 1e3:>10.1f}{tokens / t_dense:>12.0f}"
          f"{0:>14.1f}")
    print(f"{'tp=2, 2 procs x 1 thread':<28}{t_tp * 1e3:>10.1f}{tokens / t_tp:>12.0f}"
          f"{sent / 1e6:>14.1f}")
    print(f"speed-up of tp=2 over dense: {t_dense / t_tp:.2f}x (ideal 2.00x without "
          "communication)")


if __name__ == "__main__":
    main()
