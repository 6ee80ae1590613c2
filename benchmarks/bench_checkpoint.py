"""Loading a checkpoint at another layout (resharding) against loading it at the saved layout.

Issue 8, item 6. A GPT-2 of a few hundred MB of checkpoint (default: 8 layers, hidden 512,
vocabulary 16384, fp32, Adam: model + fp32 main + two moments, about 540 MB) is saved at a
layout by a fresh set of gloo processes; then, for each case, a fresh set of processes (one
thread each) builds the model and optimizer at the load layout and times
``checkpoint.load_checkpoint`` (model, optimizer, scheduler, RNG). Per rank it reports:

* load time (the slowest rank: ``load_checkpoint`` ends with a barrier);
* peak RSS (``VmHWM`` of the fresh process: torch, model, optimizer and the load);
* load peak: the peak RSS during the load (``VmHWM`` reset just before it, Linux
  ``clear_refs``) minus the RSS before it. Checkpoints are memory-mapped, so file pages the
  load touches count in RSS (``RssFile``, reclaimable page cache) as well as copies
  (``RssAnon``); the anon column is the peak of ``RssAnon`` sampled every 2 ms.

Every row goes through the one load path (``CheckpointReader``, memory-mapped, each rank
reading only the regions of its own slices); rows "at the saved layout" take the reader's
special case, a straight copy of each saved slice. Ratios compare each resharded load with
the same checkpoint loaded at its saved layout, and with a checkpoint saved at the target
layout loaded there (the same per-rank share). The last row times the offline converter
(``python -m megazero.tools.checkpoint convert``) in one process. Files stay in the page
cache between runs (warm reads); timings on a shared machine are noisy (best of
``--repeats``).

    python benchmarks/bench_checkpoint.py [--layers 8 --hidden 512 --vocab 16384]
        [--repeats 2] [--dir /tmp/bench_ckpt] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, REPO)

from benchmarks import harness  # noqa: E402

# name -> (world, extra flags); dp = world / tp
LAYOUTS = {
    "tp1": (1, ""), "tp2": (2, "--tensor-model-parallel-size 2"),
    "dp2 z1": (2, "--zero-stage 1"), "dp4 z1": (4, "--zero-stage 1"),
}
# (saved layout, loaded layout); loaded == saved: the direct path
CASES = [("tp1", "tp1"), ("tp1", "tp2"), ("tp2", "tp2"), ("tp2", "tp1"),
         ("dp2 z1", "dp2 z1"), ("dp2 z1", "dp4 z1"), ("dp4 z1", "dp4 z1")]


class _AnonSampler(threading.Thread):
    """Peak of ``RssAnon`` sampled every 2 ms while running."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.stop = 0, threading.Event()

    def run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, harness.status_kib("RssAnon"))
            time.sleep(0.002)


def _argv(args, layout: str) -> list[str]:
    world, extra = LAYOUTS[layout]
    return (f"--mock-data --vocab-size {args.vocab} --num-layers {args.layers} "
            f"--hidden-size {args.hidden} --num-attention-heads {args.heads} "
            f"--seq-length {args.seq} --micro-batch-size 1 --global-batch-size {world} "
            f"--train-iters 10 --eval-iters 0 --seed 1234 {extra}").split()


def _rank(task, argv, root):
    """One rank (``harness.spawn``): save the checkpoint, or time loading it."""
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115
    import pretrain_gpt2
    from megazero import checkpoint
    from megazero.arguments import parse_args
    from megazero.data_parallel import build_optimizer
    from megazero.distributed.init import init_distributed
    from megazero.optim import build_lr_scheduler
    from megazero.tensor_parallel.random import set_random_seed
    from megazero.training.data import prepare_tokenizer

    rank, world = dist.get_rank(), dist.get_world_size()
    config = parse_args(argv, world_size=world)
    ps = init_distributed(config.parallel)
    tracker = set_random_seed(config.train.seed, ps)
    prepare_tokenizer(config, ps)
    model = pretrain_gpt2.model_provider(config, ps, tracker)
    gbs = config.train.global_batch_size
    sched = build_lr_scheduler(config.optimizer, gbs, 10 * gbs)
    opt = build_optimizer(model, config.optimizer, ps, lr_scheduler=sched,
                          seed=config.train.seed)
    common = dict(model_chunks=model, optimizer=opt, lr_scheduler=sched, config=config,
                  ps=ps, tracker=tracker)
    result = {"rank": rank}
    if task == "save":
        checkpoint.save_checkpoint(root, 1, consumed_train_samples=gbs, **common)
    else:
        dist.barrier()
        rss_before = harness.status_kib("VmRSS")
        reset = harness.reset_peak_rss()
        sampler = _AnonSampler()
        anon_before = harness.status_kib("RssAnon")
        sampler.start()
        t0 = time.perf_counter()
        checkpoint.load_checkpoint(root, **common)
        result["load_s"] = time.perf_counter() - t0
        sampler.stop.set()
        sampler.join()
        hwm = harness.status_kib("VmHWM")
        result.update(load_peak_mb=(hwm - rss_before) / 1024 if reset else None,
                      anon_peak_mb=(sampler.peak - anon_before) / 1024,
                      peak_rss_mb=hwm / 1024)
    return result


