"""megazero's ZeRO stages against PyTorch's data-parallel tools, side by side, on one GPT-2.

One run, interleaved rounds: within a round every contender runs once, one after another
(the order rotated each round), over ``--rounds`` rounds. Every contender trains the same model,
megazero's GPT-2 (``megazero.model.build_gpt_model_chunks`` with a ``ParallelState`` of tp=1,
pp=1: ``--layers`` layers of ``--hidden``, ``--heads`` heads, ``--seq`` tokens, ``--vocab``
tokens, no dropout, fp32), with data parallelism over ``--dp`` ranks on gloo. Each
contender-round runs in freshly spawned worker processes (``harness.spawn``:
``torch.multiprocessing`` spawn, a ``TCPStore`` on a free port, one thread per rank:
``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=1``), so that the peak RSS of a process is that
contender's own. The contenders:

* ``mz-zero0`` .. ``mz-zero3``: ``megazero.data_parallel.build_optimizer`` with
  ``OptimizerConfig(zero_stage=s, optimizer="adam")`` (ZeRO-3: the model is built on the meta
  device and the optimizer materialises each rank's partition, gathering one unit at a time by
  ``gpt_zero3_units``, as ``pretrain_gpt2.py`` does);
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` (``gradient_as_bucket_view=True``)
  with ``torch.optim.AdamW`` on every rank;
* ``ddp+zero-ro``: DDP with ``torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)`` (the
  reference of the ratio column);
* ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on every transformer layer and on the root
  (a ``cpu`` device mesh), ``torch.optim.AdamW`` over the sharded parameters;
* ``ds-zero1``, ``ds-zero2``: DeepSpeed ZeRO-1/2 (``peers_deepspeed.build_deepspeed``: a
  ``DeepSpeedEngine`` over that very ``GPTModel``, fp32, torch's AdamW as client optimizer,
  DeepSpeed's CPU accelerator on gloo), reported as SKIP when ``import deepspeed`` fails (it is
  not a dependency).

Initial weights: megazero's initialiser draws every element from (seed, parameter name, element
index), so building the model with one seed gives identical weights to every contender; the
torch contenders wrap that very ``GPTModel``, and ZeRO-3 fills its partitions from the same
seed. Every optimizer uses AdamW with lr ``--lr``, betas 0.9/0.999, eps 1e-8, weight decay 0
(so that the no-decay rules of the tools cannot differ) and no gradient clipping, at a constant
learning rate. Each rank's token batches (``--micro-batch`` sequences of ``--seq + 1`` random
tokens per step) are made before timing; the loss is the mean per-token cross entropy.

A step is ``opt.zero_grad(); loss = model(tokens, positions, labels=labels).mean();
loss.backward(); opt.finish_grad_sync(); opt.step()`` (torch contenders have no
``finish_grad_sync``: DDP and FSDP2 reduce the gradients inside backward, so their sync phase
is zero and the reduction shows in backward; a contender with its own ``opt.backward(loss)``
has it called instead of ``loss.backward()``: DeepSpeed's ``engine.backward``, which reduces
inside it too), entered by every rank after a barrier (not counted). A single micro-batch per
step, so no ``no_sync`` is involved. Each rank times the step and its phases (forward,
backward, sync, step); a step's time and each phase's are those of the slowest rank. Per
contender-round ``--warmup`` steps, then ``--steps`` measured ones. Reported per contender:

* step ms: median over all measured steps of all rounds; round medians: the range of the
  per-round medians; ratio: its step time over ``ddp+zero-ro``'s (below 1 = faster);
* phases: the median of each phase (slowest rank);
* peak RSS: ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` of each worker at the end of the
  contender-round, max over the ranks, median over the rounds (the whole process: Python,
  torch, megazero, data and activations included, identical for all but the model states);
* model states MB per rank (params/grads/optimizer states): megazero's
  ``optimizer.memory_report()`` (params + grads + fp32 main params + optimizer states; in fp32
  there is no separate main copy); torch: the bytes of the parameters, gradients and optimizer
  state tensors this rank holds (local shards for FSDP2's DTensors; DDP's gradients are views
  of its buckets, so the buckets are counted once), the max over ranks;
* buffers: what megazero's ``memory_report`` counts besides the model states (the staging
  slots of the gradient reduction, the ring's receive buffer or its shared-memory segments,
  gathered ZeRO-3 units);
* unaccounted MB: anonymous resident bytes (``RssAnon`` of ``/proc/self/status``, after
  glibc's ``malloc_trim`` returned freed pages; the clean file-backed pages of torch's library
  code that the first backward or Adam step pages in are not memory anybody holds) after the
  measured steps, minus those before the model was built, minus all
  the memory report accounts for (model states and buffers; the ring's shared-memory
  segments are resident as shared, not anonymous, pages): what the process keeps that
  nobody accounts for (module buffers, autograd and module bookkeeping, fragments the
  allocator cannot return); max over ranks, median over rounds. By default every contender's
  workers run with ``MKL_DISABLE_FAST_MM=1`` and ``MALLOC_ARENA_MAX=1`` (``ALLOCATOR_CACHES_OFF``):
  MKL's buffer cache (~9 MiB after the first GEMMs) and the freed fragments of glibc's
  per-thread arenas (gloo's threads, the ring's thread) are memory of nobody's objects, and
  would otherwise count here; ``--allocator-caches`` leaves both on;
* loss: after the measured steps, on a fixed batch (the same on every rank, dp mean), which
  should agree across contenders to float rounding since initial weights and data agree.

    python benchmarks/bench_peers.py [--dp 2] [--layers 4 --hidden 512 --heads 8 --seq 256 \
        --vocab 8192 --micro-batch 4] [--warmup 1 --steps 3 --rounds 5] \
        [--contenders mz-zero0 ... fsdp2] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, REPO)

from benchmarks import harness  # noqa: E402
from benchmarks.harness import Skip  # noqa: E402

PHASES = ("forward", "backward", "sync", "step")
MEGAZERO = ("mz-zero0", "mz-zero1", "mz-zero2", "mz-zero3")
TORCH = ("ddp", "ddp+zero-ro", "fsdp2")
DEEPSPEED = ("ds-zero1", "ds-zero2")
CONTENDERS = MEGAZERO + TORCH + DEEPSPEED
REFERENCE = "ddp+zero-ro"
SEED = 1234
BETAS, EPS = (0.9, 0.999), 1e-8


# Two allocator caches keep freed memory resident, whoever allocated it: MKL's "fast memory
# manager" keeps ~9 MiB of GEMM buffers per process after the first forward, and glibc gives
# every thread that allocates (gloo's and megazero's communication threads) an arena of its
# own, whose freed fragments malloc_trim cannot return (8 MiB after a few 4 MiB collectives).
# Turned off for every contender alike, so that "unaccounted" is memory held by objects.
ALLOCATOR_CACHES_OFF = {"MKL_DISABLE_FAST_MM": "1", "MALLOC_ARENA_MAX": "1"}


def _model_config(args):
    from megazero.config import ModelConfig

    return ModelConfig(num_layers=args.layers, hidden_size=args.hidden,
                       num_attention_heads=args.heads, seq_length=args.seq,
                       vocab_size=args.vocab, attention_dropout=0.0, hidden_dropout=0.0)


def _batch(args, index: int, rank: int, world: int):
    g = torch.Generator().manual_seed(SEED + index * world + rank)
    t = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=g)
    pos = torch.arange(args.seq).unsqueeze(0).expand(args.micro_batch, -1)
    return t[:, :-1].contiguous(), pos, t[:, 1:].contiguous()


def _nbytes(t) -> int:
    if t is None or not isinstance(t, torch.Tensor):
        return 0
    if hasattr(t, "to_local"):  # DTensor: this rank's shard
        t = t.to_local()
    return t.numel() * t.element_size()


def _torch_states(model, optim) -> dict:
    params = list(model.parameters())
    states = 0
    for st in optim.state.values():
        states += sum(_nbytes(v) for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
    return {"params": sum(_nbytes(p) for p in params),
            "grads": sum(_nbytes(p.grad) for p in params), "main_params": 0,
            "optimizer_states": states}


class _TorchOpt:
    """zero_grad/finish_grad_sync/step/memory_report over a torch model and optimizer."""

    def __init__(self, model, optim, inner):
        self.model, self.optim, self.inner = model, optim, inner

    def zero_grad(self):
        self.optim.zero_grad(set_to_none=True)

    def finish_grad_sync(self):
        pass

    def step(self):
        self.optim.step()

    def memory_report(self):
        states = _torch_states(self.model, self.inner)
        return states


def _adamw(params, args):
    """torch's best standard AdamW for the parameters: the fused kernel (CPU: torch >= 2.4;
    DTensor shards included), else the foreach one."""
    params = list(params)
    try:
        opt = torch.optim.AdamW(params, lr=args.lr, betas=BETAS, eps=EPS, weight_decay=0.0,
                                fused=True)
    except (RuntimeError, ValueError):
        opt = torch.optim.AdamW(params, lr=args.lr, betas=BETAS, eps=EPS, weight_decay=0.0,
                                foreach=True)
    return opt


def adamw_impl(opt) -> str:
    """Which AdamW implementation a torch optimizer (or ZeroRedundancyOptimizer) runs."""
    group = getattr(opt, "optim", opt).param_groups[0]
    return "fused" if group.get("fused") else "foreach" if group.get("foreach") else "for-loop"


def _build(kind, args, ps):
    """(module to call, optimizer-like object) of one contender, from the common seed."""
    from megazero.model import build_gpt_model_chunks, gpt_zero3_units

    cfg = _model_config(args)
    if kind in DEEPSPEED:
        from peers_deepspeed import build_deepspeed

        (model,) = build_gpt_model_chunks(cfg, ps, seed=SEED, device=ps.device)
        try:
            return build_deepspeed(int(kind[-1]), model, args)
        except ImportError as e:  # peers_deepspeed.DeepSpeedUnavailable: no usable deepspeed
            raise Skip(str(e)) from None
    if kind in MEGAZERO:
        from megazero.config import OptimizerConfig
        from megazero.data_parallel import build_optimizer

        stage = int(kind[-1])
        zero3 = stage == 3
        chunks = build_gpt_model_chunks(cfg, ps, seed=None if zero3 else SEED,
                                        device="meta" if zero3 else ps.device)
        config = OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=0.0,
                                 adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_eps=EPS,
                                 clip_grad=0.0, zero_stage=stage)
        # the unit policy tells ZeRO-3 what to gather together and stages 1-2 which modules
        # wait for which parameters' all-gather (as pretrain_gpt2.py passes it)
        opt = build_optimizer(chunks, config, ps, seed=SEED, unit_policy=gpt_zero3_units)
        return chunks[0], opt
    (model,) = build_gpt_model_chunks(cfg, ps, seed=SEED, device=ps.device)
    if kind == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        inner = _adamw(ddp.parameters(), args)
        return ddp, _TorchOpt(model, inner, inner)
    if kind == "ddp+zero-ro":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        zro = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW,
                                      lr=args.lr, betas=BETAS, eps=EPS, weight_decay=0.0,
                                      fused=True)
        return ddp, _TorchOpt(model, zro, zro.optim)  # zro.optim: this rank's shard
    if kind == "fsdp2":
        try:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for layer in model.layers.values():
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        except Exception as e:  # noqa: BLE001
            raise Skip(f"fully_shard failed on CPU/gloo: {type(e).__name__}: {e}") from None
        inner = _adamw(model.parameters(), args)
        return model, _TorchOpt(model, inner, inner)
    raise ValueError(kind)


def _loss(module, batch):
    tokens, pos, labels = batch
    return module(tokens, pos, None, labels=labels).mean()


def _run_contender(kind, args, ps):
    rank, world = dist.get_rank(), dist.get_world_size()
    data = [_batch(args, i, rank, world) for i in range(args.warmup + args.steps)]
    eval_batch = _batch(args, 10_000, 0, 1)  # the same on every rank
    before_model = _resident()
    module, opt = _build(kind, args, ps)
    backward = getattr(opt, "backward", torch.Tensor.backward)  # DeepSpeed: engine.backward
    times = []
    for i, batch in enumerate(data):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = _loss(module, batch)
        t1 = time.perf_counter()
        backward(loss)
        t2 = time.perf_counter()
        opt.finish_grad_sync()
        t3 = time.perf_counter()
        opt.step()
        t4 = time.perf_counter()
        if i >= args.warmup:
            times.append((t4 - t0, t1 - t0, t2 - t1, t3 - t2, t4 - t3))
    memory = opt.memory_report()
    # anonymous memory held (the ring's shared-memory segments are resident as shared pages)
    held = sum(v for k, v in memory.items()
               if not k.endswith("_peak") and not k.startswith("shared_"))
    unaccounted = _resident() - before_model - held
    with torch.no_grad():
        final = _loss(module, eval_batch).detach().reshape(1).double()
    dist.all_reduce(final)
    inner = getattr(opt, "inner", None) or getattr(opt, "client", None)
    return {"times": times, "memory": memory, "loss": float(final) / world,
            "unaccounted": unaccounted, "adamw": adamw_impl(inner) if inner is not None
            else "megazero (fused C++ step)",
            "psi": sum(p.numel() for p in _model_params(args, ps))}


def _resident() -> int:
    """Anonymous resident bytes of this process now (``RssAnon``), after returning the C
    allocator's free pages to the system (glibc ``malloc_trim``): memory in use, without the
    file-backed pages of the libraries' code that running a kernel first makes resident."""
    from megazero.training.log import resident_bytes

    return resident_bytes(trim=True, anonymous=True)


