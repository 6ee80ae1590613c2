"""Naive data parallelism against ZeroOptimizer stages 0-2: step time, collectives, memory.

One data-parallel training step of the same model on real gloo process groups (dp worker
processes spawned by ``harness.spawn``: ``torch.multiprocessing``, a ``TCPStore`` on a free
port, one thread per rank: ``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=1``), under

* ``naive``: ``megazero.data_parallel.naive.DataParallelNaive`` with ``torch.optim.AdamW`` on
  every rank: one all-reduce per parameter after backward, the whole optimizer everywhere
  (the baseline);
* ``zero0``, ``zero1``, ``zero2``: ``megazero.data_parallel.ZeroOptimizer`` with
  ``OptimizerConfig(zero_stage=s, optimizer="adam")``: flat buckets of
  ``--bucket-size`` elements, all-reduced (stage 0) or reduce-scattered into the owned chunk
  (stages 1-2; stage 2 as soon as backward completes a bucket) and the updated chunks
  all-gathered after the step.

The model is a plain ``torch.nn`` stack, ``--layers`` x (Linear(hidden, hidden), GELU), built
from the same seed for every contender; each rank feeds its own micro-batch of ``--batch``
rows (an MSE loss against a random target; the data of every step is made before timing). Both
optimizers use the same AdamW hyper-parameters (no weight decay on biases, clipping at
``--clip-grad``), so every contender must reach the same losses and parameters: the table
prints the loss after the steps (on a fixed batch, averaged over the dp ranks) and the largest
difference of any parameter against the naive run of the same round.

A step is ``opt.zero_grad(); loss = mse(model(x), y); loss.backward();
opt.finish_grad_sync(); opt.step()``, entered by every rank after a barrier (not counted).
Each rank times the step and its phases (zero_grad + forward + backward, finish_grad_sync,
step); a step's time is that of the slowest rank, each phase's likewise. Per round every
contender builds a fresh model and optimizer, runs ``--warmup`` steps and then ``--steps``
measured ones; the contenders run one after another within a round, the order rotated each
round, over ``--rounds`` rounds. Reported: the median over all measured steps of all rounds,
and the range of the per-round medians. Collective calls and bytes are ``ps.comm.stats``
(``CommStats``: ring-algorithm bytes this rank sends) over the measured steps, divided by
their number; ``DataParallelNaive``'s all-reduces go through ``megazero.distributed.comm``
and count into the same ``ParallelState``'s communicator. Model states per rank are
``opt.memory_report()`` after the steps (params + grads + fp32 main params + optimizer
states; the model is fp32, so there is no separate main copy).

    python benchmarks/bench_dp_naive.py [--dp 2 [4]] [--layers 8 --hidden 1024 --batch 64] \
        [--warmup 2 --steps 3 --rounds 10] [--stages 0 1 2] [--bucket-size 25000000] \
        [--torch-adam default|foreach|fused] [--ring auto|ring|native] [--json FILE]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, REPO)

from benchmarks import harness  # noqa: E402

PHASES = ("fwd_bwd", "sync", "opt_step")
KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
SEED = 1234


def _model(args) -> torch.nn.Module:
    torch.manual_seed(SEED)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def _batch(args, index: int, rank: int, world: int):
    g = torch.Generator().manual_seed(SEED + index * world + rank)
    return (torch.randn(args.batch, args.hidden, generator=g),
            torch.randn(args.batch, args.hidden, generator=g))


def _optimizer(kind: str, model, args, ps):
    from megazero.config import OptimizerConfig
    from megazero.data_parallel import ZeroOptimizer
    from megazero.data_parallel.naive import DataParallelNaive
    from megazero.data_parallel.params import no_weight_decay

    if kind == "naive":
        decay, no_decay = [], []
        for name, p in model.named_parameters():
            (no_decay if no_weight_decay(name, p) else decay).append(p)
        impl = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}
        adamw = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                                  **impl[args.torch_adam])
        return DataParallelNaive(model, ps, adamw, clip_grad=args.clip_grad)
    config = OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=args.weight_decay,
                             adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8,
                             clip_grad=args.clip_grad, zero_stage=int(kind[-1]),
                             zero_reduce_bucket_size=args.bucket_size)
    return ZeroOptimizer([model], config, ps)


def _run_contender(kind, args, ps, data, eval_batch):
    """Fresh model and optimizer; warm-up, then the measured steps. Per-step phase times of
    this rank, comm stats of the measured steps, memory report, final loss and params."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model(args)
    opt = _optimizer(kind, model, args, ps)
    times = []
    for i, (x, y) in enumerate(data):
        dist.barrier()
        if i == args.warmup:
            ps.comm.stats.reset()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        t1 = time.perf_counter()
        opt.finish_grad_sync()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if i >= args.warmup:
            times.append((t3 - t0, t1 - t0, t2 - t1, t3 - t2))
    stats = ps.comm.stats.snapshot()
    memory = opt.memory_report()
    with torch.no_grad():
        final = F.mse_loss(model(eval_batch[0]), eval_batch[1]).reshape(1)
    dist.all_reduce(final)  # plain torch.distributed: not in ps.comm's counts
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]) \
        if rank == 0 else None
    del opt, model
    gc.collect()
    return {"times": times, "stats": stats, "memory": memory,
            "loss": float(final) / world, "params": params}


