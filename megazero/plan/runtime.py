"""megazero's measured GPU runtime: the factor by which its device compute is slower than the
planner's Megatron-2021-level prediction, fitted to ``benchmarks/bench_gpu_step.py``'s JSON
(``python -m megazero.plan.calibrate --gpu-step BENCH.json --system SYSTEM.json --out
NEW.json``).

Each megazero row of the bench that ran (``status`` ok) is predicted with the planner's own
model for that exact job: the row's model, tp1 pp1 dp1, its micro-batch and global batch, one
GPU of the system, megazero's runtime. The prediction is affine in the compute scale ``c``
(``cost.Runtime.compute_scale``): ``T(c) = A + c B``, ``B`` the device compute (GEMMs,
attention, memory-bound kernels, loss, optimizer step) and ``A`` the rest (fixed host
overheads; none on the shipped GPU systems). One factor per variant (eager, compile:
``--compile`` changes the runtime, so the two are not pooled) minimises the squared relative
error over the variant's rows, every model size at once.

The honest score is leave-one-out over model sizes: the factor fitted on the other sizes
predicts the held-out size, and the largest relative error of those predictions is stored
with the factor. With one size measured there is nothing to hold out, and the entry says so.
"""

from __future__ import annotations

import time

from megazero.config import ConfigError, ModelConfig
from megazero.plan.cost import Runtime, step_time
from megazero.plan.layout import Job, Layout
from megazero.plan.system import (
    RUNTIME_VARIANTS,
    PlanInputError,
    System,
    runtime_from_dict,
    system_from_dict,
)

BENCH_SCHEMA = "megazero.bench_gpu_step/1"
BASIS = ("Megatron-LM 2021-level kernels (fitted to published Megatron-LM runs by python -m "
         "megazero.plan.fit)")
PEAK_TOLERANCE = 0.05  # the bench's device and the system's may differ this much in peak
ROW_FIELDS = ("variant", "model", "num_layers", "hidden_size", "num_attention_heads",
              "seq_length", "vocab_size", "micro_batch_size", "global_batch_size", "dtype",
              "iter_ms", "tokens_per_s", "mfu")
# bench fields kept with each row used (beyond the planner's own numbers)
PROVENANCE = ("model_tflops_per_s", "peak_mem_gib", "launches_per_iter", "gpu_busy",
              "iterations", "first_iter_s")


def megazero_rows(bench: dict, where: str = "--gpu-step") -> list[dict]:
    """The megazero rows of a bench JSON that ran; a wrong schema or field is named."""
    if not isinstance(bench, dict) or bench.get("schema") != BENCH_SCHEMA:
        got = bench.get("schema") if isinstance(bench, dict) else type(bench).__name__
        raise PlanInputError(f"{where}: not a {BENCH_SCHEMA} file (schema {got!r})")
    for key in ("date", "device", "torch", "peak_tflops", "results"):
        if key not in bench:
            raise PlanInputError(f"{where}: missing top-level field {key!r}")
    rows = [r for r in bench["results"]
            if r.get("contender") == "megazero" and r.get("status") == "ok"]
    for i, row in enumerate(rows):
        missing = [k for k in ROW_FIELDS if k not in row]
        if missing:
            raise PlanInputError(f"{where}: megazero row {i} ({row.get('model')}) lacks "
                                 f"{', '.join(missing)}")
        if row["variant"] not in RUNTIME_VARIANTS:
            raise PlanInputError(f"{where}: megazero row {i}: unknown variant "
                                 f"{row['variant']!r} (variants: {', '.join(RUNTIME_VARIANTS)})")
        if not row["iter_ms"] > 0:
            raise PlanInputError(f"{where}: megazero row {i}: iter_ms must be positive")
    if not rows:
        raise PlanInputError(f"{where}: no megazero row with status ok (statuses: "
                             f"{sorted({r.get('status') for r in bench['results']})})")
    return rows


def row_job(row: dict) -> tuple[Job, Layout]:
    """The bench row's exact job on one GPU: its model, micro-batch and global batch."""
    try:
        model = ModelConfig(num_layers=row["num_layers"], hidden_size=row["hidden_size"],
                            num_attention_heads=row["num_attention_heads"],
                            seq_length=row["seq_length"],
                            max_position_embeddings=row["seq_length"],
                            vocab_size=row["vocab_size"], params_dtype="bfloat16")
    except (ConfigError, TypeError, ValueError) as exc:
        raise PlanInputError(f"--gpu-step: row {row['model']}: {exc}") from None
    mb, gbs = row["micro_batch_size"], row["global_batch_size"]
    if gbs % mb:
        raise PlanInputError(f"--gpu-step: row {row['model']}: global batch {gbs} is not a "
                             f"multiple of micro-batch {mb}")
    return Job(model, 1, gbs, row["dtype"]), Layout(1, 1, 1, mb)