def _model_params(args, ps):
    from megazero.model import build_gpt_model_chunks

    (model,) = build_gpt_model_chunks(_model_config(args), ps, device="meta")
    return list(model.parameters())


def _rank(kind, args):
    """One rank of one contender-round (``harness.spawn``): its result and its peak RSS."""
    from megazero.distributed.parallel_state import ParallelState

    # ZeRO-3's module hooks on the embedding, whose inputs (token ids) need no gradient
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    r = _run_contender(kind, args, ParallelState.build())
    r["rss_kb"] = harness.peak_rss_kib()
    return r


def run(kind, args, world):
    """One contender-round in fresh processes: the per-rank results (raises ``Skip``)."""
    return harness.spawn(_rank, world, kind, args, timeout=args.timeout)


def summarize(per_round):
    """Per contender: slowest-rank step and phase times (median over all measured steps,
    range of the per-round medians), peak RSS, model states and losses."""
    times = harness.step_summary(
        [harness.slowest_rank([r["times"] for r in ranks]) for ranks in per_round], PHASES)
    rss = [max(r["rss_kb"] for r in ranks) * 1024 for ranks in per_round]
    losses = [ranks[0]["loss"] for ranks in per_round]
    unacc = [max(r["unaccounted"] for r in ranks) for ranks in per_round]
    mems = [r["memory"] for r in per_round[-1]]
    keys = ("params", "grads", "main_params", "optimizer_states")
    mem = max(mems, key=lambda m: sum(m[k] for k in keys))
    return {**times, "rss": statistics.median(rss), "memory": mem,
            "states": sum(mem[k] for k in keys), "loss": losses,
            "buffers": sum(v for k, v in mem.items() if k not in keys
                           and not k.endswith("_peak")),
            "unaccounted": statistics.median(unacc),
            "psi": per_round[-1][0]["psi"], "adamw": per_round[-1][0]["adamw"]}


