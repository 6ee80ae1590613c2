"""Enumerate the layouts megazero can run for a job, prune by memory, rank by step time.

Candidates: tp a divisor of the heads (and key/value groups, FFN width and world) up to one
node; pp a divisor of the layers; dp the rest (dividing the global batch); virtual stages
that divide the layers per stage (interleaving needs micro-batches divisible by pp);
micro-batches dividing the per-dp batch (powers of two and the batch itself, up to
``max_micro_batch``); ZeRO 0-3 (1-3 only with dp > 1); sequence parallelism with tp > 1;
recompute none, selective or full; CPU offload with ZeRO 1-2. ``fixed`` pins any of them
(``--fix tp=8 pp=16 zero=1 mb=1 v=2 sp=1 recompute=full offload=0 dp=8``).

A cheap lower bound of the model states drops a (tp, pp) whose parameters cannot fit
before the exact arithmetic of ``memory.py`` runs; the survivors that fit under the usable
memory (device memory minus ``memory.HEADROOM_*``) are ranked by ``cost.step_time``, with
megazero's runtime on the system (``cost.megazero_runtime``: its measured factor where
SYSTEM.json has one); ``PlanResult.provenance`` says where the times come from.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

from megazero.plan.activations import ActivationModel
from megazero.plan.cost import Runtime, StepTime, megazero_runtime, step_time
from megazero.plan.layout import RECOMPUTE, Job, Layout
from megazero.plan.memory import (
    HEADROOM_BYTES,
    HEADROOM_FRACTION,
    RankMemory,
    rank_memory,
    usable_bytes,
)
from megazero.plan.models import parameter_count
from megazero.plan.system import PlanInputError, System

logger = logging.getLogger(__name__)

FIX_KEYS = {"tp": "tp", "pp": "pp", "dp": "dp", "v": "virtual", "virtual": "virtual",
            "zero": "zero", "mb": "micro_batch", "micro_batch": "micro_batch", "sp": "sp",
            "recompute": "recompute", "offload": "offload"}


@dataclass
class Candidate:
    layout: Layout
    time: StepTime
    memory: RankMemory

    def tokens_per_second(self, job: Job) -> float:
        return job.global_batch * job.seq / self.time.total

    def mfu(self, job: Job, system: System) -> float:
        return self.time.model_flops / (self.time.total * job.world * system.peak(job.dtype))


@dataclass
class PlanResult:
    job: Job
    system: System
    ranked: list[Candidate]
    considered: int = 0
    pruned_memory: int = 0
    seconds: float = 0.0
    usable: float = 0.0
    notes: list = field(default_factory=list)
    provenance: str = ""  # where the step times come from (one line)


def parse_fix(items: list[str]) -> dict:
    """``["tp=8", "sp=1", "recompute=full"]`` -> ``{"tp": 8, "sp": True, ...}``."""
    out = {}
    for item in items:
        if "=" not in item:
            raise PlanInputError(f"--fix {item}: expected KEY=VALUE (keys: "
                                 f"{', '.join(sorted(set(FIX_KEYS)))})")
        key, value = item.split("=", 1)
        if key not in FIX_KEYS:
            raise PlanInputError(f"--fix {item}: unknown key {key!r} (keys: "
                                 f"{', '.join(sorted(set(FIX_KEYS)))})")
        name = FIX_KEYS[key]
        if name == "recompute":
            if value not in RECOMPUTE:
                raise PlanInputError(f"--fix {item}: recompute is one of "
                                     f"{', '.join(RECOMPUTE)}")
            out[name] = value
        elif name in ("sp", "offload"):
            if value.lower() not in ("0", "1", "true", "false"):
                raise PlanInputError(f"--fix {item}: {key} is 0 or 1")
            out[name] = value.lower() in ("1", "true")
        else:
            try:
                out[name] = int(value)
            except ValueError:
                raise PlanInputError(f"--fix {item}: {key} must be an integer") from None
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def domains(job: Job, system: System, max_micro_batch: int = 16,
            max_virtual: int = 8) -> dict:
    """Every value each choice may take for this job (before combining them)."""
    m, world = job.model, job.world
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    tps = [t for t in _divisors(world) if t <= system.gpus_per_node
           and m.num_attention_heads % t == 0 and m.kv_heads % t == 0 and ffn % t == 0]
    pps = [p for p in _divisors(m.num_layers) if world % p == 0]
    per_dp = sorted({job.global_batch // d for d in _divisors(world)
                     if job.global_batch % d == 0})
    mbs = sorted({b for b in range(1, max_micro_batch + 1)
                  if any(x % b == 0 for x in per_dp) and (b & (b - 1) == 0 or
                                                           b in per_dp)})
    return {"tp": tps, "pp": pps, "virtual": list(range(1, max_virtual + 1)),
            "zero": [0, 1, 2, 3], "micro_batch": mbs, "sp": [False, True],
            "recompute": list(RECOMPUTE), "offload": [False, True],
            "dp": sorted({world // (t * p) for t in tps for p in pps
                          if world % (t * p) == 0})}


def check_fixed(fixed: dict, dom: dict, job: Job) -> None:
    """A fixed value no layout of this job can take is an error naming the flag."""
    for key, value in fixed.items():
        allowed = dom[key]
        if value not in allowed:
            flag = next(k for k, v in FIX_KEYS.items() if v == key)
            raise PlanInputError(
                f"--fix {flag}={value}: impossible for this job ({job.world} GPUs, "
                f"{job.model.num_layers} layers, {job.model.num_attention_heads} heads, "
                f"global batch {job.global_batch}); possible: {allowed}")


def enumerate_layouts(job: Job, system: System, fixed: dict | None = None,
                      max_micro_batch: int = 16, max_virtual: int = 8) -> list[Layout]:
    fixed = fixed or {}
    dom = domains(job, system, max_micro_batch, max_virtual)
    check_fixed(fixed, dom, job)
    pick = {k: [fixed[k]] if k in fixed else v for k, v in dom.items()}
    m, s = job.model, job.seq
    out = []
    for tp, pp in itertools.product(pick["tp"], pick["pp"]):
        if job.world % (tp * pp):
            continue
        dp = job.world // (tp * pp)
        if "dp" in fixed and fixed["dp"] != dp or job.global_batch % dp:
            continue
        for b, v in itertools.product(pick["micro_batch"], pick["virtual"]):
            per_dp = job.global_batch // dp
            if per_dp % b:
                continue
            n_micro = per_dp // b
            if v > 1 and (pp == 1 or m.num_layers % (pp * v) or n_micro % pp):
                continue
            for zero, sp, rc, off in itertools.product(pick["zero"], pick["sp"],
                                                       pick["recompute"], pick["offload"]):
                if zero > 0 and dp == 1 and "zero" not in fixed:
                    continue  # ZeRO without data parallelism is stage 0
                if sp and (tp == 1 or s % tp):
                    continue
                if off and zero not in (1, 2):
                    continue
                out.append(Layout(tp, pp, dp, b, v, zero, sp, rc, off))
    if not out:
        what = f" with --fix {' '.join(f'{k}={v}' for k, v in fixed.items())}" if fixed else ""
        raise PlanInputError(
            f"--gpus {job.world}: no layout of {job.model.num_layers} layers and "
            f"{job.model.num_attention_heads} heads splits over {job.world} ranks with "
            f"--global-batch-size {job.global_batch} divisible by the data-parallel "
            f"size{what}")
    return out


def _states_lower_bound(job: Job, lay: Layout) -> float:
    """Bytes of model states at least (no padding, no embedding on the stage)."""
    per_rank = parameter_count(job.model) / (lay.tp * lay.pp) * 0.9
    e = job.elem_bytes
    shard = lay.dp if lay.zero >= 1 else 1
    params = per_rank * e / (lay.dp if lay.zero == 3 else 1)
    grads = per_rank * e / (lay.dp if lay.zero >= 2 else 1)
    rest = 0 if lay.offload else per_rank * (12 if e == 2 else 8) / shard
    return params + grads + rest


def plan(job: Job, system: System, *, fixed: dict | None = None, top: int = 10,
         acts: ActivationModel | None = None, runtime: Runtime | None = None,
         headroom_fraction: float = HEADROOM_FRACTION,
         headroom_bytes: float = HEADROOM_BYTES, max_micro_batch: int = 16) -> PlanResult:
    """The ``top`` fastest layouts that fit, fastest first. ``runtime``: megazero's on
    ``system`` unless given."""
    start = time.time()
    if runtime is None:
        runtime, provenance = megazero_runtime(system), system.runtime_line()
    else:
        provenance = (f"step times of the runtime passed in ({runtime.name}, device compute "
                      f"x{runtime.compute_scale:g})")
    acts = acts or ActivationModel.for_system(system)
    layouts = enumerate_layouts(job, system, fixed, max_micro_batch)
    usable = usable_bytes(system.memory_bytes, headroom_fraction, headroom_bytes)
    # time first (cheap), then memory for the fastest until `top` fit
    timed = sorted(((step_time(job, lay, system, runtime), lay) for lay in layouts),
                   key=lambda x: x[0].total)
    ranked, pruned = [], 0
    for st, lay in timed:
        if _states_lower_bound(job, lay) > usable:
            pruned += 1
            continue
        mem = rank_memory(job, lay, acts)
        if mem.peak > usable:
            pruned += 1
            continue
        ranked.append(Candidate(lay, st, mem))
        if len(ranked) >= top:
            break
    result = PlanResult(job, system, ranked, len(layouts), pruned, time.time() - start,
                        usable, provenance=provenance)
    if not ranked:
        result.notes.append("no layout fits in memory: more GPUs, a smaller micro-batch or "
                            "model, or a system with more memory")
    return result
