"""Pipelines for custom models: megazero.pipe against torch.distributed.pipelining and DeepSpeed.

One model, one global batch, one micro-batch count, two pipeline stages on two gloo ranks. The
model is user code of the kind ``deepspeed.pipe`` is written for: ``--blocks`` residual blocks
``x + fc2(gelu(fc1(layer_norm(x))))`` (hidden ``--hidden``, 4x inside), then a linear head to
``--classes`` classes and the cross entropy as the loss (fp32, no dropout). Each step is
``--micro-batches`` micro-batches of ``--micro-batch`` rows: inputs ``[micro_batch, hidden]``
drawn from N(0, 1), labels the argmax of a fixed random linear "teacher" of the inputs (so the
loss falls as it learns), the same tensors for every contender, made before timing. The
contenders:

* ``torch-pipe`` (the reference of the ratio column): ``torch.distributed.pipelining``, the
  model cut by hand into the two stages' ``nn.Sequential``s (the cut below), a
  ``PipelineStage`` per rank (shapes inferred at the first step) and ``Schedule1F1B`` with
  the cross entropy as ``loss_fn`` (its default ``scale_grads``: gradients averaged over the
  micro-batches); ``torch.optim.AdamW`` per stage;
* ``mz-pipe``: ``megazero.pipe.PipelineModule`` (``LayerSpec`` list, ``num_stages=2``,
  ``loss_fn``, ``partition_method="parameters"``) wrapped by ``megazero.initialize(model=...,
  config=ds_config)`` (AdamW, ZeRO stage 0: dp is 1), stepped by ``engine.train_batch(it)``,
  ``next(it)`` an ``(inputs, labels)`` micro-batch;
* ``ds-pipe``: DeepSpeed's ``deepspeed.pipe.PipelineModule`` (the same ``LayerSpec`` list and
  partition method) in a ``PipelineEngine`` from ``deepspeed.initialize`` (ZeRO 0, fp32, no
  clipping, ``torch.optim.AdamW`` as client optimizer), the same ``train_batch(it)``; run by
  ``--ds-python`` (a venv with deepspeed: it is no megazero dependency) with
  ``DS_ACCELERATOR=cpu``, DeepSpeed's CPU accelerator on gloo. Reported as SKIP, with the
  reason, when that interpreter or DeepSpeed's pipeline engine cannot run here;
* ``mz-pp1``: megazero's engine on one process, the same ``PipelineModule`` at
  ``num_stages=1`` accumulating the same micro-batches (the single-process reference: its
  losses must equal ``mz-pipe``'s to 1e-5 relative, printed as a check).

Same weights: megazero builds layer i under ``torch.manual_seed(base_seed + i)`` (base_seed
1234). torch-pipe builds its stage's layers the same way, and DeepSpeed's layers (built with
its own RNG) get those state dicts by layer index, so every contender starts from identical
weights; a per-layer fingerprint (float64 sum and sum of squares of its parameters) is taken
from each contender's own modules before training and compared, and so are the step-1 losses.
Every stage cut is the one ``partition_method="parameters"`` gives (the blocks split evenly,
the head on the last stage); the cuts are printed. AdamW everywhere: lr ``--lr``, betas
0.9/0.999, eps 1e-8, weight decay 0, no clipping, constant lr (torch's ``fused=True``).

Protocol: interleaved rounds as ``bench_peers.py`` (``harness.interleave``): within a round each
contender runs once, order rotated each round, over ``--rounds`` rounds. Every contender-round
runs in fresh worker processes (``subprocess``, so the DeepSpeed contender can run its own
interpreter; a gloo group through ``tcp://`` on a free port, ``OMP_NUM_THREADS=1`` and
``torch.set_num_threads(1)`` per rank), ``--warmup`` steps then ``--steps`` measured ones. A
step starts after a barrier (not counted) on every rank; its time is the slowest rank's.
Reported per contender:

* step ms: median over all measured steps of all rounds, with the range of per-round medians,
  and its ratio to torch-pipe's (below 1 = faster);
* peak RSS MB per rank (``resource.getrusage(RUSAGE_SELF).ru_maxrss`` in the worker at its
  end: the whole process, imports included), each rank's median over rounds;
* loss at step 1 and at the last step (the mean over the step's micro-batches, from round 1;
  every round starts from the same weights and data, so the rounds agree).

    python benchmarks/bench_pipe_engine.py [--hidden 256 --blocks 8 --classes 10] \
        [--micro-batch 8 --micro-batches 8] [--warmup 2 --steps 10 --rounds 3] \
        [--contenders torch-pipe mz-pipe ds-pipe mz-pp1] [--ds-python /work/venv-ds/bin/python] \
        [--json FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, REPO)

from benchmarks import harness  # noqa: E402
from benchmarks.harness import Skip  # noqa: E402

CONTENDERS = ("torch-pipe", "mz-pipe", "ds-pipe", "mz-pp1")
REFERENCE = "torch-pipe"
WORLD = {"torch-pipe": 2, "mz-pipe": 2, "ds-pipe": 2, "mz-pp1": 1}
BASE_SEED, DATA_SEED = 1234, 4321
BETAS, EPS = (0.9, 0.999), 1e-8


# ---- the model (user code) -------------------------------------------------------------------
class Block(nn.Module):
    """x + fc2(gelu(fc1(layer_norm(x)))): [b, h] -> [b, h]."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x):  # [b, h]
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def loss_fn(logits, labels):  # [b, classes], [b] -> scalar
    return F.cross_entropy(logits, labels)


