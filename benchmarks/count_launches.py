"""Kernel launches and host syncs per training iteration of GPT-2 on one GPU, counted on a CPU.

Every contender runs its real training step on fake CUDA tensors (``FakeTensorMode`` with the
dry run's fake CUDA runtime preloaded: shapes, no memory, no GPU) under megazero's own
counter, ``megazero.dryrun.launches.DeviceOpCounter``, which classifies each dispatched op as
a launch (multi-tensor ops by ATen's chunking) or a host sync, by phase. Contenders, at the
same shapes, each in a child process:

* ``megazero``: ``pretrain_gpt2.py --mock-data --dry-run-rank 0 --dry-run-world-size 1
  --dry-run-iters 2`` (its dry run counts the same way); the iteration that does not log;
* ``plain-gpt2``: the nanoGPT-style GPT-2 of ``gpt2_plain.py``, eager (fp32 weights under
  bf16 autocast, fused AdamW, foreach clipping); the second iteration (the first creates the
  optimizer's states);
* ``megatron-core``: ``GPTModel`` with the local spec, Megatron's DDP, optimizer and schedule
  (``megatron_core_gpt.py``); the second iteration. Values its host reads are 1 (its grad
  norm: the clipping it does only above 1.0 is counted, as the others' always-on clipping).

On fake CUDA the attention core of the plain GPT-2 is the kernel ``scaled_dot_product_attention``
takes on an sm_80+ GPU (flash attention for bf16 causal), called directly, as megazero's dry
run does: a CPU build of torch has no CUDA kernels to choose from. Megatron-core's local spec
computes attention unfused (baddbmm, softmax, bmm) on a GPU too.

    python benchmarks/count_launches.py                       # GPT-2 345M, mb 8, gbs 16, bf16
    python benchmarks/count_launches.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 \
        --seq-length 32 --micro-batch-size 2 --global-batch-size 4 --json counts.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, ROOT)

from benchmarks import gpt2_plain, megatron_core_gpt  # noqa: E402
from benchmarks.megatron_core_gpt import Shape  # noqa: E402
from megazero.dryrun import fake_cuda  # noqa: E402
from megazero.dryrun.launches import DeviceOpCounter  # noqa: E402

CONTENDERS = ("megazero", "plain-gpt2", "megatron-core")
PHASES = ("forward", "backward", "optimizer", "communication", "other")


def gpu_attention(q, k, v, dropout_p: float):
    """The kernel SDPA runs on an sm_80+ GPU for causal q, k, v ``[b, nh, t, hs]``: flash
    attention for fp16/bf16 and head dims of at most 256 that are multiples of 8, else the
    memory-efficient kernel."""
    hs = q.shape[-1]
    if q.dtype in (torch.float16, torch.bfloat16) and hs % 8 == 0 and hs <= 256:
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, True)[0]
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, dropout_p, True)[0]


def _iteration(counter: DeviceOpCounter, index: int) -> dict:
    """Iteration ``index`` (1-based) of the counter, every op kept, in this tool's format."""
    return _row(counter.iterations[index - 1].as_dict(top=None))


def _row(it: dict) -> dict:
    return {"status": "ok", "iteration": it["iteration"],
            "kernel_launches": it["kernel_launches"], "host_syncs": it["host_syncs"],
            "launches_by_phase": it["launches_by_phase"],
            "syncs_by_phase": it["syncs_by_phase"], "syncs": it["syncs"],
            "launches_by_op": it["launches_by_op"], "launches_by_module": it["launches_by_module"]}


def _batches(shape: Shape) -> list:
    """The micro-batches of one iteration: (tokens, labels) ``[b, s]`` on the host."""
    size = (shape.micro_batch_size, shape.seq_length)
    return [(torch.randint(0, shape.vocab_size, size), torch.randint(0, shape.vocab_size, size))
            for _ in range(shape.num_microbatches)]


