"""Activation bytes per layer, calibrated from dry runs of one and two layers.

For a class (sequence parallel, recompute granularity, attention backend, dropout on or
off, element bytes), one layer of one micro-batch keeps

    A s b h + B s b h / t + C a s^2 b / t   bytes

(sequence parallelism divides the A term by t as well). ``calibrate`` dry-runs megazero
(``dryrun.dry_run``, fake tensors, one process) at a few small shapes with one and two
layers: the difference is one layer's bytes, the one-layer run's remainder the embedding's
and the head's (``E1 s b h + E2 s b V / t``), and the peak above states and activations the
transient working set (``T1 s b h / t + T2 s b V / t``, plus a layer's activations under full
recompute). Least squares gives the coefficients, written to ``activations.json`` (shipped;
``python -m megazero.plan.calibrate --activations`` rebuilds it). Korthikanti et al. 2022
Table 2 gives A = 10, B = 24, C = 5 for fp16 without recompute, B = 34 with sequence
parallelism, C = 0 with selective recompute, A = 2, B = C = 0 with full recompute;
the fitted and published coefficients are compared in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megazero.arguments import parse_args
from megazero.dryrun.run import DryRunOptions, dry_run
from megazero.plan.layout import Job, Layout, model_flags

logger = logging.getLogger(__name__)

COEFF_FILE = Path(__file__).resolve().parent / "activations.json"
ROOT = Path(__file__).resolve().parent.parent.parent
KORTHIKANTI = {  # (A, B, C) of Table 2, bytes with 2-byte activations
    "none": (10, 24, 5), "none+sp": (0, 34, 5), "selective": (10, 24, 0),
    "selective+sp": (0, 34, 0), "full": (2, 0, 0), "full+sp": (0, 2, 0)}
# (h, a, s, b, t, V): small shapes that separate the terms
SHAPES = [(128, 4, 64, 2, 1, 512), (256, 4, 64, 1, 1, 1024), (128, 8, 128, 1, 2, 512),
          (256, 8, 64, 2, 2, 2048), (128, 4, 128, 2, 4, 1024)]


def class_key(lay: Layout, job: Job, backend: str = "auto", dropout: bool = True) -> str:
    sp = "+sp" if lay.sp and lay.tp > 1 else ""
    return f"{lay.recompute}{sp}/{backend}/{'drop' if dropout else 'nodrop'}/e{job.elem_bytes}"


@dataclass
class Coefficients:
    A: float
    B: float
    C: float
    E1: float
    E2: float
    T1: float
    T2: float
    points: int = 0
    E3: float = 0.0  # s^2 b: the attention mask the data carry


@dataclass(frozen=True)
class Measured:
    """One class at the job's own shape (h, heads, s, V, micro-batch, tp), from dry runs of
    one and two layers: bytes one layer keeps per micro-batch, the embedding's and head's
    together, and the working set above them (one stage holding everything)."""

    layer: float
    edges: float
    transient: float


class ActivationModel:
    """Per-class coefficients; a class never calibrated falls back to Korthikanti's.

    ``exact``: each class a layout needs is dry-run at the job's own shape instead (two dry
    runs of one rank per class, cached; seconds for a small model, so the default for CPU
    systems, where jobs are small), and only the number of layers and of micro-batches in
    flight is scaled: what a formula fitted across shapes cannot capture (which tensors a
    kernel keeps at this size) comes from the program itself."""

    def __init__(self, coeffs: dict[str, Coefficients] | None = None, backend: str = "auto",
                 dropout: bool = True, exact: bool = False):
        self.coeffs = coeffs or {}
        self.backend, self.dropout, self.exact = backend, dropout, exact
        self.measured: dict[tuple, Measured] = {}

    @classmethod
    def load(cls, path: Path = COEFF_FILE, **kwargs) -> ActivationModel:
        coeffs = {}
        if path.exists():
            raw = json.loads(path.read_text())
            coeffs = {k: Coefficients(**v) for k, v in raw.get("classes", {}).items()}
        return cls(coeffs, **kwargs)

    @classmethod
    def for_system(cls, system, path: Path = COEFF_FILE) -> ActivationModel:
        """CPU systems: the classes measured with ``--attention-backend auto`` (what a
        CPU run uses). GPU systems: fused attention (flash / memory-efficient SDPA) keeps
        no ``a s^2`` tensors, so a layer without recompute keeps what the selective class
        keeps (the attention core's scores are what selective recompute drops)."""
        cpu = system.ranks_share_cores
        return cls.load(path, backend="auto" if cpu else "gpu-fused", exact=cpu)

    def measure(self, job: Job, lay: Layout) -> Measured | None:
        """The layout's class at the job's shape (``exact`` only; cached)."""
        if not self.exact:
            return None
        m = job.model
        rc, backend = lay.recompute, self.backend
        if backend == "gpu-fused":  # fused attention keeps what selective recompute keeps
            rc, backend = ("selective" if rc == "none" else rc), "unfused"
        sp = lay.sp and lay.tp > 1
        key = (tuple(sorted(dataclasses.asdict(m).items())), lay.micro_batch, lay.tp, rc, sp,
               backend, self.dropout, job.elem_bytes)
        if key not in self.measured:
            reps = {}
            for layers in (1, 2):
                flags = model_flags(dataclasses.replace(m, num_layers=layers)) + \
                    dry_run_flags(m.hidden_size, m.num_attention_heads, m.seq_length,
                                  lay.micro_batch, lay.tp, m.vocab_size, layers, rc, sp,
                                  backend, self.dropout, job.elem_bytes)[10:]
                reps[layers] = dry_run_report(flags, world=lay.tp)
            one = reps[2]["activation_bytes"] - reps[1]["activation_bytes"]
            r = reps[1]
            self.measured[key] = Measured(
                float(one), float(r["activation_bytes"] - one),
                float(max(0, r["peak_bytes"] - _states(r) - r["activation_bytes"])))
        return self.measured[key]

    def coefficients(self, job: Job, lay: Layout) -> Coefficients:
        return self._lookup(job, lay)[0]

    def _lookup(self, job: Job, lay: Layout) -> tuple[Coefficients, bool]:
        """The class's coefficients, and whether they were fitted (else Korthikanti's)."""
        if self.backend == "gpu-fused":
            rc = "selective" if lay.recompute == "none" else lay.recompute
            lay = Layout(lay.tp, lay.pp, lay.dp, lay.micro_batch, lay.virtual, lay.zero,
                         lay.sp, rc, lay.offload)
            key = class_key(lay, job, "unfused", self.dropout)
        else:
            key = class_key(lay, job, self.backend, self.dropout)
        if key in self.coeffs:
            return self.coeffs[key], True
        base = lay.recompute + ("+sp" if lay.sp and lay.tp > 1 else "")
        a, b, c = KORTHIKANTI[base]
        scale = job.elem_bytes / 2
        return Coefficients(a * scale, b * scale, c * scale, 4 * scale, 8.0, 0.0, 8.0), False

    def layer_bytes(self, job: Job, lay: Layout) -> float:
        """One layer, one micro-batch."""
        exact = self.measure(job, lay)
        if exact is not None:
            return exact.layer
        m, k = job.model, self.coefficients(job, lay)
        s, b, h, t = m.seq_length, lay.micro_batch, m.hidden_size, lay.tp
        sbh = s * b * h
        a_term = k.A * sbh / (t if lay.sp else 1)
        return a_term + k.B * sbh / t + k.C * m.num_attention_heads * s * s * b / t

    def edge_bytes(self, job: Job, lay: Layout, *, first: bool, last: bool) -> float:
        """The embedding's (first stage) and the head's (last stage) activations."""
        m, k = job.model, self.coefficients(job, lay)
        s, b, t = m.seq_length, lay.micro_batch, lay.tp
        head = k.E1 * s * b * m.hidden_size + k.E3 * s * s * b
        tail = k.E2 * s * b * m.vocab_size / t
        exact = self.measure(job, lay)
        if exact is not None:  # the measured total, split as the fitted terms split it
            both = head + tail
            share = (head if first else 0.0) + (tail if last else 0.0)
            return exact.edges * (share / both if both > 0 else float(first and last))
        return (head if first else 0.0) + (tail if last else 0.0)

    def transient_bytes(self, job: Job, lay: Layout, *, last: bool, stage_params: int,
                        layers_per_stage: int) -> float:
        """The working set above what is kept: a recomputed layer, the head's backward,
        ZeRO-3's gathered units."""
        m, (k, fitted) = job.model, self._lookup(job, lay)
        s, b, t = m.seq_length, lay.micro_batch, lay.tp
        out = k.T1 * s * b * m.hidden_size / t + (k.T2 * s * b * m.vocab_size / t
                                                  if last else 0.0)
        exact = self.measure(job, lay)
        if exact is not None:  # measured on a stage with the head: drop its part elsewhere
            out = max(0.0, exact.transient - (0.0 if last else
                                              k.T2 * s * b * m.vocab_size / t))
        elif lay.recompute == "full" and not fitted:
            # a fitted full class's T1 already holds the recomputed layer (its dry runs' peak
            # includes it); Korthikanti's coefficients do not
            out += self.layer_bytes(job, Layout(lay.tp, lay.pp, lay.dp, lay.micro_batch,
                                                sp=lay.sp))
        if lay.zero == 3 and lay.dp > 1 and layers_per_stage:
            out += 2 * stage_params * lay.dp / max(layers_per_stage, 1)  # two units gathered
        return out


# ---- calibration by dry runs ------------------------------------------------------------
def _providers():
    """The entry point's providers (``pretrain_gpt2.py`` at the repository root)."""
    spec = importlib.util.spec_from_file_location("_mz_pretrain_gpt2", ROOT / "pretrain_gpt2.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return {"datasets_provider": mod.train_valid_test_datasets_provider,
            "model_provider": mod.model_provider, "forward_step_func": mod.forward_step,
            "zero3_unit_policy": mod.zero3_unit_policy}


def dry_run_flags(h, a, s, b, t, V, layers, recompute, sp, backend, dropout, elem_bytes,
                  pp=1, world=None, zero=0) -> list[str]:
    flags = ["--num-layers", layers, "--hidden-size", h, "--num-attention-heads", a,
             "--seq-length", s, "--max-position-embeddings", s, "--micro-batch-size", b,
             "--tensor-model-parallel-size", t, "--pipeline-model-parallel-size", pp,
             "--vocab-size", V, "--make-vocab-size-divisible-by", 8, "--mock-data",
             "--train-iters", 2, "--attention-backend", backend, "--zero-stage", zero]
    if elem_bytes == 2:
        flags.append("--bf16")
    if sp and t > 1:
        flags.append("--sequence-parallel")
    if recompute == "full":
        flags += ["--recompute-granularity", "full"]
    elif recompute == "selective":
        flags += ["--recompute-granularity", "selective"]
    if not dropout:
        flags += ["--attention-dropout", 0, "--hidden-dropout", 0]
    return [str(f) for f in flags]


_SUBPROCESS = """
import json, sys
from megazero.plan.activations import dry_run_report
flags, world, rank = json.loads(sys.argv[1])
sys.stdout.write("REPORT" + json.dumps(dry_run_report(flags, world, rank)) + "\\n")
"""


def dry_run_report(flags: list[str], world: int, rank: int = 0, providers=None) -> dict:
    """Dry-run rank ``rank`` of ``world`` on CPU fake tensors in this process (in a child
    process where this one already has a default process group: a training job planning,
    a test); the report as a dict (``activation_bytes``, ``peak_bytes``, ...)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        done = subprocess.run([sys.executable, "-c", _SUBPROCESS,
                               json.dumps([list(flags), world, rank])], cwd=ROOT,
                              capture_output=True, text=True, timeout=1800)
        if done.returncode != 0 or "REPORT" not in done.stdout:
            raise RuntimeError(f"dry run {' '.join(flags)} failed: {done.stderr[-2000:]}")
        return json.loads(done.stdout.split("REPORT", 1)[1].splitlines()[0])
    providers = providers or _providers()
    config = parse_args(flags, world_size=world)
    opts = DryRunOptions(rank=rank, world_size=world, device="cpu", check_peers=False)
    with tempfile.TemporaryDirectory() as tmp:
        opts.report = str(Path(tmp) / "r.json")
        dry_run(config, opts, **providers)
        return json.loads(Path(opts.report).read_text())


def _states(r: dict) -> int:
    return r["param_bytes"] + r["grad_bytes"] + r["main_param_bytes"] + \
        r["optimizer_state_bytes"]


def calibrate_class(recompute: str, sp: bool, backend: str, dropout: bool, elem_bytes: int,
                    providers=None, shapes=SHAPES) -> Coefficients:
    """Fit one class's coefficients to dry runs of one and two layers at ``shapes``."""
    providers = providers or _providers()
    rows, per_layer, edge_rows, edges, tr_rows, trans = [], [], [], [], [], []
    for h, a, s, b, t, V in shapes:
        if sp and t == 1:
            continue
        rep = {}
        for layers in (1, 2):
            flags = dry_run_flags(h, a, s, b, t, V, layers, recompute, sp, backend, dropout,
                                  elem_bytes)
            rep[layers] = dry_run_report(flags, world=t, providers=providers)
        one = rep[2]["activation_bytes"] - rep[1]["activation_bytes"]
        sbh = s * b * h
        rows.append([sbh / (t if sp else 1), sbh / t, a * s * s * b / t])
        per_layer.append(one)
        edge_rows.append([sbh, s * b * V / t, s * s * b])
        edges.append(rep[1]["activation_bytes"] - one)
        transient = rep[1]["peak_bytes"] - _states(rep[1]) - rep[1]["activation_bytes"]
        # under full recompute the recomputed layer is part of this transient: T1 holds it
        tr_rows.append([sbh / t, s * b * V / t])
        trans.append(max(transient, 0))
    A, B, C = _nonnegative_fit(rows, per_layer)
    E1, E2, E3 = _nonnegative_fit(edge_rows, edges)
    T1, T2 = _nonnegative_fit(tr_rows, trans)
    if sp:  # A and B both divide by t: only their sum is determined
        A, B = 0.0, A + B
    return Coefficients(float(A), float(B), float(C), float(E1), float(E2), float(T1),
                        float(T2), len(rows), float(E3))


def _nonnegative_fit(rows, values) -> list[float]:
    """Least squares with every coefficient >= 0 (a term with a negative fit is dropped
    and the rest refitted): bytes never shrink as a shape grows."""
    x, y = np.array(rows, float), np.array(values, float)
    keep = list(range(x.shape[1]))
    while keep:
        coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if (coef >= 0).all():
            out = [0.0] * x.shape[1]
            for i, c in zip(keep, coef):
                out[i] = float(c)
            return out
        keep.pop(int(np.argmin(coef)))
    return [0.0] * x.shape[1]


def calibrate(path: Path = COEFF_FILE, backends=("auto", "unfused"), dropout=(True,),
              elem_bytes=(2,)) -> dict:
    """Calibrate every class (recompute x sp x backend x dropout x dtype); write ``path``."""
    providers = _providers()
    logging.getLogger("megazero").setLevel(logging.WARNING)
    out = {}
    if path.exists():  # other classes already calibrated stay
        out = {k: Coefficients(**v) for k, v in
               json.loads(path.read_text()).get("classes", {}).items()}
    for backend in backends:
        for drop in dropout:
            for e in elem_bytes:
                for rc in ("none", "selective", "full"):
                    for sp in (False, True):
                        key = f"{rc}{'+sp' if sp else ''}/{backend}/" \
                              f"{'drop' if drop else 'nodrop'}/e{e}"
                        logger.info("calibrating activations of %s", key)
                        out[key] = calibrate_class(rc, sp, backend, drop, e, providers)
    data = {"_doc": "per-layer activation bytes A sbh + B sbh/t + C a s^2 b/t, edges E1 sbh "
                    "+ E2 sbV/t, transient T1 sbh/t + T2 sbV/t; fitted to dry runs "
                    "(megazero/plan/activations.py)",
            "classes": {k: vars(v) for k, v in out.items()}}
    path.write_text(json.dumps(data, indent=1) + "\n")
    return out
