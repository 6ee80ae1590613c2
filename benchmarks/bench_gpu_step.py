"""GPT-2's training step on one GPU: megazero against its peers, in one run (issue 27, item 5).

Contenders (``contender:variant``), each job (contender x model) in a process of its own (this
script as a child, gpu_step_jobs.py), jobs interleaved and their order rotated every round,
as many rounds as ``--budget-s`` allows (a job that does not fit is skipped, with the reason):

  megazero:eager        pretrain() with Megatron's flags: --bf16, --mock-data, one GPU
  megazero:compile      the same with --compile (skipped when pretrain_gpt2.py refuses it)
  plain-gpt2:compile    nanoGPT-style GPT-2 (gpt2_plain.py) under torch.compile, SDPA flash
  plain-gpt2:eager      the same, eager
  megatron-core:eager   GPTModel, local spec, Megatron's DDP/optimizer/schedule (needs
                        megatron-core importable on the GPU host: pip install megatron-core)

Models: gpt2-345m (24 layers, h 1024, 16 heads, seq 1024, mb 8, gbs 16) and gpt2-1.3b (24
layers, h 2048, 16 heads, seq 2048, gbs 16, the largest micro-batch of 8, 4, 2, 1 that fits).
Vocabulary 50257, padded to 50304. Every contender is timed by the same clock (synchronize,
wall time, synchronize around each iteration; median after the warm-up), and measured by the
same yardsticks: tokens/s, model TFLOP/s by megazero's own formula (the log line's TFLOP/s
per rank: Megatron's 72 B s L h^2 (1 + s/6h + V/12Lh)), MFU against the device's dense bf16
peak (989 TFLOP/s for H100/H200 SXM, 312 for A100; ``--peak-tflops`` or $PEAK_TFLOPS
overrides), peak memory, launches in one profiled iteration and the GPU-busy fraction.
Prints a table; ``--json`` writes ``{"schema": "megazero.bench_gpu_step/1", "date", "device",
"gpu_count", "torch", "cuda", "peak_tflops", "results": [row, ...]}``, a row per job with the
keys of ``ROW_KEYS`` (shape, ``status``, ``iter_ms``, ``tokens_per_s``, ``model_tflops_per_s``,
``mfu``, ``peak_mem_gib``, ``launches_per_iter``, ``gpu_busy``, ``first_iter_s``, ...): what
``python -m megazero.plan.calibrate --gpu-step`` reads.

Without a CUDA device every row is "skipped: no CUDA device" (exit 0); ``--device cpu
--tiny`` is the CPU smoke run the tests use (tiny shapes, CPU ops for launches).

    python benchmarks/bench_gpu_step.py --json results.json [--budget-s 290]
    python benchmarks/bench_gpu_step.py --device cpu --tiny --contenders plain-gpt2:eager
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, ROOT)

from benchmarks import gpu_step_jobs  # noqa: E402
from megazero.arguments import parse_args  # noqa: E402
from megazero.training.log import flops_per_iteration  # noqa: E402

SCHEMA = "megazero.bench_gpu_step/1"
# (contender, variant) in priority order: what runs first when the budget is short
CONTENDERS = [("megazero", "eager"), ("plain-gpt2", "compile"), ("megazero", "compile"),
              ("megatron-core", "eager"), ("plain-gpt2", "eager")]
_GPT2 = {"num_layers": 24, "num_attention_heads": 16, "global_batch_size": 16,
         "vocab_size": 50257}
MODELS = {"gpt2-345m": {**_GPT2, "hidden_size": 1024, "seq_length": 1024,
                        "micro_batch_sizes": [8, 4, 2, 1]},
          "gpt2-1.3b": {**_GPT2, "hidden_size": 2048, "seq_length": 2048,
                        "micro_batch_sizes": [8, 4, 2, 1]}}
_TINY = {"num_layers": 2, "num_attention_heads": 4, "global_batch_size": 4, "vocab_size": 500}
TINY = {"gpt2-345m": {**_TINY, "hidden_size": 64, "seq_length": 64, "micro_batch_sizes": [2]},
        "gpt2-1.3b": {**_TINY, "hidden_size": 128, "seq_length": 128,
                      "micro_batch_sizes": [4, 2, 1]}}
# Dense bf16 tensor-core peaks, TFLOP/s, by a substring of the device name (as
# scripts/gpu_check_report.py's PEAK_BF16_FLOPS)
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
ROW_KEYS = ("contender", "variant", "model", "num_layers", "hidden_size",
            "num_attention_heads", "seq_length", "vocab_size", "micro_batch_size",
            "global_batch_size", "dtype", "status", "iterations", "iter_ms", "tokens_per_s",
            "model_tflops_per_s", "mfu", "peak_mem_gib", "launches_per_iter", "gpu_busy",
            "first_iter_s")


def padded(vocab: int, multiple: int = 128) -> int:
    return -(-vocab // multiple) * multiple


def peak_tflops(device_name: str, override: float | None) -> float | None:
    if override:
        return override
    for key, value in PEAK_TFLOPS.items():
        if key in device_name.upper():
            return value
    return None


def round_order(jobs: list, r: int) -> list:
    """Round ``r``'s order: the job list rotated by r (round 0: priority order)."""
    k = r % len(jobs) if jobs else 0
    return jobs[k:] + jobs[:k]