def _convert(src, dst):
    """The offline converter in one plain process (``harness.spawn(gloo=False)``)."""
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115
    from megazero.tools.checkpoint import main

    t0 = time.perf_counter()
    rc = main(["convert", src, dst, "--tp", "2", "--force"])
    return {"rank": 0, "rc": rc, "load_s": time.perf_counter() - t0, "load_peak_mb": None,
            "anon_peak_mb": None, "peak_rss_mb": harness.status_kib("VmHWM") / 1024}


def _launch(task, world, argv, root, timeout=1800):
    return harness.spawn(_rank, world, task, argv, root, timeout=timeout, pg_timeout=1800)


def _checkpoint_mb(root: str) -> float:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root)
               for f in fs) / 2**20


def _summary(results):
    key = lambda k: max(r[k] for r in results) if results[0][k] is not None else None  # noqa
    return {k: key(k) for k in ("load_s", "load_peak_mb", "anon_peak_mb", "peak_rss_mb")}


def run(args) -> list[dict]:
    base = args.dir or tempfile.mkdtemp(prefix="bench_ckpt_")
    saved = sorted({s for s, _ in CASES}, key=list(LAYOUTS).index)
    sizes = {}
    for layout in saved:
        root = os.path.join(base, layout.replace(" ", "_"))
        shutil.rmtree(root, ignore_errors=True)
        _launch("save", LAYOUTS[layout][0], _argv(args, layout), root)
        sizes[layout] = _checkpoint_mb(root)
        print(f"saved {layout}: {sizes[layout]:.0f} MiB", file=sys.stderr)
    rows = []
    for saved_at, load_at in CASES:
        root = os.path.join(base, saved_at.replace(" ", "_"))
        best = None
        for _ in range(args.repeats):
            s = _summary(_launch("load", LAYOUTS[load_at][0], _argv(args, load_at), root))
            best = s if best is None or s["load_s"] < best["load_s"] else best
        rows.append({"saved": saved_at, "loaded": load_at, "ranks": LAYOUTS[load_at][0],
                     "mb": sizes[saved_at], **best})
        print(f"{saved_at} -> {load_at}: {best}", file=sys.stderr)
    src = os.path.join(base, "tp1")
    conv = harness.spawn(_convert, 1, src, os.path.join(base, "converted"), timeout=1800,
                         gloo=False)
    rows.append({"saved": "tp1", "loaded": "tp2 (offline convert)", "ranks": 1,
                 "mb": sizes["tp1"], **_summary(conv)})
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)
    return rows


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def table(rows) -> str:
    by = {(r["saved"], r["loaded"]): r for r in rows}
    lines = []
    for r in rows:
        ratios = []
        for ref in (by.get((r["saved"], r["saved"])), by.get((r["loaded"], r["loaded"]))):
            if ref is None or ref is r:
                ratios += ["-", "-"]
                continue
            ratios.append(f"{r['load_s'] / ref['load_s']:.2f}x")
            lp, rp = r["load_peak_mb"], ref["load_peak_mb"]
            ratios.append(f"{lp / rp:.2f}x" if lp is not None and rp else "-")
        lines.append([r["saved"], r["loaded"], r["ranks"], f"{r['mb']:.0f}", f"{r['load_s']:.2f}",
                      _fmt(r["peak_rss_mb"], ".0f"), _fmt(r["load_peak_mb"], ".0f"),
                      _fmt(r["anon_peak_mb"], ".0f"), *ratios])
    return harness.markdown_table(
        ["saved at", "loaded at", "ranks", "ckpt MiB", "load s", "peak RSS MiB/rank",
         "load peak MiB/rank", "anon peak MiB/rank", "time vs saved layout",
         "load peak vs saved layout", "time vs target-saved", "load peak vs target-saved"],
        lines, align="llrrrrrrrrrr")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_gpt_args(p, layers=8, hidden=512, heads=8, seq=128, vocab=16384)
    p.add_argument("--repeats", type=int, default=2, help="loads per case (best time kept)")
    p.add_argument("--dir", default=None, help="keep the checkpoints here")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="also write the rows, the arguments and the host here")
    args = p.parse_args(argv)
    rows = run(args)
    print(f"GPT-2 {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, fp32, Adam; "
          f"torch {torch.__version__}, {os.cpu_count()} cores")
    print(table(rows))
    if args.json:
        harness.write_json(args.json, {"benchmark": "bench_checkpoint", "args": vars(args),
                                       "rows": rows})


if __name__ == "__main__":
    main()
