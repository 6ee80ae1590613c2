"""``python -m megazero.plan``: the fastest layouts of a job that fit, and their commands.

    python -m megazero.plan --model gpt3-175b --gpus 1024 --gpu a100-80g \\
        --global-batch-size 1536 --seq-length 2048 --top 10 [--fix tp=8 ...]
    python -m megazero.plan --model MODEL.json ...
    python -m megazero.plan --model "--num-layers 24 --hidden-size 2048 \\
        --num-attention-heads 16" ...

Prints one row per layout (predicted step time, tokens/s, MFU, memory per rank by kind,
bubble fraction, communication time per group), a line saying where the step times come
from (Megatron-2021-level kernels beside megazero's measured MFU, or megazero's calibrated
runtime factor: SYSTEM.json's ``megazero_runtime``) and the ``torchrun pretrain_gpt2.py``
line of each; ``--json`` writes the same as JSON. Exit status 2 on bad input, with the flag
named.
"""

from __future__ import annotations

import argparse
import json
import sys

from megazero.plan.layout import Job, command
from megazero.plan.memory import HEADROOM_BYTES, HEADROOM_FRACTION
from megazero.plan.models import parameter_count, resolve_model
from megazero.plan.search import PlanResult, parse_fix, plan
from megazero.plan.system import PlanInputError, load_system

GiB = 1 << 30


def say(*parts) -> None:
    """One line of the command's output (stdout)."""
    sys.stdout.write(" ".join(str(p) for p in parts) + "\n")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megazero.plan", description=__doc__.split(
        "\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, nargs="+",
                   help="a named model (gpt3-175b, megatron-1t, ...), MODEL.json, or "
                        "Megatron flags in one quoted string")
    p.add_argument("--gpus", type=int, required=True, help="ranks of the job")
    p.add_argument("--gpu", default="a100-80g",
                   help="a shipped system (a100-80g, h100-80g) or SYSTEM.json")
    p.add_argument("--global-batch-size", type=int, required=True)
    p.add_argument("--seq-length", type=int, default=None)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--fix", nargs="*", default=[], metavar="KEY=VALUE",
                   help="pin choices: tp pp dp v zero mb sp recompute offload")
    p.add_argument("--headroom", type=float, default=HEADROOM_FRACTION,
                   help="fraction of device memory kept free for allocator fragmentation "
                        f"and workspaces (default {HEADROOM_FRACTION})")
    p.add_argument("--headroom-gib", type=float, default=HEADROOM_BYTES / GiB,
                   help="GiB kept free on top (CUDA context, NCCL and cuBLAS workspaces; "
                        f"default {HEADROOM_BYTES / GiB:g})")
    p.add_argument("--max-micro-batch", type=int, default=16)
    p.add_argument("--json", default=None, help="also write the plan as JSON here")
    return p


def _gib(x: float) -> str:
    return f"{x / GiB:.1f}"


def table(result: PlanResult) -> str:
    job, system = result.job, result.system
    head = (f"{'#':>2} {'layout':<34} {'step s':>8} {'tok/s':>10} {'MFU':>5} "
            f"{'params':>6} {'grads':>6} {'optim':>6} {'acts':>6} {'peak':>6} "
            f"{'bubble':>6} {'tp s':>6} {'pp s':>6} {'dp s':>6}")
    lines = [head, "-" * len(head)]
    for i, c in enumerate(result.ranked, 1):
        t, m = c.time, c.memory
        lines.append(
            f"{i:>2} {c.layout.short():<34} {t.total:>8.3f} {c.tokens_per_second(job):>10.0f} "
            f"{100 * c.mfu(job, system):>4.1f}% {_gib(m.params):>6} {_gib(m.grads):>6} "
            f"{_gib(m.main_params + m.optimizer_states):>6} {_gib(m.activations):>6} "
            f"{_gib(m.peak):>6} {100 * t.bubble_fraction:>5.1f}% {t.tp_comm:>6.2f} "
            f"{t.pp_comm:>6.2f} {t.dp_comm:>6.2f}")
    return "\n".join(lines)