def megazero_compile_refused(spec: dict) -> str | None:
    """Why pretrain_gpt2.py's parser refuses --compile, or None when it accepts it."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parse_args(gpu_step_jobs.megazero_args(spec, spec["micro_batch_sizes"][0], True))
    except SystemExit:
        lines = err.getvalue().strip().splitlines()
        return f"--compile not available ({lines[-1] if lines else 'refused'})"
    return None


def model_flops(spec: dict) -> float:
    """megazero's FLOPs per iteration (training/log.py), on the padded vocabulary."""
    config = parse_args(gpu_step_jobs.megazero_args(spec, spec["micro_batch_sizes"][0], False))
    config.model.vocab_size = padded(spec["vocab_size"])
    return flops_per_iteration(config)


class Job:
    """One contender x model: its spec, what its rounds measured, its status."""

    def __init__(self, contender, variant, model, shape, args):
        self.key = f"{contender}:{variant}:{model}"
        self.spec = {"contender": contender, "variant": variant, "model": model, **shape,
                     "device": "cuda:0" if args.device == "cuda" else "cpu",
                     "warmup": args.warmup, "iters": args.iters}
        self.status: str | None = None
        self.results: list[dict] = []
        self.duration: float | None = None

    def run(self, timeout: float, log_dir: str, r: int) -> None:
        """One round in a child process (within ``timeout`` seconds)."""
        name = self.key.replace(":", "-")
        out = os.path.join(log_dir, f"{name}-r{r}.json")
        spec = {**self.spec, "out": out}
        if self.results:  # later rounds: the micro-batch the first one found
            spec["micro_batch_sizes"] = [self.results[0]["micro_batch_size"]]
        spec_path = os.path.join(log_dir, f"{name}-r{r}.spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        env = dict(os.environ)
        if self.spec["device"] == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        log = os.path.join(log_dir, f"{name}-r{r}.log")
        start = time.monotonic()
        with open(log, "w") as logf:
            try:
                proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                                       spec_path], cwd=ROOT, env=env, stdout=logf,
                                      stderr=subprocess.STDOUT, timeout=max(timeout, 1))
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                rc = None
        self.duration = time.monotonic() - start
        if rc is None:
            if not self.results:
                self.status = (f"skipped: did not finish within the budget ({timeout:.0f} s "
                               f"left when it started)")
            return
        if rc != 0 or not os.path.exists(out):
            if not self.results:
                self.status = f"failed: exit {rc}: {_last_error(log)}"
            return
        with open(out) as fr:
            result = json.load(fr)
        if not self.results:
            self.status = result["status"]
        if result["status"] == "ok":
            self.results.append(result)

    def row(self, flops: float, peak: float | None) -> dict:
        s = self.spec
        row = dict.fromkeys(ROW_KEYS)
        row.update(contender=s["contender"], variant=s["variant"], model=s["model"],
                   num_layers=s["num_layers"], hidden_size=s["hidden_size"],
                   num_attention_heads=s["num_attention_heads"], seq_length=s["seq_length"],
                   vocab_size=padded(s["vocab_size"]),
                   global_batch_size=s["global_batch_size"], dtype="bf16",
                   micro_batch_size=s["micro_batch_sizes"][0], status=self.status, iterations=0)
        if self.status != "ok" or not self.results:
            return row
        timed = [t for r in self.results for t in r["times"][r["warmup"]:]]
        iter_s = statistics.median(timed)
        first = self.results[0]
        busy = [r["busy_s"] for r in self.results if r["busy_s"] is not None]
        peaks = [r["peak_mem_bytes"] for r in self.results if r["peak_mem_bytes"] is not None]
        tflops = flops / iter_s / 1e12
        row.update(micro_batch_size=first["micro_batch_size"], iterations=len(timed),
                   iter_ms=iter_s * 1e3,
                   tokens_per_s=s["global_batch_size"] * s["seq_length"] / iter_s,
                   model_tflops_per_s=tflops, mfu=tflops / peak if peak else None,
                   peak_mem_gib=max(peaks) / 2**30 if peaks else None,
                   launches_per_iter=first["launches"],
                   gpu_busy=min(1.0, statistics.median(busy) / iter_s) if busy else None,
                   first_iter_s=first["first_iter_s"])
        return row