def layer_specs(spec_class, args) -> list:
    """The model as ``spec_class`` (megazero's or DeepSpeed's ``LayerSpec``) entries."""
    return [*(spec_class(Block, args.hidden) for _ in range(args.blocks)),
            spec_class(nn.Linear, args.hidden, args.classes)]


def build_layer(args, index: int) -> nn.Module:
    """Layer ``index`` as megazero builds it: under ``torch.manual_seed(BASE_SEED + index)``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(BASE_SEED + index)
        return Block(args.hidden) if index < args.blocks else nn.Linear(args.hidden,
                                                                         args.classes)


def stage_cut(args, world: int) -> list[int]:
    """The stage boundaries ``partition_method="parameters"`` gives (megazero's balancer)."""
    from megazero.pipe import partition_balanced

    counts = [4 * args.hidden * args.hidden * 2 + 7 * args.hidden] * args.blocks \
        + [(args.hidden + 1) * args.classes]
    return partition_balanced(counts, world)


def micro_batches(args, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Step ``step``'s micro-batches: (inputs [mb, h], labels [mb]) pairs, the same for every
    contender; the labels are a fixed random linear teacher's argmax."""
    teacher = torch.randn(args.hidden, args.classes,
                          generator=torch.Generator().manual_seed(DATA_SEED))
    g = torch.Generator().manual_seed(DATA_SEED + 1 + step)
    out = []
    for _ in range(args.micro_batches):
        x = torch.randn(args.micro_batch, args.hidden, generator=g)
        out.append((x, (x @ teacher).argmax(-1)))
    return out


def fingerprint(named_layers) -> dict[str, list[float]]:
    """{layer index: [sum, sum of squares]} (float64) of the parameters of each layer."""
    out = {}
    for name, layer in named_layers:
        if name.isdigit():
            ps = [p.detach().double() for p in layer.parameters()]
            out[name] = [float(sum(p.sum() for p in ps)), float(sum((p * p).sum() for p in ps))]
    return out


def _adamw(params, args):
    return torch.optim.AdamW(params, lr=args.lr, betas=BETAS, eps=EPS, weight_decay=0.0,
                             fused=True)


# ---- the contenders: (step(data) -> loss or None, fingerprint, stage cut) --------------------
def _megazero(args, world: int):
    import megazero
    from megazero.distributed.parallel_state import ParallelState
    from megazero.pipe import LayerSpec, PipelineModule

    ps = ParallelState.build(1, world)
    module = PipelineModule(layer_specs(LayerSpec, args), num_stages=world, loss_fn=loss_fn,
                            parallel_state=ps, partition_method="parameters")
    config = {"train_batch_size": args.micro_batch * args.micro_batches,
              "train_micro_batch_size_per_gpu": args.micro_batch,
              "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": list(BETAS),
                                                        "eps": EPS, "weight_decay": 0.0}},
              "zero_optimization": {"stage": 0}}
    engine, _, _, _ = megazero.initialize(model=module, config=config)
    assert engine.gradient_accumulation_steps() == args.micro_batches
    prints = fingerprint((n, m) for c in module.chunks for n, m in c.named_children())

    def step(data):
        return float(engine.train_batch(iter(data)))

    return step, prints, [int(x) for x in module.parts]