def launch_flags(result: PlanResult) -> list[str]:
    """Flags every launch line carries so it runs the runtime its times were calibrated on."""
    mr = result.system.megazero_runtime
    return mr.launch_flags() if mr is not None else []


def runtime_json(result: PlanResult) -> dict:
    """Where the step times come from, for ``--json``."""
    mr = result.system.megazero_runtime
    out = {"line": result.provenance, "calibrated": bool(mr and mr.calibrated)}
    if mr is not None:
        out.update(basis=mr.basis, variant=mr.variant,
                   factor=mr.factor if mr.calibrated else None,
                   leave_one_out_error=mr.loo_error, measured=[dict(r) for r in mr.measured])
    return out


def to_json(result: PlanResult) -> dict:
    job = result.job
    rows = []
    for c in result.ranked:
        t, m = c.time, c.memory
        rows.append({"layout": vars(c.layout), "step_seconds": t.total,
                     "tokens_per_second": c.tokens_per_second(job),
                     "mfu": c.mfu(job, result.system), "bubble_fraction": t.bubble_fraction,
                     "comm_seconds": {"tp": t.tp_comm, "pp": t.pp_comm, "dp": t.dp_comm,
                                      "dp_exposed": t.dp_exposed},
                     "memory_bytes": {"params": m.params, "grads": m.grads,
                                      "main_params": m.main_params,
                                      "optimizer_states": m.optimizer_states,
                                      "activations": m.activations,
                                      "transient": m.transient, "peak": m.peak,
                                      "host": m.host, "stage": m.stage},
                     "command": command(c.layout, job,
                                        gpus_per_node=result.system.gpus_per_node,
                                        extra=launch_flags(result))})
    return {"system": result.system.name, "gpus": job.world,
            "global_batch_size": job.global_batch, "seq_length": job.seq,
            "usable_bytes": result.usable, "considered": result.considered,
            "seconds": result.seconds, "runtime": runtime_json(result), "layouts": rows,
            "notes": result.notes}


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        model = resolve_model(args.model, args.seq_length)
        system = load_system(args.gpu)
        if args.gpus < 1:
            raise PlanInputError(f"--gpus must be >= 1, got {args.gpus}")
        if args.global_batch_size < 1:
            raise PlanInputError(f"--global-batch-size must be >= 1, got "
                                 f"{args.global_batch_size}")
        job = Job(model, args.gpus, args.global_batch_size, args.dtype)
        result = plan(job, system, fixed=parse_fix(args.fix), top=args.top,
                      headroom_fraction=args.headroom,
                      headroom_bytes=args.headroom_gib * GiB,
                      max_micro_batch=args.max_micro_batch)
    except PlanInputError as exc:
        parser.error(str(exc))
    n = parameter_count(model)
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
    say(f"model: {size} parameters, {model.num_layers} layers, "
          f"hidden {model.hidden_size}, heads {model.num_attention_heads}, seq "
          f"{model.seq_length}; {job.world} x {system.name}, global batch "
          f"{job.global_batch}")
    say(f"usable memory per rank {_gib(result.usable)} GiB of {_gib(system.memory_bytes)} "
          f"(headroom {args.headroom:.0%} + {args.headroom_gib:g} GiB); "
          f"{result.considered} layouts considered in {result.seconds:.1f} s; memory in GiB, "
          f"communication in s per step")
    say(table(result))
    say(result.provenance)
    for note in result.notes:
        say(f"note: {note}")
    say()
    for i, c in enumerate(result.ranked, 1):
        say(f"# {i}: {c.layout.short()}")
        say(command(c.layout, job, gpus_per_node=system.gpus_per_node,
                    extra=launch_flags(result)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(result), f, indent=1)
    return 0 if result.ranked else 1


if __name__ == "__main__":
    sys.exit(main())