def _last_error(log: str) -> str:
    with open(log, errors="replace") as f:
        lines = [ln.strip() for ln in f if ln.strip()]
    why = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln),
               lines[-1] if lines else "no output")
    return why[:300]


def build_jobs(args) -> list[Job]:
    shapes = TINY if args.tiny else MODELS
    wanted = [c.strip() for c in args.contenders.split(",") if c.strip()]
    pairs = [(c, v) for c, v in CONTENDERS
             if f"{c}:{v}" in wanted or c in wanted or "all" in wanted]
    models = [m.strip() for m in args.models.split(",")]
    main = [p for p in pairs if p in CONTENDERS[:2]]
    # megazero and the compiled peer at each size first, then the others
    return [Job(c, v, m, shapes[m], args) for m in models for c, v in main] + \
        [Job(c, v, m, shapes[m], args) for c, v in pairs if (c, v) not in main for m in models]


def run_rounds(jobs: list[Job], args, log_dir: str) -> None:
    """Round 0 runs every job in priority order; later rounds rerun the jobs that measured,
    rotated, while their last duration fits in what is left of the budget."""
    deadline = time.monotonic() + args.budget_s
    for r in range(args.rounds):
        active = jobs if r == 0 else [j for j in jobs if j.status == "ok"]
        for job in round_order(active, r):
            if job.status is not None and job.status != "ok":
                continue
            left = deadline - time.monotonic()
            if r == 0 and left < args.min_job_s:
                job.status = f"skipped: budget spent ({max(left, 0):.0f} s of " \
                             f"{args.budget_s:.0f} s left)"
                continue
            if r > 0 and (job.duration is None or left < 1.2 * job.duration):
                continue
            print(f"[bench_gpu_step] round {r}: {job.key} ({left:.0f} s left)", flush=True)
            job.run(left, log_dir, r)


def _num(row: dict, key: str, fmt: str) -> str:
    width = fmt.split(".")[0].rstrip(",d")  # "9.1f" -> 9, "10,.0f" -> 10, "9,d" -> 9
    return format(row[key], fmt) if row[key] is not None else format("n/a", f">{width}")