def _torch_pipe(args, world: int):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank, cut = dist.get_rank(), stage_cut(args, world)
    layers = OrderedDict((str(i), build_layer(args, i)) for i in range(cut[rank], cut[rank + 1]))
    module = nn.Sequential(layers)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=args.micro_batches, loss_fn=loss_fn)
    optim = _adamw(module.parameters(), args)
    first, last = rank == 0, rank == world - 1

    def step(data):
        # torch's schedule takes the whole batch and cuts it into the micro-batches (dim 0):
        # the concatenation of the same micro-batches
        x, y = data
        optim.zero_grad(set_to_none=True)
        losses = []
        if first:
            schedule.step(x, return_outputs=False)
        elif last:
            schedule.step(target=y, losses=losses, return_outputs=False)
        else:
            schedule.step(return_outputs=False)
        optim.step()
        return float(torch.stack(losses).mean()) if last else None

    return step, fingerprint(module.named_children()), cut


def _deepspeed(args, world: int):
    try:
        import deepspeed
        from deepspeed.pipe import LayerSpec, PipelineModule
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken install failing at import
        raise Skip(f"deepspeed not importable ({type(e).__name__}: {e})") from e
    import logging

    for log in ("DeepSpeed", "deepspeed"):  # its INFO lines on every rank and step
        logging.getLogger(log).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning)
    deepspeed.init_distributed(dist.get_backend())  # adopts the gloo group
    module = PipelineModule(layer_specs(LayerSpec, args), num_stages=world, loss_fn=loss_fn,
                            partition_method="parameters")  # seed_layers off: weights copied
    with torch.no_grad():
        for name, layer in module.named_children():
            if name.isdigit():
                layer.load_state_dict(build_layer(args, int(name)).state_dict())
    prints = fingerprint(module.named_children())
    config = {"train_batch_size": args.micro_batch * args.micro_batches,
              "train_micro_batch_size_per_gpu": args.micro_batch,
              "gradient_accumulation_steps": args.micro_batches,
              "gradient_clipping": 0.0, "zero_optimization": {"stage": 0},
              "fp16": {"enabled": False}, "bf16": {"enabled": False},
              "steps_per_print": 2**31 - 1, "wall_clock_breakdown": False}
    engine, _, _, _ = deepspeed.initialize(model=module, config=config,
                                           optimizer=_adamw(module.parameters(), args),
                                           dist_init_required=False)

    def step(data):
        return float(engine.train_batch(iter(data)))

    return step, prints, [int(x) for x in module.parts]


def _run_contender(kind, args, world):
    rank = dist.get_rank()
    steps = [micro_batches(args, i) for i in range(args.warmup + args.steps)]
    if kind == "torch-pipe":
        steps = [(torch.cat([x for x, _ in d]), torch.cat([y for _, y in d])) for d in steps]
        step, prints, cut = _torch_pipe(args, world)
    elif kind == "ds-pipe":
        step, prints, cut = _deepspeed(args, world)
    else:
        step, prints, cut = _megazero(args, world)
    times, losses = [], []
    for i, data in enumerate(steps):
        dist.barrier()
        t0 = time.perf_counter()
        loss = step(data)
        elapsed = time.perf_counter() - t0
        losses.append(loss)
        if i >= args.warmup:
            times.append(elapsed)
    dist.barrier()
    return {"rank": rank, "times": times, "losses": losses, "fingerprint": prints,
            "cut": cut, "rss_kb": harness.peak_rss_kib()}