def _rank(args):
    """One rank (``harness.spawn``): every contender in every round in these processes; rank 0
    returns what every rank measured."""
    from megazero.distributed.parallel_state import ParallelState

    rank, world = dist.get_rank(), dist.get_world_size()
    ps = ParallelState.build(ring_policy=args.ring)
    n_steps = args.warmup + args.steps
    data = [_batch(args, i, rank, world) for i in range(n_steps)]
    eval_batch = _batch(args, 10_000, 0, 1)  # the same on every rank
    contenders = ["naive"] + [f"zero{s}" for s in args.stages]
    results = {k: {"times": [], "loss": [], "param_diff": []} for k in contenders}
    for rnd in range(args.rounds):
        params = {}
        for kind in harness.rotated(contenders, rnd):
            r = _run_contender(kind, args, ps, data, eval_batch)
            res = results[kind]
            res["times"].append(r["times"])
            res["loss"].append(r["loss"])
            res["stats"], res["memory"] = r["stats"], r["memory"]
            params[kind] = r["params"]
        if rank == 0:
            for kind in contenders:
                diff = (params[kind] - params["naive"]).abs().max().item()
                results[kind]["param_diff"].append(diff)
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        return {"ranks": gathered, "decisions": ps.comm.ring_decisions(),
                "psi": sum(p.numel() for p in _model(args).parameters())}
    return None


def run(args, world):
    return harness.spawn(_rank, world, args, timeout=args.timeout)[0]


def summarize(value, args):
    """Per contender: slowest-rank step and phase times (median over all measured steps,
    range of the per-round medians), rank 0's comm stats per step, worst rank's memory."""
    ranks = value["ranks"]
    rows = {}
    for kind, res0 in ranks[0].items():
        per_round = zip(*(r[kind]["times"] for r in ranks))  # per round: every rank's steps
        times = harness.step_summary([harness.slowest_rank(steps) for steps in per_round],
                                     PHASES)
        calls = {k: res0["stats"].get(k, {}).get("calls", 0) / args.steps for k in KINDS}
        sent = max(sum(v["sent"] for v in r[kind]["stats"].values()) for r in ranks)
        mem = max((r[kind]["memory"] for r in ranks),
                  key=lambda m: sum(m[k] for k in ("params", "grads", "main_params",
                                                   "optimizer_states")))
        rows[kind] = {**times, "calls": calls, "sent": sent / args.steps, "memory": mem,
                      "states": sum(mem[k] for k in ("params", "grads", "main_params",
                                                     "optimizer_states")),
                      "loss": res0["loss"], "param_diff": max(res0["param_diff"])}
    return rows


