"""Pipeline bubble: measured idle fraction of the real schedules against the theory.

Runs megazero's 1F1B and interleaved schedules (``get_forward_backward_func``, called with the
keyword arguments ``training.train_step`` passes) on p real gloo processes, with a synthetic
stage: a module whose forward sleeps ``--fwd-ms`` and whose backward sleeps twice that (a
custom autograd Function), so compute does not contend for this machine's cores and the
schedule alone sets the idle time. With v chunks per rank each chunk sleeps 1/v of it, as when
a stage's layers are split into chunks. Every iteration is recorded with ``PipelineTrace`` and
measured with ``megazero.tools.pipeline_trace.bubble_fraction``: per stage, idle time over
the iteration's span on the pipeline, then the mean over stages.

Theory. Uniform stages with forward f and backward b: 1F1B finishes in (m + p - 1)(f + b),
each stage is busy m(f + b), so every stage idles (p-1)/(m+p-1), whatever b/f (here b = 2f).
Interleaved with v chunks of f/v, b/v: the fill and drain shrink to (p-1)(f+b)/v, giving
(p-1)/(v m + p-1). That is the formula in the ``theory`` column.

Model. The same schedule code is replayed without processes (each rank's sequence of
forwards, backwards and p2p exchanges captured through a recording P2P), then simulated with
gloo's rendezvous semantics (a send completes once the matching receive is posted), the
measured forward/backward durations and the measured cost of one p2p exchange. With zero
p2p cost it reproduces the theory exactly (printed as a check); with the measured cost it
shows how much of the gap to the theory is communication latency.

Overlap. Interleaved rows run with ``--overlap-p2p-communication`` off (``ovl no``: every
exchange waited for after each step) and on (``ovl yes``: the activation exchange in flight
during the backward, the gradient exchange during the next forward); 1F1B has no overlap.

Real compute. One more row trains a small GPT-2 (``pretrain`` with ``--pipeline-trace``, mock
data) on 2 stages, where both processes compute on this machine's shared cores; its model
column uses each stage's own measured forward/backward times (the last stage also runs the
output layer and the loss, so stages are not uniform).

    python benchmarks/bench_pipeline.py [--fwd-ms 20 --iters 4 --repeats 3] [--skip-real]
        [--png benchmarks/pipeline_1f1b_p4_m8.png]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from unittest import mock

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, REPO)

from benchmarks import harness  # noqa: E402
from megazero.pipeline_parallel import interleaved, one_f_one_b  # noqa: E402
from megazero.pipeline_parallel.p2p import P2P  # noqa: E402
from megazero.pipeline_parallel.schedules import get_forward_backward_func  # noqa: E402
from megazero.tools.pipeline_trace import bubble_fraction, theory_bubble, write_png  # noqa: E402

SHAPE = (16, 2, 32)  # [s, b, h] activations between stages: small, so p2p is latency-bound
# A small GPT-2 for the real-compute row: p=2, m=8 (global batch 32 / micro-batch 4).
REAL_ARGV = ("--mock-data --vocab-size 1024 --num-layers 4 --hidden-size 256 "
             "--num-attention-heads 4 --seq-length 128 --micro-batch-size 4 "
             "--global-batch-size 32 --train-iters {iters} --lr 1e-4 --lr-warmup-iters 0 "
             "--log-interval 100 --eval-iters 0 --pipeline-model-parallel-size 2 "
             "--pipeline-trace {trace}")


# ---- the synthetic stage -----------------------------------------------------------------
class _Sleep(torch.autograd.Function):
    """Forward: y = x * w after sleeping fwd_s. Backward: the exact gradients after bwd_s."""

    @staticmethod
    def forward(ctx, x, w, fwd_s, bwd_s):  # x [s, b, h], w [h]
        time.sleep(fwd_s)
        ctx.save_for_backward(x, w)
        ctx.bwd_s = bwd_s
        return x * w

    @staticmethod
    def backward(ctx, grad):  # grad [s, b, h]
        x, w = ctx.saved_tensors
        time.sleep(ctx.bwd_s)
        return grad * w, (grad * x).sum((0, 1)), None, None


class SleepStage(torch.nn.Module):
    """One model chunk: what the schedules need of a model (set_input_tensor, pre/post)."""

    def __init__(self, pre_process, post_process, fwd_s, bwd_s, hidden):
        super().__init__()
        self.pre_process, self.post_process = pre_process, post_process
        self.fwd_s, self.bwd_s = fwd_s, bwd_s
        self.weight = torch.nn.Parameter(torch.ones(hidden))
        self.input_tensor = None

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def forward(self, x):
        x = x if self.pre_process else self.input_tensor
        return _Sleep.apply(x, self.weight, self.fwd_s, self.bwd_s)


def forward_step(data_iterator, model):
    x = next(data_iterator) if model.pre_process else None

    def loss_func(output):
        loss = output.mean()
        return loss, {"lm loss": loss.detach().item()}

    return model(x), loss_func


def make_chunks(ps, v, fwd_s, bwd_s):
    return [SleepStage(ps.is_first_stage and c == 0, ps.is_last_stage and c == v - 1,
                       fwd_s / v, bwd_s / v, SHAPE[-1]) for c in range(v)]


def run_schedule(ps, chunks, m, trace=None, overlap=False):
    """One iteration, called as training.train_step calls it."""
    v = len(chunks)
    fwd_bwd = get_forward_backward_func(ps.pp_size, v if v > 1 else None)
    data = itertools.repeat(torch.randn(SHAPE))
    return fwd_bwd(forward_step_func=forward_step, data_iterator=data, model=chunks,
                   num_microbatches=m, ps=ps, loss_scale=1.0, no_sync=None,
                   tensor_shape=SHAPE, dtype=torch.float32, trace=trace,
                   overlap_p2p_comm=overlap)


# ---- the measured runs (one process per stage) --------------------------------------------
def _p2p_cost(ps, n=100):
    """Median one-way cost of one exchange (stage 0 <-> 1 ping-pong of an activation)."""
    p2p = P2P(ps, SHAPE)
    x = torch.randn(SHAPE)
    times = []
    dist.barrier()
    for _ in range(n):
        t = time.perf_counter()
        if ps.pp_rank == 0:
            p2p.communicate(send_next=x)
            p2p.communicate(recv_next=True)
        elif ps.pp_rank == 1:
            p2p.communicate(recv_prev=True)
            p2p.communicate(send_prev=x)
        times.append(time.perf_counter() - t)
    return statistics.median(times) / 2


def _rank(configs, args, outdir):
    """One stage's process (``harness.spawn``): the synthetic schedules, traces to files."""
    from megazero.distributed.parallel_state import ParallelState
    from megazero.pipeline_parallel.trace import PipelineTrace

    rank, world = dist.get_rank(), dist.get_world_size()
    base = ParallelState.build(tp_size=1, pp_size=world)
    fwd_s = args.fwd_ms / 1e3
    costs = []
    for rep in range(args.repeats):  # repeats outermost: machine noise spreads over configs
        costs.append(_p2p_cost(base))
        for m, v, o in configs:
            ps = dataclasses.replace(base, virtual_pp_size=v if v > 1 else None)
            chunks = make_chunks(ps, v, fwd_s, 2 * fwd_s)
            trace = PipelineTrace(ps)
            for it in range(1 + args.iters):  # iteration 0: warm-up, not measured
                dist.barrier()
                trace.begin_iteration(it)
                run_schedule(ps, chunks, m, trace, overlap=o)
            trace.save(os.path.join(outdir, f"p{world}_m{m}_v{v}_o{int(o)}_r{rep}.json"))
    with open(os.path.join(outdir, f"p2p_p{world}_rank{rank}.json"), "w") as f:
        json.dump(costs, f)