def worker(args):
    """One rank of one contender-round: writes its result (or skip/error) to ``--result``."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*pipelining.*", category=UserWarning)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                                rank=args.rank, world_size=args.world,
                                timeout=datetime.timedelta(seconds=args.timeout))
        os.environ.setdefault("LOCAL_RANK", str(args.rank))  # DeepSpeed's engine wants it
        try:
            result = {"status": "ok", **_run_contender(args.worker, args, args.world)}
        except Skip as e:
            result = {"status": "skip", "reason": str(e)}
        except Exception as e:  # noqa: BLE001
            if args.worker != "ds-pipe":
                raise
            print(traceback.format_exc(), file=sys.stderr)  # DeepSpeed cannot run it here
            result = {"status": "skip", "reason": f"{type(e).__name__}: {e}".splitlines()[0]}
    except BaseException as e:  # noqa: BLE001
        result = {"status": "err", "reason": f"{type(e).__name__}: {e}\n"
                                             f"{traceback.format_exc()}"}
    with open(args.result, "w") as f:
        json.dump(result, f)
    if dist.is_initialized():
        try:
            from megazero.distributed import destroy_distributed

            destroy_distributed()
        except Exception:  # noqa: BLE001
            dist.destroy_process_group()


# ---- the launcher ------------------------------------------------------------------------------
MODEL_ARGS = ("hidden", "blocks", "classes", "micro_batch", "micro_batches", "warmup",
              "steps", "lr", "timeout")


def run(kind, args):
    """One contender-round in fresh processes (``subprocess``: the DeepSpeed contender runs
    its own interpreter): the per-rank results; raises ``Skip`` or ``RankFailed``."""
    world = WORLD[kind]
    python = args.ds_python if kind == "ds-pipe" else sys.executable
    if kind == "ds-pipe" and not os.path.isfile(python):
        raise Skip(f"no DeepSpeed interpreter at {python}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    port = harness.free_port()
    with tempfile.TemporaryDirectory() as tmp:
        procs, paths, logs = [], [], []
        for r in range(world):
            paths.append(os.path.join(tmp, f"rank{r}.json"))
            logs.append(open(os.path.join(tmp, f"rank{r}.log"), "w+"))
            cmd = [python, os.path.abspath(__file__), "--worker", kind, "--rank", str(r),
                   "--world", str(world), "--port", str(port), "--result", paths[-1]]
            for name in MODEL_ARGS:
                cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
            procs.append(subprocess.Popen(cmd, env=env, stdout=logs[-1],
                                          stderr=subprocess.STDOUT, cwd=REPO))
        deadline = time.monotonic() + args.timeout
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        results, failed, skip = [], None, None
        for r, path in enumerate(paths):
            logs[r].seek(0)
            log = logs[r].read()
            logs[r].close()
            if not os.path.isfile(path):
                failed = failed or harness.RankFailed(r, f"rank {r} wrote no result (exit "
                                                         f"{procs[r].returncode}):\n{log[-3000:]}")
                continue
            with open(path) as f:
                res = json.load(f)
            if res["status"] == "ok":
                results.append(res)
            elif res["status"] == "skip":
                skip = res["reason"]
                if kind == "ds-pipe":
                    print(f"{kind} rank {r} output (tail):\n{log[-3000:]}", file=sys.stderr)
            else:
                failed = harness.RankFailed(r, f"rank {r}: {res['reason']}\n{log[-2000:]}")
    if failed is not None:
        raise failed
    if skip is not None:
        raise Skip(skip)
    return results


def summarize(per_round):
    times = harness.step_summary(
        [harness.slowest_rank([r["times"] for r in ranks]) for ranks in per_round])
    rss = [[r["rss_kb"] / 1024 for r in sorted(ranks, key=lambda r: r["rank"])]
           for ranks in per_round]
    first = per_round[0]
    losses = next(r["losses"] for r in sorted(first, key=lambda r: -r["rank"]))
    prints = {}
    for r in first:
        prints.update(r["fingerprint"])
    return {"step": times["step"], "range": times["range"],
            "rss": [statistics.median(col) for col in zip(*rss)],
            "losses": losses, "fingerprint": prints, "cut": first[0]["cut"],
            "rounds_agree": all(next(r["losses"] for r in sorted(rs, key=lambda r: -r["rank"]))
                                == losses for rs in per_round)}


def _rel(a, b) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def print_table(rows, skips, args):
    params = args.blocks * (8 * args.hidden ** 2 + 7 * args.hidden) \
        + (args.hidden + 1) * args.classes
    print(f"\n2 pipeline stages on 2 gloo ranks (mz-pp1: 1 process): {args.blocks} blocks "
          f"LN->Linear({args.hidden},{4 * args.hidden})->GELU->Linear->residual + "
          f"Linear({args.hidden},{args.classes}) + cross entropy, {params / 1e6:.2f}M params "
          f"(fp32); {args.micro_batches} micro-batches of {args.micro_batch} per step "
          f"(global batch {args.micro_batch * args.micro_batches}); "
          f"{harness.rounds_text(args)}; AdamW lr {args.lr:g}, wd 0, no clipping")
    ref = rows.get(REFERENCE)
    lines = harness.contender_rows(args.contenders, rows, skips, lambda r: [
        *harness.step_cells(r, ref), " / ".join(f"{x:.0f}" for x in r["rss"]),
        f"{r['losses'][0]:.6f}", f"{r['losses'][-1]:.6f}"])
    print(harness.markdown_table(
        ["contender", "step ms (median)", "round medians", f"vs {REFERENCE}",
         "peak RSS MB per rank", "loss step 1", "loss last"], lines, align="lrrrrrr"))
    print()
    for kind, r in rows.items():
        agree = "identical" if r["rounds_agree"] else "DIFFER"
        print(f"{kind}: stage cut {r['cut']}, losses {agree} across rounds")
    names = list(rows)
    if names:
        base = rows[names[0]]["fingerprint"]
        same = all(r["fingerprint"] == base for r in rows.values())
        print(f"initial weights (per-layer fingerprints of {len(base)} layers): "
              f"{'identical' if same else 'DIFFERENT'} across {', '.join(names)}")
        firsts = [r["losses"][0] for r in rows.values()]
        print(f"loss at step 1 over the contenders: {min(firsts):.7f} .. {max(firsts):.7f} "
              f"(largest relative difference {(max(firsts) - min(firsts)) / min(firsts):.1e})")
    if "mz-pipe" in rows and "mz-pp1" in rows:
        diff = _rel(rows["mz-pipe"]["losses"], rows["mz-pp1"]["losses"])
        verdict = "PASS" if diff <= 1e-5 else "FAIL"
        print(f"check mz-pipe (pp2) against mz-pp1 (one process, gradient accumulation), "
              f"losses of all {len(rows['mz-pp1']['losses'])} steps: largest relative "
              f"difference {diff:.1e} -> {verdict} (<= 1e-5)")
    for kind in ("torch-pipe", "ds-pipe"):
        if kind in rows and "mz-pp1" in rows:
            print(f"{kind} against mz-pp1, all steps: largest relative loss difference "
                  f"{_rel(rows[kind]['losses'], rows['mz-pp1']['losses']):.1e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, default=8)
    harness.add_round_args(parser, warmup=2, steps=10, rounds=3, timeout=300,
                           contenders=CONTENDERS)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--ds-python", default="/work/venv-ds/bin/python",
                        help="an interpreter with deepspeed installed (same torch)")
    # one worker rank (the launcher's own command line)
    parser.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    print(harness.start_line())
    t_start = time.perf_counter()
    results, skips = harness.interleave(args.contenders, args.rounds,
                                        lambda kind: run(kind, args))
    rows = {k: summarize(v) for k, v in results.items() if v and k not in skips}
    print_table(rows, skips, args)
    print(harness.end_line(t_start))
    if args.json:
        harness.write_json(args.json, {"benchmark": "bench_pipe_engine", "args": vars(args),
                                       "rows": rows, "skips": skips})


if __name__ == "__main__":
    main()
