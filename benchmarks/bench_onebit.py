"""1-bit Adam and 0/1 Adam against AdamW on the README's GPT-2: convergence, bytes per step,
step time.

What is trained. The model ``scripts/pretrain_gpt2.sh`` trains (4 layers, hidden 256, 4 heads,
sequence 256, micro-batch 4, global batch 16, lr 1e-3 -> 1e-4 cosine with 10% warm-up, weight
decay 0.1, clipping at 1.0, no dropout, fp32) on the built-in default corpus (``--split
969,30,1``), from the same ``--seed``, once per optimizer of ``--optimizers`` (all three by
default):

* ``adam``: megazero's AdamW, ZeRO stage 0 (gradients all-reduced in fp32 every step);
* ``onebitadam --freeze-step T`` (T = ``--freeze-step``, 100): Adam bit for bit up to step
  T, then the variance frozen and the momenta averaged over dp by the 1-bit compressed
  all-reduce every step;
* ``zerooneadam --var-freeze-step V --var-update-scaler S --local-step-scaler L
  --local-step-clipper C`` (``--var-freeze-step`` V = T = 100, ``--var-update-scaler`` S =
  16, ``--local-step-scaler`` L = 125, ``--local-step-clipper`` C = 8): until step V the
  variance is updated from fp32-all-reduced gradients at exponentially spaced steps (every
  step for S updates, then every 2nd for S, every 4th, ...: at V = 100 the steps 1-16,
  18-48 even, 52-100 by 4, 45 updates), the gradients of the other steps averaged 1-bit;
  after V local steps (no gradient exchange), each rank's change since the last
  synchronisation averaged 1-bit every ``local_step_interval`` steps, an interval that
  starts at 1 and doubles every L steps up to C.

0/1 Adam's settings, against DeepSpeed's tutorial defaults (var_freeze_step 100000,
var_update_scaler 16, local_step_scaler 32678, local_step_clipper 16, made for runs of
~10^5 steps): V = T = 100, so that the two compressed optimizers leave full-precision
variance estimation at the same point (after the 60-iteration warm-up and the steep first
fall of the loss); S = 16 kept, so the first 16 steps, where gradients change fastest, are
full precision, and 44 of steps 2..100 are; L = (600 - 100) / 4 = 125, so the 500 local-phase
iterations are four equal phases of interval 1, 2, 4 and 8 (DeepSpeed's 32678 would keep the
interval at 1 for the whole run: 0/1 Adam would be 1-bit Adam with a sparser variance); C = 8
rather than 16, so that the run ends on a synchronisation (600 = 8 x 75, not a multiple of
16: the final validation sees one set of parameters, shared by the ranks, not the mean of two
ranks' diverged ones). With these, the validations at 200, 300, 400 and 600 follow a
synchronisation; the one at 500 (interval 8, last sync at 496) evaluates each rank's own
parameters on its own batches and averages (as pretrain's evaluation does over dp). The
timing runs scale L to their length: L x (``--timing-iters`` - ``--timing-freeze``) / (iters -
V) = 10 (intervals 1, 2, 4, 8 over iterations 21-60).

Each run is ``pretrain_gpt2.py`` itself under ``python -m torch.distributed.run
--nproc-per-node DP`` (gloo, one thread per rank: ``OMP_NUM_THREADS=1``), from this checkout
(``PYTHONPATH`` is set to it, ahead of any inherited one).

How it is measured.

* Convergence (``--iters``, default 600, at dp 2): Megatron's log line every iteration
  (``--log-interval 1``) gives the training curve (`` lm loss: X |``); validation every
  ``--eval-interval`` iterations on ``--eval-iters`` batches, the same batches each time, and
  the final validation loss is pretrain's ``validation loss at the end of training for val
  data`` line. Target (issue 18): each compressed optimizer's final validation loss within
  2% of AdamW's. The report also gives the mean per-iteration training-loss difference to
  AdamW over each phase of each compressed optimizer (1-bit: before / after the freeze; 0/1:
  the variance phase, then each local-step interval).
* Bytes sent per rank per step: pretrain has no flag that logs megazero's communication
  counters, so each rank runs ``pretrain_gpt2.py`` through this file's ``--probe`` mode: the
  script is executed unchanged as ``__main__`` (``runpy``), and ``Monitor.iteration_start`` /
  ``iteration_end`` (called by the training loop around each iteration's ``train_step``:
  forward/backward with the gradient reduction, the optimizer step, the loss reduction) are
  wrapped to read ``ps.comm.stats`` (``CommStats``: the bytes this rank sends, ring-algorithm
  accounting, every collective megazero issues) before and after. Evaluation and logging fall
  outside the bracket. Reported: the median and the mean over the iterations before the freeze
  (2..F) and after it (F+2..end; the first step after the freeze is left out of both), the
  largest over ranks; F is the optimizer's own freeze step (1-bit Adam's ``--freeze-step``,
  0/1 Adam's ``--var-freeze-step``); AdamW's row uses the first compressed optimizer's F, and
  each ratio to AdamW compares over the compressed optimizer's own iterations. 1-bit Adam
  sends the same bytes every step after its freeze (median = mean); 0/1 Adam's vary
  (before V: full-precision and 1-bit steps; after: local steps send a few bytes, the
  synchronisations 1-bit data), so its mean is the figure that counts, and the report splits
  its steps after V into synchronisations and local steps. Target: after the freeze at most
  1/4 of AdamW's bytes for fp32 gradients (checked on the larger of median and mean).
* Step time: the log line's ``elapsed time per iteration (ms)`` (with ``--log-interval 1``,
  one iteration), median and mean over the iterations after the freeze (F+2..end), leaving
  out the iterations that follow an evaluation (their interval includes it), against AdamW's
  over the same iterations. Measured by short timing runs (``--timing-iters`` 60, freeze of
  both compressed optimizers at ``--timing-freeze`` 20) at each of ``--timing-dp`` (2 and 4),
  ``--timing-repeats`` runs per optimizer with the optimizers alternating, so that a change of
  load on the machine falls on all of them; the median is over the iterations of all repeats.
  The convergence runs' step times are printed too (one run each, minutes apart). The short
  runs' final validation loss (after 60 iterations) says nothing about convergence. On a
  2-core machine dp 4 runs 4 single-threaded processes on 2 cores (oversubscribed). Each run
  records the 1-minute load average before and after it, and its wall time.

The runs go one after another (never two at once); ``--only convergence|timing`` makes one
half. ``--png`` draws the convergence runs' training curves (raw, and a running mean over 20
iterations), their differences to AdamW, the validation points and the bytes per step, with
matplotlib (optional: without it the PNG is skipped with a message). ``--json`` keeps the
parsed runs; ``--replot FILE [FILE ...]`` prints the table and draws the PNG from such files
(their runs merged; files from before 0/1 Adam was added work too) without training.

    python benchmarks/bench_onebit.py [--only all|convergence|timing]
        [--optimizers adam onebitadam zerooneadam] [--iters 600 --freeze-step 100]
        [--var-freeze-step 100 --var-update-scaler 16 --local-step-scaler 125
        --local-step-clipper 8] [--dp 2] [--timing-dp 2 4 --timing-iters 60
        --timing-freeze 20 --timing-repeats 2] [--eval-interval 100 --eval-iters 10]
        [--seed 1234] [--png benchmarks/onebit_loss.png] [--json FILE]
        [--replot FILE [FILE ...]]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# scripts/pretrain_gpt2.sh's GPT_ARGS and DATA_ARGS (the README's model on the default corpus)
README_MODEL = ("--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 256 "
                "--max-position-embeddings 256 --micro-batch-size 4 --global-batch-size 16 "
                "--lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-fraction 0.1 "
                "--weight-decay 0.1 --clip-grad 1.0 --attention-dropout 0.0 "
                "--hidden-dropout 0.0 --split 969,30,1").split()

ITER_RE = re.compile(r" iteration\s+(\d+)/\s*(\d+) \|.*?elapsed time per iteration \(ms\): "
                     r"([0-9.]+) \|.*? lm loss: ([0-9.Ee+-]+) \|.*? grad norm: ([0-9.a-z+-]+) \|")
VAL_RE = re.compile(r" validation loss at (iteration (\d+)|the end of training for val data) "
                    r"\| lm loss value: ([0-9.Ee+-]+) \|")
PARAMS_RE = re.compile(r"setup done in [0-9.]+ s: .*?, (\d+) parameters on this rank")

OPTIMIZERS = ("adam", "onebitadam", "zerooneadam")
LABELS = {"adam": "AdamW", "onebitadam": "1-bit Adam", "zerooneadam": "0/1 Adam"}
COLORS = {"adam": "tab:blue", "onebitadam": "tab:red", "zerooneadam": "tab:green"}


# ---- probe mode: one rank of pretrain_gpt2.py, with the bytes of every iteration -----------
def probe(out_prefix: str, argv: list[str]) -> None:
    """Run ``pretrain_gpt2.py argv`` as ``__main__`` in this process (a torchrun rank), with
    the bytes this rank sends per iteration (``ps.comm.stats``) and where the iteration's
    time went written to ``out_prefix.rank<R>.json``."""
    import runpy

    sys.path.insert(0, REPO)
    from megazero.data_parallel.onebit import OneBitAdamOptimizer
    from megazero.data_parallel.zero import ZeroOptimizer
    from megazero.data_parallel.zeroone import ZeroOneAdamOptimizer
    from megazero.distributed import comm
    from megazero.distributed.compressed import CompressedAllReduce
    from megazero.training.monitor import Monitor

    rows: list[dict] = []
    start: dict = {}
    timed: dict = {}  # this iteration's seconds per timed call
    depth = {"optimizer step": 0}

    def timer(owner, attr, label, outer_only=False):
        orig = getattr(owner, attr)

        def wrapper(*a, **k):
            if outer_only:
                depth[label] += 1
                if depth[label] > 1:
                    try:
                        return orig(*a, **k)
                    finally:
                        depth[label] -= 1
            t = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                timed[label] = timed.get(label, 0.0) + time.perf_counter() - t
                if outer_only:
                    depth[label] -= 1

        setattr(owner, attr, wrapper)

    # OneBitAdamOptimizer.step calls ZeroOptimizer.step before the freeze: time the outer call
    timer(ZeroOptimizer, "step", "optimizer step", outer_only=True)
    timer(OneBitAdamOptimizer, "step", "optimizer step", outer_only=True)
    timer(ZeroOneAdamOptimizer, "step", "optimizer step", outer_only=True)
    timer(ZeroOptimizer, "finish_grad_sync", "finish_grad_sync")
    timer(OneBitAdamOptimizer, "_compressed_update", "fold + exchange + update")
    timer(ZeroOneAdamOptimizer, "_local_step", "local step")  # 0/1 after V, with its sync
    timer(ZeroOneAdamOptimizer, "_synchronise", "synchronisation")
    timer(CompressedAllReduce, "all_reduce_mean_", "compressed all-reduce")
    timer(comm, "all_to_all_single", "compressed collectives")  # only the compressor's
    timer(comm, "all_gather_into", "compressed collectives")  # (ZeRO 0 gathers nothing)
    orig_start, orig_end = Monitor.iteration_start, Monitor.iteration_end

    def iteration_start(self, iteration):
        stats = self.ps.comm.stats
        timed.clear()
        start.update(sent=stats.total_sent(), kinds=dict(stats.sent),
                     calls=dict(stats.calls), t=time.perf_counter())
        return orig_start(self, iteration)

    def iteration_end(self, iteration):
        t = time.perf_counter() - start["t"]
        stats = self.ps.comm.stats
        kinds = {k: v - start["kinds"].get(k, 0) for k, v in stats.sent.items()}
        calls = {k: v - start["calls"].get(k, 0) for k, v in stats.calls.items()}
        rows.append({"iteration": iteration, "sent": stats.total_sent() - start["sent"],
                     "kinds": {k: v for k, v in kinds.items() if v},
                     "calls": {k: v for k, v in calls.items() if v}, "step_s": t,
                     "timed": dict(timed)})
        return orig_end(self, iteration)

    Monitor.iteration_start, Monitor.iteration_end = iteration_start, iteration_end
    rank = int(os.environ.get("RANK", "0"))
    script = os.path.join(REPO, "pretrain_gpt2.py")
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")
    import megazero

    with open(f"{out_prefix}.rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "megazero": os.path.dirname(megazero.__file__),
                   "iterations": rows}, f)


# ---- driver ------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def optimizer_settings(optimizer: str, args, timing: bool) -> dict:
    """The optimizer's own pretrain flags (as argparse dests) for a convergence run or, with
    ``timing``, a short timing run (freeze at ``--timing-freeze``, 0/1 Adam's local-step
    scaler scaled by the local phase's length)."""
    if optimizer == "onebitadam":
        return {"freeze_step": args.timing_freeze if timing else args.freeze_step}
    if optimizer == "zerooneadam":
        v = args.var_freeze_step if args.var_freeze_step is not None else args.freeze_step
        scaler = args.local_step_scaler
        if timing:
            scaler = max(1, round(scaler * (args.timing_iters - args.timing_freeze)
                                  / max(1, args.iters - v)))
            v = args.timing_freeze
        return {"var_freeze_step": v, "var_update_scaler": args.var_update_scaler,
                "local_step_scaler": scaler, "local_step_clipper": args.local_step_clipper}
    return {}


def run(name: str, kind: str, optimizer: str, dp: int, iters: int, settings: dict, args,
        outdir: str) -> dict:
    """One ``pretrain_gpt2.py`` run under torchrun; its parsed log and per-rank bytes."""
    flags = README_MODEL + ["--train-iters", str(iters), "--log-interval", "1",
                            "--eval-interval", str(min(args.eval_interval, iters)),
                            "--eval-iters", str(args.eval_iters), "--seed", str(args.seed),
                            "--optimizer", optimizer]
    for k, v in settings.items():
        flags += ["--" + k.replace("_", "-"), str(v)]
    freeze = settings.get("freeze_step", settings.get("var_freeze_step"))
    prefix = os.path.join(outdir, name)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(dp),
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           os.path.abspath(__file__), "--probe", prefix, "--", *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([REPO, *filter(None, [os.environ.get("PYTHONPATH")])]))
    print(f"[{name}] pretrain_gpt2.py at dp {dp}: {optimizer}"
          + "".join(f" --{k.replace('_', '-')} {v}" for k, v in settings.items())
          + f", {iters} iterations ...", flush=True)
    t0, load0 = time.time(), os.getloadavg()[0]
    with open(prefix + ".log", "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                              check=False)
    wall = time.time() - t0
    with open(prefix + ".log") as f:
        text = f.read()
    if proc.returncode != 0:
        sys.exit(f"[{name}] failed (rc {proc.returncode}); the last lines of {prefix}.log:\n"
                 + "\n".join(text.splitlines()[-40:]))
    res = {"name": name, "kind": kind, "optimizer": optimizer, "dp": dp, "iters": iters,
           "freeze": freeze, "settings": settings, "wall_s": wall,
           "load": (load0, os.getloadavg()[0]), "train": [], "val": [], "final_val": None,
           "params": None}
    for line in text.splitlines():
        if m := ITER_RE.search(line):
            res["train"].append({"iteration": int(m[1]), "ms": float(m[3]),
                                 "loss": float(m[4]), "grad_norm": float(m[5])})
        elif m := VAL_RE.search(line):
            if m[2] is None:
                res["final_val"] = float(m[3])
            else:
                res["val"].append((int(m[2]), float(m[3])))
        elif m := PARAMS_RE.search(line):
            res["params"] = int(m[1])
    res["ranks"] = []
    for r in range(dp):
        with open(f"{prefix}.rank{r}.json") as f:
            res["ranks"].append(json.load(f))
    res["megazero"] = res["ranks"][0]["megazero"]
    if len(res["train"]) != iters or res["final_val"] is None:
        sys.exit(f"[{name}] parsed {len(res['train'])} of {iters} log lines, final validation "
                 f"{res['final_val']}: see {prefix}.log")
    print(f"[{name}] {wall:.0f} s (load average {res['load'][0]:.1f} -> {res['load'][1]:.1f}); "
          f"final validation loss {res['final_val']:.4f}", flush=True)
    return res


# ---- reading the runs ----------------------------------------------------------------------
def _after(freeze: int, iters: int) -> range:
    """The iterations measured after the freeze: the first step after it (1-bit Adam's first
    compressed step, which builds the compressor; 0/1 Adam's first local step) is left out."""
    return range(freeze + 2, iters + 1)


def _stat(xs, stat: str) -> float:
    xs = list(xs)
    return statistics.median(xs) if stat == "median" else statistics.fmean(xs)


def _is_sync(row: dict) -> bool:
    """Whether a probe row (0/1 Adam after V) exchanged 1-bit data: a synchronisation."""
    return "all_to_all" in row["kinds"]


def bytes_per_step(group: list[dict], its, stat: str = "median") -> float:
    """Median (or mean) bytes sent per step over iterations ``its``, the largest over ranks and
    runs."""
    its = set(its)
    return max(_stat((row["sent"] for row in rank["iterations"] if row["iteration"] in its),
                     stat)
               for res in group for rank in res["ranks"])


def kinds_per_step(res: dict, its, keep=None) -> tuple[int, dict]:
    """Rank 0's bytes per kind of collective, median over iterations ``its`` (those rows for
    which ``keep(row)`` holds, if given), and how many iterations that is."""
    its = set(its)
    rows = [row for row in res["ranks"][0]["iterations"]
            if row["iteration"] in its and (keep is None or keep(row))]
    kinds = sorted({k for row in rows for k in row["kinds"]})
    return len(rows), {k: statistics.median(row["kinds"].get(k, 0) for row in rows)
                       for k in kinds}


def step_ms(group: list[dict], its, eval_interval: int, stat: str = "median") -> float:
    """Median (or mean) of the log line's ms per iteration over ``its`` of every run of
    ``group``, without the iterations whose interval includes an evaluation."""
    its = {i for i in its if (i - 1) % eval_interval != 0}
    return _stat((r["ms"] for res in group for r in res["train"] if r["iteration"] in its),
                 stat)


def breakdown(group: list[dict], its, eval_interval: int) -> dict:
    """Medians (ms, rank 0, iterations ``its`` of every run) of the probe's timers: the whole
    ``train_step`` bracket and the calls timed inside it (each over the iterations that made
    the call)."""
    its = {i for i in its if (i - 1) % eval_interval != 0}
    rows = [row for res in group for row in res["ranks"][0]["iterations"]
            if row["iteration"] in its]
    out = {"train step": statistics.median(row["step_s"] for row in rows) * 1e3,
           "rest (forward-backward)": statistics.median(
               row["step_s"] - row.get("timed", {}).get("optimizer step", 0.0)
               - row.get("timed", {}).get("finish_grad_sync", 0.0) for row in rows) * 1e3}
    for k in ("optimizer step", "finish_grad_sync", "fold + exchange + update", "local step",
              "synchronisation", "compressed all-reduce", "compressed collectives"):
        have = [row["timed"][k] for row in rows if k in row.get("timed", {})]
        if have:  # (runs made before a timer was added lack it)
            out[k] = statistics.median(have) * 1e3
    if group[0]["optimizer"] == "zerooneadam":  # train step: synchronisations, local steps
        for name, sync in (("train step on syncs", True), ("train step on local steps", False)):
            have = [row["step_s"] for row in rows if _is_sync(row) == sync]
            if have:
                out[name] = statistics.median(have) * 1e3
    return out


def phases(res: dict) -> list[tuple[str, range]]:
    """The phases of a compressed optimizer's run, as (label, its iterations): 1-bit Adam's
    Adam steps and compressed steps; 0/1 Adam's variance phase and each local-step
    interval."""
    n, f = res["iters"], res.get("freeze")
    if res["optimizer"] == "onebitadam":
        return [(f"Adam 1..{f}", range(1, f + 1)),
                (f"compressed {f + 1}..{n}", range(f + 1, n + 1))]
    if res["optimizer"] != "zerooneadam":
        return []
    s = res.get("settings") or {}
    out = [(f"variance phase 1..{f}", range(1, f + 1))]
    start, interval = f + 1, 1
    scaler, clipper = s.get("local_step_scaler", n), s.get("local_step_clipper", 1)
    while start <= n:  # the interval doubles after every ``scaler`` local steps
        end = n if interval >= clipper else min(n, start + scaler - 1)
        out.append((f"interval {interval} {start}..{end}", range(start, end + 1)))
        start, interval = end + 1, min(clipper, interval * 2)
    return out


def _mb(b: float) -> str:
    if b < 2**20 / 100:
        return f"{b / 2**20:.1e}"
    return f"{b / 2**20:.3f}" if b < 2**20 * 10 else f"{b / 2**20:.2f}"


def _ratio(r: float) -> str:
    return f"{r:.4f}" if r >= 1e-3 else f"{r:.1e}"


def groups(runs: list[dict]) -> dict:
    """(kind, dp, optimizer) -> its runs (the repeats of a timing measurement)."""
    out: dict = {}
    for r in runs:
        out.setdefault((r["kind"], r["dp"], r["optimizer"]), []).append(r)
    return out


def _freeze_of(by: dict, kind: str, dp: int, optimizer: str) -> int | None:
    """A row's F: its own freeze step; AdamW's, the first compressed optimizer's."""
    if optimizer != "adam":
        return by[(kind, dp, optimizer)][0]["freeze"]
    for o in OPTIMIZERS[1:]:
        if (kind, dp, o) in by:
            return by[(kind, dp, o)][0]["freeze"]
    return None


def report(runs: list[dict], meta: dict) -> list[str]:
    """The table (and its notes) as printed lines; checks the two targets."""
    out = []
    head = (f"{'optimizer':<11}{'dp':>3}{'iters':>6}{'runs':>5}{'freeze':>7}{'final val':>10}"
            f"{'vs AdamW':>9}{'MiB/step before':>16}{'mean':>9}{'after':>9}{'mean':>9}"
            f"{'vs AdamW':>9}{'mean':>9}{'step ms':>9}{'mean':>8}{'vs AdamW':>9}{'mean':>7}")
    checks = []
    by = groups(runs)
    ev = meta["eval_interval"]
    for kind in ("convergence", "timing"):
        keys = sorted((k for k in by if k[0] == kind and k[2] in OPTIMIZERS),
                      key=lambda k: (k[1], OPTIMIZERS.index(k[2])))
        if not keys:
            continue
        title = ("convergence runs (step time: a single run each, one after the other)"
                 if kind == "convergence" else
                 "timing runs (the optimizers alternating; step time over all runs)")
        out += ["", title, head, "-" * len(head)]
        for k in keys:
            group, a = by[k], by.get((kind, k[1], "adam"))
            freeze = _freeze_of(by, *k)
            if a is None or freeze is None:
                continue
            r = group[0]
            before, after = range(2, freeze + 1), _after(freeze, r["iters"])
            b0, b0m = bytes_per_step(group, before), bytes_per_step(group, before, "mean")
            b1, b1m = bytes_per_step(group, after), bytes_per_step(group, after, "mean")
            a1, a1m = bytes_per_step(a, after), bytes_per_step(a, after, "mean")
            ms, msm = step_ms(group, after, ev), step_ms(group, after, ev, "mean")
            ams, amsm = step_ms(a, after, ev), step_ms(a, after, ev, "mean")
            vals = sorted({x["final_val"] for x in group})
            vr = r["final_val"] / a[0]["final_val"]
            out.append(f"{LABELS[k[2]]:<11}{k[1]:>3}{r['iters']:>6}{len(group):>5}"
                       f"{r['freeze'] or '-':>7}{r['final_val']:>10.4f}{vr:>9.4f}"
                       f"{_mb(b0):>16}{_mb(b0m):>9}{_mb(b1):>9}{_mb(b1m):>9}"
                       f"{_ratio(b1 / a1):>9}{_ratio(b1m / a1m):>9}{ms:>9.1f}{msm:>8.1f}"
                       f"{ms / ams:>8.2f}x{msm / amsm:>6.2f}x"
                       + ("  (median per run: " + ", ".join(f"{step_ms([x], after, ev):.0f}"
                                                            for x in group) + ")"
                          if len(group) > 1 else "")
                       + (f"  (final val over runs: {vals[0]:.4f}-{vals[-1]:.4f})"
                          if len(vals) > 1 else ""))
            if k[2] != "adam":
                checks.append((kind, r, a[0], vr, max(b1 / a1, b1m / a1m), after))
    out.append("")
    out.append("final val = pretrain's validation loss at the end of training ("
               f"{meta['eval_iters']} batches of 16 x 256 tokens); MiB/step = bytes this rank "
               "sends per\ntraining step (CommStats, ring accounting, largest over ranks), "
               "median and mean over iterations 2..F (before)\nand F+2..end (after; F = the "
               "row's freeze step: 1-bit Adam's freeze, 0/1 Adam's variance freeze; AdamW's "
               "row:\nthe first compressed optimizer's F); step ms = the log line's elapsed "
               "time per iteration, median and mean\nover F+2..end without post-evaluation "
               "iterations; 'vs AdamW' = this row / AdamW's row of the same kind and dp\n"
               "over the same iterations (bytes: after the freeze, median / mean).")
    if any("timed" in row for r in runs for row in r["ranks"][0]["iterations"]):
        out.append("where the time goes after the freeze (rank 0, ms, medians over the same "
                   "iterations; 'train step' = the\nwhole forward/backward + gradient sync + "
                   "optimizer step; rest = train step - optimizer step - finish_grad_sync;\n"
                   "inside 1-bit Adam's optimizer step: local grad norm, the overflow-flag "
                   "all-reduce (where ranks wait for\neach other), then 'fold + exchange + "
                   "update' (momentum fold, 'compressed all-reduce', AdamW update), whose\n"
                   "'compressed collectives' are the all-to-all + all-gather themselves; "
                   "inside 0/1 Adam's: the same grad norm\nand flag, then 'local step' (momentum "
                   "fold, AdamW update and, every interval, the 'synchronisation': the\n1-bit "
                   "'compressed all-reduce' of the change since the last one); 'synchronisation', "
                   "'compressed ...' and\n'train step on syncs' are medians over the "
                   "synchronisation steps only):")
        for k in sorted(by, key=lambda k: (k[0], k[1], OPTIMIZERS.index(k[2]))):
            if k[0] != "timing" and any(x[0] == "timing" and x[1] == k[1] for x in by):
                continue
            freeze = _freeze_of(by, *k)
            if freeze is None:
                continue
            b = breakdown(by[k], _after(freeze, by[k][0]["iters"]), ev)
            out.append(f"  {k[0]:<11} dp {k[1]} {LABELS[k[2]]:<11}"
                       + ", ".join(f"{n} {v:.1f}" for n, v in b.items()))
    seen = set()
    for kind, r, a, vr, br, after in checks:
        n, dp, opt, label = r["params"], r["dp"], r["optimizer"], LABELS[r["optimizer"]]
        if (dp, opt) not in seen:
            seen.add((dp, opt))
            P = -(-n // (8 * dp)) * 8 * dp
            expect = 2 * (dp - 1) / dp * P / 8 + 8 * (dp - 1)
            _, akinds = kinds_per_step(a, after)
            if opt == "onebitadam":
                _, kinds = kinds_per_step(r, after)
                out.append(f"dp {dp}: {n:,} parameters; after the freeze 1-bit Adam sends "
                           + ", ".join(f"{k} {v:,.0f}" for k, v in kinds.items())
                           + f" B per step (compressed exchange expected {expect:,.0f} B = "
                           "2(n-1)/n P/8 + 8(n-1)); AdamW sends "
                           + ", ".join(f"{k} {v:,.0f}" for k, v in akinds.items()) + " B")
            else:
                ns, sync = kinds_per_step(r, after, _is_sync)
                nl, local = kinds_per_step(r, after, lambda row: not _is_sync(row))
                nb, full = kinds_per_step(r, range(2, r["freeze"] + 1),
                                          lambda row: not _is_sync(row))
                out.append(f"dp {dp}: {n:,} parameters; 0/1 Adam ({kind} run, iterations "
                           f"{after.start}..{after.stop - 1}) sends on its {ns} "
                           "synchronisations "
                           + ", ".join(f"{k} {v:,.0f}" for k, v in sync.items())
                           + f" B (compressed exchange expected {expect:,.0f} B), on its {nl} "
                           "local steps "
                           + ", ".join(f"{k} {v:,.0f}" for k, v in local.items())
                           + f" B; before V on its {nb} full-precision steps "
                           + ", ".join(f"{k} {v:,.0f}" for k, v in full.items()) + " B")
            out.append(f"dp {dp}: {label}'s bytes per step after the freeze {_ratio(br)} of "
                       f"AdamW's (the larger of median and mean; target <= 0.25): "
                       f"{'MET' if br <= 0.25 else 'MISSED'}")
        if kind == "convergence":
            out.append(f"dp {dp}, {r['iters']} iterations: {label}'s final validation loss "
                       f"{r['final_val']:.4f} vs AdamW's {a['final_val']:.4f}: "
                       f"{vr - 1:+.2%} (target within 2%): "
                       f"{'MET' if abs(vr - 1) <= 0.02 else 'MISSED'}")
            la = {t["iteration"]: t["loss"] for t in a["train"]}
            parts = []
            for name, its in phases(r):
                d = [t["loss"] - la[t["iteration"]] for t in r["train"]
                     if t["iteration"] in its and t["iteration"] in la]
                if d:
                    parts.append(f"{name} {statistics.fmean(d):+.4f}")
            va = dict(map(tuple, a["val"]))
            vd = [f"{i} {v - va[i]:+.4f}" for i, v in r["val"] if i in va]
            out.append(f"  {label} - AdamW, training loss, mean per iteration over each phase: "
                       + ", ".join(parts) + "; validation: " + ", ".join(vd)
                       + f", end {r['final_val'] - a['final_val']:+.4f}")
    return out


# ---- the PNG -------------------------------------------------------------------------------
def _running_mean(xs: list[float], w: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= w:
            acc -= xs[i - w]
        out.append(acc / min(i + 1, w))
    return out


def write_png(runs: list[dict], path: str) -> bool:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print(f"matplotlib is not installed: skipping {path} (pip install matplotlib)")
        return False
    conv = sorted((r for r in runs if r["kind"] == "convergence" and r["optimizer"] in LABELS),
                  key=lambda r: OPTIMIZERS.index(r["optimizer"]))
    if len(conv) < 2 or conv[0]["optimizer"] != "adam":
        print(f"no convergence runs of AdamW and a compressed optimizer: skipping {path}")
        return False
    fig = Figure(figsize=(10, 10.5), dpi=110)
    FigureCanvasAgg(fig)
    ax, dx, bx = fig.subplots(3, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1.6, 1.4]})
    smooth = {}
    for r in conv:
        c, lab = COLORS[r["optimizer"]], LABELS[r["optimizer"]]
        its = [t["iteration"] for t in r["train"]]
        loss = [t["loss"] for t in r["train"]]
        smooth[r["optimizer"]] = dict(zip(its, _running_mean(loss, 20)))
        ax.plot(its, loss, color=c, alpha=0.15, lw=0.7)
        ax.plot(its, _running_mean(loss, 20), color=c, lw=1.6,
                label=f"{lab}: training loss (running mean of 20)")
        vx = [v[0] for v in r["val"]] + [r["iters"]]
        vy = [v[1] for v in r["val"]] + [r["final_val"]]
        ax.plot(vx, vy, "o--", color=c, ms=5, lw=1,
                label=f"{lab}: validation loss (final {r['final_val']:.4f})")
        rows = r["ranks"][0]["iterations"]
        xs, ys = [x["iteration"] for x in rows], [x["sent"] / 2**20 for x in rows]
        if r["optimizer"] == "zerooneadam":  # alternates between ~0 and 1-bit: points
            bx.plot(xs, ys, ".", color=c, ms=2.5, label=lab)
        else:
            bx.plot(xs, ys, color=c, lw=1.4, drawstyle="steps-mid", label=lab)
    a = conv[0]
    va = dict(map(tuple, a["val"] + [[a["iters"], a["final_val"]]]))
    for r in conv[1:]:
        c, lab, o = COLORS[r["optimizer"]], LABELS[r["optimizer"]], r["optimizer"]
        its = sorted(set(smooth["adam"]) & set(smooth[o]))
        dx.plot(its, [smooth[o][i] - smooth["adam"][i] for i in its], color=c, lw=1.2,
                label=f"{lab}: training loss, running means of 20")
        vo = dict(map(tuple, r["val"] + [[r["iters"], r["final_val"]]]))
        common = sorted(set(va) & set(vo))
        dx.plot(common, [vo[i] - va[i] for i in common], "s--", color=c, ms=5, lw=1,
                alpha=0.7, label=f"{lab}: validation loss")
    dx.axhline(0, color="gray", lw=0.8)
    dx.set_ylabel("minus AdamW")
    dx.legend(fontsize=7, ncol=2)
    marks = {}
    for r in conv[1:]:
        marks.setdefault(r["freeze"], []).append(
            "freeze" if r["optimizer"] == "onebitadam" else "var freeze")
        for name, its in phases(r)[2:]:  # 0/1 Adam: where its local-step interval doubles
            marks.setdefault(its.start - 1, []).append("->" + name.split()[1])
    for a_ in (ax, dx, bx):
        for x in marks:
            a_.axvline(x, color="gray", ls=":", lw=1)
        a_.grid(alpha=0.3)
    for x, names in marks.items():
        ax.text(x, ax.get_ylim()[1], " " + "/".join(dict.fromkeys(names)), va="top",
                color="gray", fontsize=8)
    ax.set_ylabel("lm loss")
    ax.legend(fontsize=8)
    dp = conv[0]["dp"]
    zo = next((r for r in conv if r["optimizer"] == "zerooneadam"), None)
    note = ""
    if zo is not None:
        s = zo.get("settings") or {}
        note = ("\n0/1 Adam: var freeze " + str(s.get("var_freeze_step")) + ", var update scaler "
                + str(s.get("var_update_scaler")) + ", local-step interval 1 doubling every "
                + str(s.get("local_step_scaler")) + " steps up to "
                + str(s.get("local_step_clipper")) + " (marks '->k': interval k from there)")
    ax.set_title(f"README GPT-2 on the default corpus, dp {dp} (gloo), seed "
                 f"{conv[0].get('seed', '')}: " + " vs ".join(LABELS[r["optimizer"]]
                                                             for r in conv) + note,
                 fontsize=9)
    bx.set_yscale("log")
    bx.set_ylabel("MiB sent per rank\nper step (rank 0)")
    bx.set_xlabel("iteration")
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return True


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--only", choices=["all", "convergence", "timing"], default="all",
                        help="which runs to make")
    parser.add_argument("--iters", type=int, default=600, help="convergence run length")
    parser.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS),
                        help="the optimizers to run (AdamW is the reference of every ratio)")
    parser.add_argument("--freeze-step", type=int, default=100,
                        help="1-bit Adam's freeze step in the convergence runs")
    parser.add_argument("--var-freeze-step", type=int, default=None,
                        help="0/1 Adam's last variance update in the convergence runs "
                             "(default: --freeze-step)")
    parser.add_argument("--var-update-scaler", type=int, default=16,
                        help="0/1 Adam: variance updates between doublings of their interval")
    parser.add_argument("--local-step-scaler", type=int, default=125,
                        help="0/1 Adam: steps between doublings of the local-step interval in "
                             "the convergence runs (the timing runs scale it to their length)")
    parser.add_argument("--local-step-clipper", type=int, default=8,
                        help="0/1 Adam: the largest local-step interval")
    parser.add_argument("--dp", type=int, default=2, help="dp of the convergence runs")
    parser.add_argument("--timing-dp", type=int, nargs="*", default=[2, 4],
                        help="dp sizes of the short timing runs (step time, bytes)")
    parser.add_argument("--timing-iters", type=int, default=60)
    parser.add_argument("--timing-freeze", type=int, default=20)
    parser.add_argument("--timing-repeats", type=int, default=2,
                        help="timing runs per optimizer and dp, the optimizers alternating")
    parser.add_argument("--eval-interval", type=int, default=100)
    parser.add_argument("--eval-iters", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--png", default=None, help="draw the convergence curves to this PNG")
    parser.add_argument("--json", default=None, help="write the parsed runs to this file")
    parser.add_argument("--replot", nargs="+", default=None, metavar="JSON",
                        help="print the table and draw the PNG from --json files (their runs "
                             "merged); no training")
    args, rest = parser.parse_known_args()
    if args.probe is not None:
        probe(args.probe, rest[1:] if rest[:1] == ["--"] else rest)
        return
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.replot:
        runs, metas = [], []
        for path in args.replot:
            with open(path) as f:
                saved = json.load(f)
            runs += saved["runs"]
            metas.append(saved["meta"])
        meta = dict(metas[0], wall_s=sum(m["wall_s"] for m in metas),
                    logs=", ".join(m["logs"] for m in metas))
    else:
        import torch

        t0 = time.time()
        outdir = tempfile.mkdtemp(prefix="bench_onebit_")
        meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
                "machine": f"{os.cpu_count()} cores {platform.processor() or platform.machine()}",
                "eval_interval": args.eval_interval, "eval_iters": args.eval_iters,
                "seed": args.seed, "logs": outdir}
        runs = []
        if args.only in ("all", "convergence"):
            for opt in args.optimizers:
                runs.append(run(f"{opt}_dp{args.dp}", "convergence", opt, args.dp, args.iters,
                                optimizer_settings(opt, args, timing=False), args, outdir))
        if args.only in ("all", "timing"):
            for dp in args.timing_dp:
                for rep in range(args.timing_repeats):
                    for opt in args.optimizers:
                        runs.append(run(f"{opt}_dp{dp}_timing{rep}", "timing", opt, dp,
                                        args.timing_iters,
                                        optimizer_settings(opt, args, timing=True), args,
                                        outdir))
        for r in runs:
            r["seed"] = args.seed
        meta["wall_s"] = time.time() - t0
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "runs": runs}, f)
    print()
    print(f"README GPT-2 (scripts/pretrain_gpt2.sh's model) on the default corpus, "
          f"pretrain_gpt2.py under torch.distributed.run, gloo, 1 thread per rank, seed "
          f"{meta['seed']}; {meta['date']}, {meta['machine']}, torch {meta['torch']}; "
          f"megazero from {runs[0]['megazero']}; {meta['wall_s']:.0f} s in all "
          f"(logs in {meta['logs']})")
    print("runs (wall time, 1-min load average before -> after): " + "; ".join(
        f"{r['name']} {r['wall_s']:.0f} s ("
        + (f"{r['load'][0]:.1f} -> {r['load'][1]:.1f})" if r.get("load") else "not recorded)")
        for r in runs))
    for line in report(runs, meta):
        print(line)
    if args.png and write_png(runs, args.png):
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