def run_world(p, configs, args, outdir, worker=_rank):
    harness.spawn(worker, p, configs, args, outdir, timeout=3600)


def _real_rank(configs, args, outdir):
    """One stage of the real GPT-2 (``harness.spawn``): ``pretrain`` with its trace."""
    import logging

    import pretrain_gpt2
    from megazero.arguments import parse_args
    from megazero.training import pretrain

    logging.disable(logging.INFO)  # the log line every 100 iterations is noise here
    world = dist.get_world_size()
    for rep in range(args.repeats):
        trace = os.path.join(outdir, f"real_r{rep}.json")
        argv = REAL_ARGV.format(iters=1 + args.iters, trace=trace).split()
        pretrain(pretrain_gpt2.train_valid_test_datasets_provider,
                 pretrain_gpt2.model_provider, pretrain_gpt2.forward_step,
                 parse_args(argv, world_size=world),
                 zero3_unit_policy=pretrain_gpt2.zero3_unit_policy)


# ---- the model: replay the schedule, simulate it --------------------------------------------
@dataclasses.dataclass
class _FakePS:
    pp_size: int
    pp_rank: int
    virtual_pp_size: int | None
    device: torch.device = torch.device("cpu")

    @property
    def is_first_stage(self):
        return self.pp_rank == 0

    @property
    def is_last_stage(self):
        return self.pp_rank == self.pp_size - 1