def print_table(rows, skips, args, world):
    mb = 1e6
    psi = next((r["psi"] for r in rows.values()), 0)
    print(f"\ndp={world}, gloo: megazero GPT-2 {args.layers} layers x hidden {args.hidden} "
          f"({args.heads} heads), seq {args.seq}, vocab {args.vocab}, {psi / 1e6:.2f}M params "
          f"(fp32), micro-batch {args.micro_batch} per rank; {harness.rounds_text(args)}; "
          f"AdamW lr {args.lr:g}, wd 0, no clipping")
    ref = rows.get(REFERENCE)

    def cells(r):
        m = r["memory"]
        breakdown = "/".join(f"{m[k] / mb:.1f}" for k in ("params", "grads", "main_params",
                                                         "optimizer_states"))
        losses = ", ".join(f"{x:.6f}" for x in sorted(set(r["loss"])))
        return [*harness.step_cells(r, ref), *(f"{r['phases'][p] * 1e3:.1f}" for p in PHASES),
                f"{r['rss'] / mb:.0f}", f"{r['states'] / mb:.1f} ({breakdown})",
                f"{r['buffers'] / mb:.1f}", f"{r['unaccounted'] / mb:.1f}", losses, r["adamw"]]

    lines = harness.contender_rows(args.contenders, rows, skips, cells)
    print(harness.markdown_table(
        ["contender", "step ms (median)", "round medians", f"vs {REFERENCE}", "fwd ms",
         "bwd ms", "sync ms", "step ms", "peak RSS MB/rank",
         "model states MB/rank (p/g/main/opt)", "buffers MB", "unaccounted MB", "loss after",
         "AdamW"], lines, align="lrrrrrrrrlrrll"))
    all_losses = [x for r in rows.values() for x in r["loss"]]
    if all_losses:
        lo, hi = min(all_losses), max(all_losses)
        print(f"\nloss after the steps over all contenders and rounds: {lo:.7f} .. {hi:.7f} "
              f"(largest relative difference {(hi - lo) / abs(lo):.2e})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=2)
    harness.add_gpt_args(parser, layers=4, hidden=512, heads=8, seq=256, vocab=8192,
                         micro_batch=4, micro_batch_help="sequences per rank and step")
    harness.add_round_args(parser, warmup=1, steps=3, rounds=5, timeout=900,
                           contenders=CONTENDERS)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--allocator-caches", action="store_true",
                        help="leave MKL's buffer cache and glibc's per-thread arenas on (the "
                             "default turns both off for every contender, see the docstring)")
    args = parser.parse_args()
    if not args.allocator_caches:  # inherited by every spawned worker, read at its start
        os.environ.update(ALLOCATOR_CACHES_OFF)
    caches = "on" if args.allocator_caches else f"off: {ALLOCATOR_CACHES_OFF}"
    print(f"allocator caches {caches}")
    print(harness.start_line())
    t_start = time.perf_counter()
    results, skips = harness.interleave(args.contenders, args.rounds,
                                        lambda kind: run(kind, args, args.dp))
    rows = {k: summarize(v) for k, v in results.items() if v and k not in skips}
    print_table(rows, skips, args, args.dp)
    print(harness.end_line(t_start))
    if args.json:
        harness.write_json(args.json, {"benchmark": "bench_peers", "args": vars(args),
                                       "rows": rows, "skips": skips})


if __name__ == "__main__":
    main()