def count_plain(shape: Shape) -> dict:
    """Launches and syncs of the plain GPT-2's second iteration (fake CUDA, this process)."""
    cfg = gpt2_plain.GPT2Config(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, num_heads=shape.num_heads,
        seq_length=shape.seq_length, vocab_size=shape.vocab_size,
        make_vocab_size_divisible_by=shape.make_vocab_size_divisible_by,
        hidden_dropout=shape.dropout, attention_dropout=shape.dropout)
    counter = DeviceOpCounter("cuda", root=ROOT)

    def forward(micro_batches, model):  # the forward step shape the counter marks
        return gpt2_plain.forward_backward(model, micro_batches), lambda loss: loss

    with megatron_core_gpt.fake_cuda_shims(), FakeTensorMode(allow_non_fake_inputs=True), \
            counter:
        model = gpt2_plain.GPT2(cfg, attention=gpu_attention, device="cuda")
        optimizer = gpt2_plain.make_optimizer(model)
        batches = _batches(shape)
        for iteration in (1, 2):
            counter.start_iteration(iteration)
            counter.forward_step(forward)(batches, model)
            with counter.phase("optimizer"):
                gpt2_plain.optimizer_step(model, optimizer)
            counter.end_iteration()
    return _iteration(counter, 2)


def count_megatron_core(shape: Shape) -> dict:
    """Launches and syncs of Megatron-core's second iteration (fake CUDA, this process)."""
    why = megatron_core_gpt.import_error()
    if why:
        return {"status": f"skipped: {why}"}
    counter = DeviceOpCounter("cuda", root=ROOT)
    megatron_core_gpt.init_parallel_state(fake=True)
    with megatron_core_gpt.fake_cuda_shims(), FakeTensorMode(allow_non_fake_inputs=True), \
            megatron_core_gpt.HostReadsAsOnes(), counter:
        runner = megatron_core_gpt.MegatronCoreGPT(shape)
        batches = _batches(shape)
        for iteration in (1, 2):
            counter.start_iteration(iteration)
            runner.step(batches, wrap_forward_step=counter.forward_step,
                        optimizer_phase=lambda: counter.phase("optimizer"))
            counter.end_iteration()
    row = _iteration(counter, 2)
    row["note"] = ("multi-tensor norm/scale as torch foreach (no Apex/TE)"
                   if runner.foreach_ops else "Apex/TE multi-tensor kernels")
    return row


def megazero_flags(shape: Shape) -> list[str]:
    """pretrain_gpt2.py's flags for ``shape`` on one GPU in bf16 (synthetic data)."""
    return [f"--{k}={v}" for k, v in (
        ("num-layers", shape.num_layers), ("hidden-size", shape.hidden_size),
        ("num-attention-heads", shape.num_heads), ("seq-length", shape.seq_length),
        ("max-position-embeddings", shape.seq_length),
        ("micro-batch-size", shape.micro_batch_size),
        ("global-batch-size", shape.global_batch_size), ("vocab-size", shape.vocab_size),
        ("make-vocab-size-divisible-by", shape.make_vocab_size_divisible_by),
        ("attention-dropout", shape.dropout), ("hidden-dropout", shape.dropout))] \
        + ["--bf16", "--mock-data"]


def count_megazero(shape: Shape, timeout: float = 1800) -> dict:
    """megazero's dry run of one rank of a world of one: its non-logging iteration."""
    with tempfile.TemporaryDirectory(prefix="count-launches-") as tmp:
        report = os.path.join(tmp, "report.json")
        cmd = [sys.executable, "pretrain_gpt2.py", *megazero_flags(shape), "--dry-run-rank", "0",
               "--dry-run-world-size", "1", "--dry-run-iters", "2",
               "--dry-run-report", report]
        done = subprocess.run(cmd, cwd=ROOT, env=fake_cuda.preload_env(), capture_output=True,
                              text=True, timeout=timeout)
        if done.returncode != 0 or not os.path.exists(report):
            tail = (done.stdout + done.stderr).strip().splitlines()[-1:] or ["no output"]
            return {"status": f"failed: pretrain_gpt2.py exit {done.returncode}: {tail[0]}"}
        with open(report) as f:
            data = json.load(f)
    counted = data["counted_iteration"]
    return _row(next(it for it in data["device_ops"] if it["iteration"] == counted))