def table(doc: dict) -> str:
    lines = [f"GPT-2 training step on {doc['device']} (torch {doc['torch']}, CUDA "
             f"{doc['cuda']}), MFU of {doc['peak_tflops'] or 'n/a'} TFLOP/s bf16 peak",
             f"{'contender':<22}{'model':<11}{'mb':>3}{'iter ms':>9}{'tokens/s':>10}"
             f"{'TFLOP/s':>9}{'MFU':>7}{'peak GiB':>9}{'launches':>9}{'busy':>6}"
             f"{'first s':>8}"]
    lines.append("-" * len(lines[1]))
    for r in doc["results"]:
        name = f"{r['contender']}:{r['variant']}"
        if r["status"] != "ok":
            lines.append(f"{name:<22}{r['model']:<11}{r['micro_batch_size']:>3}  {r['status']}")
            continue

        mfu = f"{100 * r['mfu']:6.1f}%" if r["mfu"] is not None else "    n/a"
        lines.append(f"{name:<22}{r['model']:<11}{r['micro_batch_size']:>3}"
                     f"{_num(r, 'iter_ms', '9.1f')}{_num(r, 'tokens_per_s', '10,.0f')}"
                     f"{_num(r, 'model_tflops_per_s', '9.1f')}{mfu}"
                     f"{_num(r, 'peak_mem_gib', '9.2f')}{_num(r, 'launches_per_iter', '9,d')}"
                     f"{_num(r, 'gpu_busy', '6.2f')}{_num(r, 'first_iter_s', '8.1f')}")
    return "\n".join(lines)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the results here (the JSON of the module doc)")
    p.add_argument("--log-dir", help="children's specs, results and logs (default: a temporary "
                                     "folder, or beside --json)")
    p.add_argument("--budget-s", type=float, default=290.0,
                   help="wall-clock budget of all jobs and rounds (default 290)")
    p.add_argument("--min-job-s", type=float, default=20.0,
                   help="a job is not started with less than this left (default 20)")
    p.add_argument("--rounds", type=int, default=3, help="rounds at most (default 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations (default 2)")
    p.add_argument("--iters", type=int, default=8, help="timed iterations (default 8)")
    p.add_argument("--contenders", default="all",
                   help="comma-separated contender or contender:variant (default all)")
    p.add_argument("--models", default="gpt2-345m,gpt2-1.3b")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU smoke run)")
    p.add_argument("--peak-tflops", type=float,
                   default=float(os.environ["PEAK_TFLOPS"]) if os.environ.get("PEAK_TFLOPS")
                   else None, help="dense bf16 peak for MFU ($PEAK_TFLOPS)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    names = {c for c, _ in CONTENDERS} | {f"{c}:{v}" for c, v in CONTENDERS} | {"all"}
    bad = [c for c in args.contenders.split(",") if c.strip() and c.strip() not in names]
    bad += [m for m in args.models.split(",") if m.strip() not in MODELS]
    if bad:
        p.error(f"unknown contender or model: {', '.join(bad)}")
    if args.device == "cpu" and not args.tiny:
        p.error("--device cpu runs the smoke test: add --tiny")
    if args.warmup < 1 or args.iters < 1 or args.rounds < 1:
        p.error("--warmup, --iters and --rounds must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.child:
        with open(args.child) as f:
            spec = json.load(f)
        result = gpu_step_jobs.run_job(spec)
        if spec["device"].startswith("cuda"):
            result["device_name"] = torch.cuda.get_device_name()
        with open(spec["out"], "w") as f:
            json.dump(result, f)
        return 0
    jobs = build_jobs(args)
    device, cuda = "cpu", None
    if args.device == "cuda" and not torch.cuda.is_available():
        for job in jobs:
            job.status = "skipped: no CUDA device"
    else:
        for job in jobs:
            if job.spec["contender"] == "megazero" and job.spec["variant"] == "compile":
                why = megazero_compile_refused(job.spec)
                job.status = f"skipped: {why}" if why else None
        log_dir = args.log_dir or (os.path.splitext(args.json)[0] if args.json
                                   else tempfile.mkdtemp(prefix="bench-gpu-step-"))
        os.makedirs(log_dir, exist_ok=True)
        run_rounds(jobs, args, log_dir)
        names = [r.get("device_name") for j in jobs for r in j.results if r.get("device_name")]
        device = names[0] if names else ("cuda" if args.device == "cuda" else "cpu")
        cuda = torch.version.cuda if args.device == "cuda" else None
    peak = peak_tflops(device, args.peak_tflops) if args.device == "cuda" or \
        args.peak_tflops else None
    doc = {"schema": SCHEMA, "date": datetime.date.today().isoformat(), "device": device,
           "gpu_count": torch.cuda.device_count() if args.device == "cuda" else 0,
           "torch": torch.__version__, "cuda": cuda, "peak_tflops": peak,
           "results": [j.row(model_flops(j.spec), peak) for j in jobs]}
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: every contender skipped")
    print(table(doc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