def affine_prediction(row: dict, system: System) -> tuple[float, float]:
    """(A, B) seconds with the planner's prediction of the row ``A + c B`` at compute
    scale ``c`` (exact: on one GPU nothing in the step is a max of compute and another)."""
    job, lay = row_job(row)
    one = step_time(job, lay, system, Runtime(compute_scale=1.0)).total
    two = step_time(job, lay, system, Runtime(compute_scale=2.0)).total
    return one - (two - one), two - one


def fit_factor(points: list[tuple[float, float, float]]) -> float:
    """``c`` minimising the squared relative error of ``A + c B`` against the measured ``y``
    over ``points`` of ``(A, B, y)``."""
    num = sum(b / y * (1 - a / y) for a, b, y in points)
    den = sum((b / y) ** 2 for a, b, y in points)
    return num / den


def leave_one_out(points: dict) -> dict:
    """Each model size predicted by the factor fitted on the others: ``{"error": the largest
    relative error, "mean_error", "held_out": [...]}``, or ``error`` None with a reason when
    one size was measured. ``points``: {model: [(A, B, y), ...]}."""
    if len(points) < 2:
        return {"error": None, "reason": f"one model size measured ({', '.join(points)}): "
                                         f"none left to score the fit on"}
    held = []
    for model, rows in points.items():
        others = [p for m, ps in points.items() if m != model for p in ps]
        c = fit_factor(others)
        for a, b, y in rows:
            held.append({"model": model, "fit_on": sorted(m for m in points if m != model),
                         "factor": c, "predicted_ms": 1e3 * (a + c * b),
                         "measured_ms": 1e3 * y, "error": (a + c * b) / y - 1})
    errors = [abs(h["error"]) for h in held]
    return {"error": max(errors), "mean_error": sum(errors) / len(errors), "held_out": held}


def calibrate_system(bench: dict, system_data: dict, *, variant: str = "eager",
                     bench_name: str = "BENCH.json", system_name: str = "SYSTEM.json") -> dict:
    """``system_data`` (SYSTEM.json's fields) with ``megazero_runtime`` fitted to ``bench``
    (a bench_gpu_step JSON): one factor per variant measured, ``variant``'s applied."""
    system = system_from_dict(system_data, system_name)
    rows = megazero_rows(bench)
    peak = float(bench["peak_tflops"]) * 1e12
    for dtype in sorted({r["dtype"] for r in rows}):
        ours = system.peak(dtype)
        if abs(ours - peak) > PEAK_TOLERANCE * ours:
            raise PlanInputError(
                f"--gpu-step: measured on {bench['device']} (peak {peak / 1e12:g} TFLOP/s "
                f"{dtype}) but --system {system.name} has {ours / 1e12:g}: calibrate the "
                f"system of the device that was measured")
    variants = sorted({r["variant"] for r in rows})
    if variant not in variants:
        raise PlanInputError(f"--variant {variant}: the bench has no megazero {variant} row "
                             f"that ran (it has: {', '.join(variants)})")
    measured, factors = [], {}
    for v in variants:
        points: dict = {}
        for row in (r for r in rows if r["variant"] == v):
            a, b = affine_prediction(row, system)
            y = row["iter_ms"] / 1e3
            points.setdefault(row["model"], []).append((a, b, y))
            job, lay = row_job(row)
            measured.append({
                "device": bench["device"], "date": bench["date"], "torch": bench["torch"],
                "cuda": bench.get("cuda"), "model": row["model"],
                "layout": f"tp1 pp1 dp1 mb{lay.micro_batch} gbs{job.global_batch} "
                          f"seq{job.seq} {job.dtype}",
                "variant": v, "mfu": row["mfu"], "tokens_per_s": row["tokens_per_s"],
                "iter_ms": row["iter_ms"], "predicted_ms": 1e3 * (a + b),
                "row_factor": (y - a) / b,
                **{k: row[k] for k in PROVENANCE if k in row},
                "source": f"{bench_name} (benchmarks/bench_gpu_step.py)"})
        factors[v] = {"factor": fit_factor([p for ps in points.values() for p in ps]),
                      "leave_one_out": leave_one_out(points)}
    entry = {"basis": BASIS, "measured": measured, "factors": factors, "variant": variant,
             "fit": {"command": f"python -m megazero.plan.calibrate --gpu-step {bench_name} "
                                f"--system {system_name} --variant {variant}",
                     "calibrated_at": time.strftime("%Y-%m-%d %H:%M"),
                     "method": "per variant, the factor on device compute minimising the "
                               "squared relative error of the planner's one-GPU prediction "
                               "against iter_ms over all sizes; leave_one_out: each size "
                               "predicted by the factor fitted on the others",
                     "base_system": system_name}}
    runtime_from_dict(entry, system_name)  # what the planner will read back
    out = dict(system_data)
    out["megazero_runtime"] = entry
    out["_sources"] = dict(system_data.get("_sources", {}), megazero_runtime=(
        f"calibrated on {bench['device']} ({bench['date']}) from {bench_name} by python -m "
        f"megazero.plan.calibrate --gpu-step; see megazero_runtime.fit"))
    return out