def capture_program(p, rank, m, v, overlap=False):
    """The sequence of ('F'|'B', microbatch, chunk), ('P', id, sends, recvs) (an exchange
    posted) and ('W', id) (waited for) of one rank."""
    program = []

    class Pending:
        def __init__(self, key, recv_prev, recv_next):
            self.key, self.recv_prev, self.recv_next = key, recv_prev, recv_next

        def wait(self):
            program.append(("W", self.key))
            prev = torch.zeros(SHAPE, requires_grad=True) if self.recv_prev else None
            return prev, (torch.zeros(SHAPE) if self.recv_next else None)

    class Recorder(P2P):
        def post(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
            key = len(program)
            program.append(("P", key, send_next is not None, send_prev is not None,
                            recv_prev, recv_next))
            return Pending(key, recv_prev, recv_next)

    class Spans:
        def span(self, kind, microbatch, chunk=0):
            program.append((kind[0].upper(), microbatch, chunk))
            return contextlib.nullcontext()

    ps = _FakePS(p, rank, v if v > 1 else None)
    with mock.patch.object(one_f_one_b, "P2P", Recorder), \
            mock.patch.object(interleaved, "P2P", Recorder):
        run_schedule(ps, make_chunks(ps, v, 0.0, 0.0), m, Spans(), overlap=overlap)
    return program


def simulate(p, m, v, fwd_s, bwd_s, cost_s, overlap=False):
    """Start/end of every forward/backward when each rank runs its captured program: compute
    takes fwd_s/bwd_s (per chunk; a number, or a list with one per rank), an exchange
    completes ``cost_s`` after the last of its own posting and its partners' (FIFO per
    (src, dst, direction) channel), and a wait returns when its exchange has completed.
    Returns a trace."""
    fwd_s = fwd_s if isinstance(fwd_s, list) else [fwd_s] * p
    bwd_s = bwd_s if isinstance(bwd_s, list) else [bwd_s] * p
    programs = [capture_program(p, r, m, v, overlap) for r in range(p)]
    posts = defaultdict(lambda: ([], []))  # channel -> (send post times, recv post times)
    pos, clock, pending = [0] * p, [0.0] * p, [{} for _ in range(p)]
    events = [[] for _ in range(p)]
    while any(pos[r] < len(programs[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pos[r] < len(programs[r]):
                op = programs[r][pos[r]]
                if op[0] in "FB":
                    dur = fwd_s[r] if op[0] == "F" else bwd_s[r]
                    kind = "forward" if op[0] == "F" else "backward"
                    events[r].append({"iteration": 0, "kind": kind, "microbatch": op[1],
                                      "chunk": op[2], "start": clock[r],
                                      "end": clock[r] + dur})
                    clock[r] += dur
                elif op[0] == "P":
                    pending[r][op[1]] = _post(op[1:], r, p, clock[r], posts)
                else:
                    done = _completion(pending[r][op[1]], posts)
                    if done is None:
                        break  # a partner has not posted yet
                    clock[r] = max(clock[r], done + cost_s)
                    del pending[r][op[1]]
                pos[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("simulated schedule deadlocked")
    ranks = [{"rank": r, "tp_rank": 0, "dp_rank": 0, "pp_rank": r, "pp_size": p,
              "virtual_pp_size": v, "events": events[r]} for r in range(p)]
    return {"format": "megazero-pipeline-trace-v1", "ranks": ranks}


def _post(op, r, p, t, posts):
    """Register an exchange's sends/receives; return what it waits for."""
    _, send_next, send_prev, recv_prev, recv_next = op  # (id, flags...)
    nxt, prv = (r + 1) % p, (r - 1) % p
    waits = []
    for active, channel, side in ((send_next, (r, nxt, "act"), 0),
                                  (recv_prev, (prv, r, "act"), 1),
                                  (send_prev, (r, prv, "grad"), 0),
                                  (recv_next, (nxt, r, "grad"), 1)):
        if active:
            mine = posts[channel][side]
            mine.append(t)
            waits.append((channel, 1 - side, len(mine) - 1))
    return t, waits


def _completion(pending, posts):
    t, waits = pending
    for channel, side, k in waits:
        other = posts[channel][side]
        if len(other) <= k:
            return None
        t = max(t, other[k])
    return t


# ---- report ------------------------------------------------------------------------------
def measure(traces, first, iters):
    """The mean over stages of the bubble of each iteration first..first+iters-1 of each
    trace; and the median forward and backward time of each stage."""
    bubbles = []
    durs = defaultdict(list)
    for trace in traces:
        for it in range(first, first + iters):
            stages = bubble_fraction(trace, it)
            bubbles.append(sum(stages.values()) / len(stages))
        for r in trace["ranks"]:
            for e in r["events"]:
                if e["iteration"] >= first:
                    durs[(e["kind"], r["pp_rank"])].append(e["end"] - e["start"])
    p = len(traces[0]["ranks"])
    fwd = [statistics.median(durs[("forward", s)]) for s in range(p)]
    bwd = [statistics.median(durs[("backward", s)]) for s in range(p)]
    return bubbles, fwd, bwd


def _row(name, p, m, v, bubbles, fwd, bwd, cost, overlap=False):
    """Print one table row; return (measured, relative error against the theory)."""
    theory = theory_bubble(p, m, v)
    model = statistics.mean(bubble_fraction(simulate(p, m, v, fwd, bwd, cost, overlap),
                                            0).values())
    measured = statistics.median(bubbles)
    err = measured / theory - 1
    spread = f"({min(bubbles):.3f}-{max(bubbles):.3f})"
    times = f"{statistics.median(fwd) * 1e3:.1f}/{statistics.median(bwd) * 1e3:.1f}"
    ovl = "-" if v == 1 else ("yes" if overlap else "no")
    print(f"{name:<10}{p:>2}{m:>4}{v:>3}{ovl:>5}{times:>13}{theory:>8.3f}{model:>7.3f}"
          f"{measured:>10.3f}{spread:>15}{err:>+11.1%}{measured / model - 1:>+10.1%}")
    return measured, err


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fwd-ms", type=float, default=20.0,
                        help="forward sleep of a stage (backward: twice that)")
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--virtual", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--overlap", choices=["both", "on", "off"], default="both",
                        help="interleaved rows with --overlap-p2p-communication on, off or both")
    parser.add_argument("--iters", type=int, default=4, help="measured iterations per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per config, interleaved")
    parser.add_argument("--skip-real", action="store_true",
                        help="skip the real-compute GPT-2 row")
    parser.add_argument("--png", default=None,
                        help="also draw this PNG of the p=4 m=8 1F1B run (last repeat)")
    args = parser.parse_args()
    outdir = tempfile.mkdtemp(prefix="bench_pipeline_")
    overlaps = {"both": [False, True], "on": [True], "off": [False]}[args.overlap]
    configs = [(m, v, o) for v in args.virtual for o in (overlaps if v > 1 else [False])
               for m in args.micro_batches]
    t_start = time.time()
    for p in args.pp:
        run_world(p, [(m, v, o) for m, v, o in configs if v == 1 or m % p == 0], args, outdir)
    if not args.skip_real:
        run_world(2, None, args, outdir, worker=_real_rank)
    costs = []
    for p in args.pp:
        with open(os.path.join(outdir, f"p2p_p{p}_rank0.json")) as f:
            costs += json.load(f)
    cost = statistics.median(costs)

    print(f"synthetic stage: forward {args.fwd_ms:g} ms, backward {2 * args.fwd_ms:g} ms per "
          f"stage (1/v of it per chunk); activations {list(SHAPE)} fp32; gloo, one process "
          f"per stage; median over {args.repeats} runs x {args.iters} iterations; "
          f"torch {torch.__version__}; {time.time() - t_start:.0f} s")
    print(f"p2p exchange (one way, median of {len(costs)} ping-pong sets): {cost * 1e3:.2f} ms")
    print("theory = (p-1)/(v*m+p-1); model = the same schedule simulated with the measured "
          "F/B times and p2p cost;\nmeasured = idle/total per stage over the iteration, mean "
          "of stages, median (min-max) over iterations;\nvs theory, vs model = measured / "
          "theory - 1, measured / model - 1")
    head = (f"{'stage':<10}{'p':>2}{'m':>4}{'v':>3}{'ovl':>5}{'F/B ms':>13}{'theory':>8}"
            f"{'model':>7}{'measured':>10}{'(min-max)':>15}{'vs theory':>11}{'vs model':>10}")
    print(head)
    print("-" * len(head))
    worst, png_pick = 0.0, None
    for p in args.pp:
        for m, v, o in configs:
            if v > 1 and m % p:
                continue
            # the schedule itself, replayed with zero p2p cost, gives exactly the theory
            exact = simulate(p, m, v, args.fwd_ms / 1e3 / v, 2 * args.fwd_ms / 1e3 / v, 0.0, o)
            check = statistics.mean(bubble_fraction(exact, 0).values())
            assert abs(check - theory_bubble(p, m, v)) < 1e-9, (p, m, v, check)
            traces = []
            for rep in range(args.repeats):
                with open(os.path.join(outdir, f"p{p}_m{m}_v{v}_o{int(o)}_r{rep}.json")) as f:
                    traces.append(json.load(f))
            bubbles, fwd, bwd = measure(traces, 1, args.iters)
            measured, err = _row("synthetic", p, m, v, bubbles, fwd, bwd, cost, o)
            worst = max(worst, abs(err))
            if args.png and (p, m, v) == (4, 8, 1):
                # draw the most typical iteration: the one nearest the median
                k = min(range(len(bubbles)), key=lambda i: abs(bubbles[i] - measured))
                png_pick = (traces[k // args.iters], 1 + k % args.iters)
    print(f"worst synthetic error against the theory: {worst:.1%} (target: within 10%); "
          "the schedule replayed with zero p2p cost equals the theory in every row")
    if not args.skip_real:
        traces = []
        for rep in range(args.repeats):
            with open(os.path.join(outdir, f"real_r{rep}.json")) as f:
                traces.append(json.load(f))
        bubbles, fwd, bwd = measure(traces, 2, args.iters)
        print("real GPT-2 (4 layers, h 256, s 128, micro-batch 4, vocab 1024; 2 processes on "
              "the shared cores): F/B ms per stage " + ", ".join(
                  f"{f * 1e3:.1f}/{b * 1e3:.1f}" for f, b in zip(fwd, bwd)))
        _row("GPT-2", 2, 8, 1, bubbles, fwd, bwd, cost)
    if png_pick is not None:
        info = write_png(png_pick[0], args.png, png_pick[1])
        print(f"wrote {args.png}: p=4 m=8 1F1B, the iteration nearest the median "
              f"(bubble {info['bubble']:.3f})")


if __name__ == "__main__":
    main()