def run_child(name: str, shape: Shape, timeout: float = 1800) -> dict:
    """``count_<name>`` in a child process with the fake CUDA runtime preloaded."""
    with tempfile.TemporaryDirectory(prefix="count-launches-") as tmp:
        out = os.path.join(tmp, "row.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--child-out", out,
               *shape_args(shape)]
        done = subprocess.run(cmd, cwd=ROOT, env=fake_cuda.preload_env(), capture_output=True,
                              text=True, timeout=timeout)
        if done.returncode != 0 or not os.path.exists(out):
            lines = (done.stdout + done.stderr).strip().splitlines()
            why = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln),
                       lines[-1] if lines else "no output")
            return {"status": f"failed: exit {done.returncode}: {why.strip()[:300]}"}
        with open(out) as f:
            return json.load(f)


def count(name: str, shape: Shape) -> dict:
    return count_megazero(shape) if name == "megazero" else run_child(name, shape)


def shape_args(shape: Shape) -> list[str]:
    return [f"--num-layers={shape.num_layers}", f"--hidden-size={shape.hidden_size}",
            f"--num-attention-heads={shape.num_heads}", f"--seq-length={shape.seq_length}",
            f"--micro-batch-size={shape.micro_batch_size}",
            f"--global-batch-size={shape.global_batch_size}",
            f"--vocab-size={shape.vocab_size}", f"--dropout={shape.dropout}",
            f"--make-vocab-size-divisible-by={shape.make_vocab_size_divisible_by}"]


def table(rows: dict, shape: Shape) -> str:
    head = (f"GPT-2 {shape.num_layers} layers, h {shape.hidden_size}, {shape.num_heads} heads, "
            f"seq {shape.seq_length}, mb {shape.micro_batch_size}, gbs "
            f"{shape.global_batch_size}, vocab {shape.vocab_size}, bf16, dropout "
            f"{shape.dropout}: per training iteration on one GPU (fake CUDA)")
    cols = f"{'contender':<15}{'launches/iter':>14}" + "".join(f"{p:>15}" for p in PHASES) \
        + f"{'host syncs/iter':>17}"
    lines = [head, cols, "-" * len(cols)]
    for name, r in rows.items():
        if r["status"] != "ok":
            lines.append(f"{name:<15}{r['status']}")
            continue
        by = r["launches_by_phase"]
        lines.append(f"{name:<15}{r['kernel_launches']:>14,}"
                     + "".join(f"{by.get(p, 0):>15,}" for p in PHASES)
                     + f"{r['host_syncs']:>17}")
    for name, r in rows.items():
        for s in r.get("syncs", []):
            lines.append(f"  sync ({name}, {s['phase']}): {s['kind']} x{s['count']} at "
                         f"{s['where']}")
        if r.get("note"):
            lines.append(f"  note ({name}): {r['note']}")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-layers", type=int, default=24)
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--num-attention-heads", type=int, default=16)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    p.add_argument("--dropout", type=float, default=0.0,
                   help="hidden and attention dropout of every contender")
    p.add_argument("--contenders", default=",".join(CONTENDERS),
                   help=f"comma-separated subset of {', '.join(CONTENDERS)}")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--child", choices=CONTENDERS[1:], help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = set(args.contenders.split(",")) - set(CONTENDERS)
    if unknown:
        p.error(f"--contenders: unknown {', '.join(sorted(unknown))} (choose from "
                f"{', '.join(CONTENDERS)})")
    if args.global_batch_size % args.micro_batch_size:
        p.error("--global-batch-size must be a multiple of --micro-batch-size")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    shape = Shape(args.num_layers, args.hidden_size, args.num_attention_heads, args.seq_length,
                  args.vocab_size, args.micro_batch_size, args.global_batch_size, args.dropout,
                  args.make_vocab_size_divisible_by)
    if args.child:
        if not fake_cuda.active():
            raise SystemExit("the child needs the fake CUDA runtime preloaded "
                             "(megazero.dryrun.fake_cuda.preload_env())")
        row = count_plain(shape) if args.child == "plain-gpt2" else count_megatron_core(shape)
        with open(args.child_out, "w") as f:
            json.dump(row, f)
        return 0
    rows = {name: count(name, shape) for name in args.contenders.split(",")}
    print(table(rows, shape))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"schema": "megazero.count_launches/1",
                       "date": datetime.date.today().isoformat(), "device": "cuda (fake)",
                       "torch": torch.__version__, "shape": vars(shape),
                       "results": [{"contender": n, **r} for n, r in rows.items()]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