def _path(decisions) -> str:
    """The ring-or-native choice of ``comm`` for reduce-scatter/all-gather on the dp group."""
    if not decisions:
        return "native (buffers under comm.RING_MIN_BYTES)"
    (d,) = decisions.values()
    return "/".join("ring" if d[k] else "native" for k in ("reduce_scatter", "all_gather"))


def _calls(c):
    return "/".join(f"{c[k]:g}" for k in ("all_reduce", "reduce_scatter", "all_gather"))


def print_table(rows, dp, psi, args, decisions):
    naive = rows["naive"]
    mb = 1e6
    print(f"\ndp={dp}: {args.layers} x Linear({args.hidden}, {args.hidden}) + GELU, "
          f"{psi / 1e6:.2f}M params (fp32), micro-batch {args.batch} rows per rank, "
          f"{args.rounds} rounds x {args.steps} measured steps (after {args.warmup} warm-up); "
          f"torch AdamW {args.torch_adam}; bucket {args.bucket_size} elements; "
          f"RS/AG path {_path(decisions)}")
    lines = []
    for kind, r in rows.items():
        m, ph = r["memory"], r["phases"]
        lo, hi = r["range"]
        breakdown = "/".join(f"{m[k] / mb:.1f}" for k in ("params", "grads", "main_params",
                                                         "optimizer_states"))
        lines.append([kind, f"{r['step'] * 1e3:.1f}", f"{lo * 1e3:.1f}-{hi * 1e3:.1f}",
                      f"{naive['step'] / r['step']:.2f}x", f"{ph['fwd_bwd'] * 1e3:.1f}",
                      f"{ph['sync'] * 1e3:.1f}", f"{ph['opt_step'] * 1e3:.1f}",
                      _calls(r["calls"]), f"{r['sent'] / mb:.1f}",
                      f"{r['states'] / mb:.1f} ({breakdown})",
                      f"{r['states'] / naive['states']:.2f}x"])
    print(harness.markdown_table(
        ["contender", "step ms (median)", "round medians", "speed-up vs naive", "fwd+bwd ms",
         "grad sync ms", "opt step ms", "calls/step AR/RS/AG", "MB sent/step",
         "model states MB (p/g/main/opt)", "states vs naive"], lines, align="lrrrrrrlrlr"))
    print("\nloss after the steps (fixed batch, dp mean; the distinct values over the rounds) "
          "and max |param - naive param| of the same round")
    for kind, r in rows.items():
        losses = ", ".join(f"{x:.7f}" for x in sorted(set(r["loss"])))
        print(f"  {kind:<6} loss {losses}   max param diff {r['param_diff']:.2e}")
    spread = max(abs(x - y) / abs(y) for r in rows.values()
                 for x, y in zip(r["loss"], naive["loss"]))
    print(f"  largest relative loss difference against naive: {spread:.2e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[2])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2],
                        choices=[0, 1, 2])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64, help="rows per rank and step")
    harness.add_round_args(parser, warmup=2, steps=3, rounds=10, timeout=900)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--clip-grad", type=float, default=1.0)
    parser.add_argument("--bucket-size", type=int, default=25_000_000,
                        help="--zero-reduce-bucket-size (elements)")
    parser.add_argument("--torch-adam", choices=["default", "foreach", "fused"],
                        default="default", help="implementation of the baseline's AdamW")
    parser.add_argument("--ring", choices=["auto", "ring", "native"], default="auto",
                        help="ring policy for gloo reduce-scatter/all-gather")
    args = parser.parse_args()
    print(harness.start_line())
    t_start = time.perf_counter()
    worlds = []
    for dp in args.dp:
        value = run(args, dp)
        rows = summarize(value, args)
        print_table(rows, dp, value["psi"], args, value["decisions"])
        worlds.append({"dp": dp, "psi": value["psi"], "rs_ag_path": _path(value["decisions"]),
                       "rows": rows})
    print(harness.end_line(t_start))
    if args.json:
        harness.write_json(args.json, {"benchmark": "bench_dp_naive", "args": vars(args),
                                       "worlds": worlds})


if __name__ == "__main__":
    main()
