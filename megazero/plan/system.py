"""What the planner knows of a machine: a ``System`` read from SYSTEM.json.

A system is one kind of accelerator in nodes of ``gpus_per_node``: peak FLOP/s per dtype,
memory, HBM bandwidth, the links inside a node (NVLink) and between nodes (InfiniBand, per
GPU), and the efficiencies at which the runtime reaches them (calibrated, see
``cost.py``). ``load_system("a100-80g")`` reads a file shipped in ``systems/``; a path reads
any file of the same fields. Sources of every number are in the file's ``_sources``.

Fields (SI units: bytes, seconds, FLOP/s, bytes/s):

``name``, ``gpus_per_node``, ``memory_bytes`` (per GPU), ``flops`` ({dtype: FLOP/s}),
``hbm_bandwidth``, ``intra_node`` / ``inter_node`` ({"bandwidth": per GPU and direction,
"latency": per message}), ``efficiency`` ({"gemm_max", "gemm_half_dim", "hbm", "network"}),
optionally ``cores`` and ``ranks_share_cores`` (a CPU machine whose ranks share ``cores``:
each rank gets ``cores / world`` of the compute when the world is larger),
``step_overhead`` / ``microbatch_overhead`` (seconds of fixed host work per step and per
micro-batch), ``layer_overhead`` and ``recompute_overhead`` (CPU seconds per layer and
micro-batch beyond the FLOPs, and per fully recomputed layer) and
``sync_cost`` ({group size or "p2p": seconds per blocking call while the ranks outnumber the
cores}).

``megazero_runtime`` (GPU systems) says where the planner's step times for megazero come from
(``MegazeroRuntime``): ``basis`` (what uncalibrated times assume: Megatron-LM 2021-level
kernels, the ``efficiency`` fitted by ``fit.py``), ``measured`` (megazero's own
measured GPU steps, each with its provenance: ``MEASURED_KEYS``), and once
``python -m megazero.plan.calibrate --gpu-step`` has fitted them, ``factors`` ({variant:
{"factor", "leave_one_out"}}: how many times slower megazero's device compute is than the
Megatron-level prediction, and that fit's error on a model size it was not fitted on),
``variant`` (the one the planner applies; ``compile`` adds ``--compile`` to its launch
lines) and ``fit`` (the calibration's own provenance, not read by the planner).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

SYSTEMS_DIR = Path(__file__).resolve().parent / "systems"
RUNTIME_VARIANTS = ("eager", "compile")
RUNTIME_KEYS = ("basis", "measured", "factors", "variant", "fit")
# what every measured megazero step carries, so a time can be traced to its run
MEASURED_KEYS = ("device", "date", "torch", "model", "layout", "variant", "mfu",
                 "tokens_per_s", "iter_ms", "source")


class PlanInputError(ValueError):
    """A planner input (model, system, flag) that cannot be used; the message names it."""


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s per GPU and direction
    latency: float  # seconds per message


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the nominal figures the runtime reaches (calibrated)."""

    gemm_max: float = 0.8  # of peak FLOP/s for a large GEMM
    gemm_half_dim: float = 64.0  # a GEMM dimension of this size halves the efficiency term
    hbm: float = 0.7  # of HBM bandwidth for element-wise (memory-bound) kernels
    network: float = 0.75  # of link bandwidth for collectives (NCCL bus bandwidth)


@dataclass(frozen=True)
class MegazeroRuntime:
    """Where megazero's step times on a system come from: ``basis`` and the ``measured``
    steps; ``calibrated`` once ``factors[variant]`` holds a fitted factor."""

    basis: str
    measured: tuple = ()  # of dicts with MEASURED_KEYS (and any more provenance)
    factors: dict = field(default_factory=dict)  # variant -> {"factor", "leave_one_out"}
    variant: str | None = None  # the factor the planner applies
    fit: dict = field(default_factory=dict)  # how the factors were fitted (provenance)

    @property
    def calibrated(self) -> bool:
        return self.variant is not None

    @property
    def factor(self) -> float:
        """Device compute time of megazero / the Megatron-level prediction (1 uncalibrated)."""
        return float(self.factors[self.variant]["factor"]) if self.calibrated else 1.0

    @property
    def loo_error(self) -> float | None:
        """The applied factor's leave-one-out error (None: not calibrated or one size)."""
        if not self.calibrated:
            return None
        return self.factors[self.variant]["leave_one_out"]["error"]

    def launch_flags(self) -> list[str]:
        """Flags the launch lines need to run the runtime the times were calibrated on."""
        return ["--compile"] if self.variant == "compile" else []

    def line(self) -> str:
        """One line for the plan's output: where its step times come from."""
        if not self.calibrated:
            if not self.measured:
                return (f"step times assume {self.basis}; megazero's own step has not been "
                        f"measured on a GPU")
            seen = "; ".join(f"{100 * r['mfu']:.1f}% MFU ({r['model']}, one {r['device']}, "
                             f"{r['date']}): see {r['source']}" for r in self.measured)
            return f"step times assume {self.basis}; megazero's own step measured {seen}"
        used = [r for r in self.measured if r["variant"] == self.variant]
        devices = ", ".join(sorted({r["device"] for r in used}))
        dates = ", ".join(sorted({r["date"] for r in used}))
        err = self.loo_error
        score = (f"leave-one-out error {100 * err:.1f}%" if err is not None else
                 f"no leave-one-out error: "
                 f"{self.factors[self.variant]['leave_one_out'].get('reason', 'one size')}")
        return (f"step times scaled by megazero's measured runtime ({devices}, {dates}, "
                f"{self.variant}, factor {self.factor:.2f} on device compute, {score})")

    def to_dict(self) -> dict:
        out = {"basis": self.basis, "measured": [dict(r) for r in self.measured]}
        if self.factors:
            out["factors"] = {k: dict(v) for k, v in self.factors.items()}
        if self.variant is not None:
            out["variant"] = self.variant
        if self.fit:
            out["fit"] = dict(self.fit)
        return out


def runtime_from_dict(d: dict, where: str) -> MegazeroRuntime:
    """``megazero_runtime`` of a SYSTEM.json; an unknown key or a malformed entry is named."""
    what = f"{where}: megazero_runtime"
    if not isinstance(d, dict):
        raise PlanInputError(f"{what} must be an object")
    unknown = sorted(set(d) - set(RUNTIME_KEYS))
    if unknown:
        raise PlanInputError(f"{what}: unknown key(s) {', '.join(unknown)} (keys: "
                             f"{', '.join(RUNTIME_KEYS)})")
    if not isinstance(d.get("basis"), str):
        raise PlanInputError(f"{what}.basis: missing (what uncalibrated times assume)")
    for key, kind, name in (("measured", list, "a list"), ("factors", dict, "an object"),
                            ("fit", dict, "an object")):
        if not isinstance(d.get(key, kind()), kind):
            raise PlanInputError(f"{what}.{key} must be {name}")
    measured = tuple(d.get("measured", []))
    for i, row in enumerate(measured):
        if not isinstance(row, dict):
            raise PlanInputError(f"{what}.measured[{i}] must be an object")
        missing = [k for k in MEASURED_KEYS if k not in row]
        if missing:
            raise PlanInputError(f"{what}.measured[{i}]: missing {', '.join(missing)}")
    factors = d.get("factors", {})
    for name, f in factors.items():
        if name not in RUNTIME_VARIANTS or not isinstance(f, dict):
            raise PlanInputError(f"{what}.factors: unknown variant {name!r} (variants: "
                                 f"{', '.join(RUNTIME_VARIANTS)})")
        if not isinstance(f.get("factor"), (int, float)) or f["factor"] <= 0:
            raise PlanInputError(f"{what}.factors.{name}.factor must be a positive number")
        loo = f.get("leave_one_out")
        if not isinstance(loo, dict) or "error" not in loo or \
                (loo["error"] is None and "reason" not in loo) or \
                not isinstance(loo["error"], (int, float, type(None))):
            raise PlanInputError(f"{what}.factors.{name}.leave_one_out: needs 'error' (a "
                                 f"fraction, or null with a 'reason')")
        if not any(r["variant"] == name for r in measured):
            raise PlanInputError(f"{what}.factors.{name}: no measured row of that variant")
    variant = d.get("variant")
    if variant is not None and variant not in factors:
        raise PlanInputError(f"{what}.variant {variant!r}: no such entry in factors "
                             f"({', '.join(factors) or 'none'})")
    return MegazeroRuntime(d["basis"], tuple(dict(r) for r in measured),
                           {k: dict(v) for k, v in factors.items()},
                           variant, dict(d.get("fit", {})))


@dataclass(frozen=True)
class System:
    name: str
    gpus_per_node: int
    memory_bytes: float
    flops: dict  # dtype name -> FLOP/s
    hbm_bandwidth: float
    intra_node: Link
    inter_node: Link
    efficiency: Efficiency = field(default_factory=Efficiency)
    cores: int | None = None  # CPU systems: cores the ranks share
    ranks_share_cores: bool = False
    step_overhead: float = 0.0  # s per step (host work, logging)
    microbatch_overhead: float = 0.0  # s per micro-batch and stage (launch, Python)
    # CPU time per transformer layer and micro-batch (forward + backward) beyond its FLOPs:
    # the Python and dispatch cost of its ~150 operators, which a small model cannot hide
    layer_overhead: float = 0.0
    recompute_overhead: float = 0.0  # the same, once more for a fully recomputed layer
    # s one blocking collective or point-to-point exchange costs when the ranks outnumber
    # the cores they share (a peer descheduled when it is waited for), by group size ("2",
    # "4", ...; "p2p" for a pipeline exchange); measured with 2 x cores busy ranks
    sync_cost: dict = field(default_factory=dict)
    megazero_runtime: MegazeroRuntime | None = None  # GPU systems: see MegazeroRuntime
    sources: dict = field(default_factory=dict)

    def runtime_line(self) -> str:
        """Where this system's step times for megazero come from, in one line."""
        if self.megazero_runtime is not None:
            return self.megazero_runtime.line()
        if self.ranks_share_cores:
            return ("step times from this machine's measured costs ("
                    f"{self.sources.get('measured', 'SYSTEM.json')})")
        return ("step times assume Megatron-LM 2021-level kernels (this system's "
                "efficiency); megazero's runtime was never measured on it (SYSTEM.json has "
                "no megazero_runtime)")

    def peak(self, dtype: str) -> float:
        if dtype not in self.flops:
            raise PlanInputError(f"system {self.name!r} has no FLOP/s for dtype {dtype!r} "
                                 f"(it lists {sorted(self.flops)})")
        return float(self.flops[dtype])

    def compute_share(self, world: int, threads_per_rank: int = 1) -> float:
        """Fraction of one rank's nominal compute it gets: 1 on a GPU; on a CPU machine whose
        ``world`` ranks share ``cores``, cores / (world x threads) when that is below 1."""
        if not self.ranks_share_cores or not self.cores:
            return 1.0
        return min(1.0, self.cores / (world * threads_per_rank))

    def call_cost(self, world: int, group: int | str) -> float:
        """Seconds one blocking call on a group of ``group`` ranks (or "p2p") costs in a job
        of ``world`` ranks: 0 unless the ranks outnumber the cores they share; between
        measured group sizes, interpolated in log2 of the size."""
        if not self.sync_cost or not self.ranks_share_cores or not self.cores \
                or world <= self.cores:
            return 0.0
        scale = min(1.0, (world - self.cores) / self.cores)  # measured at 2 x cores ranks
        if group == "p2p":
            return scale * float(self.sync_cost.get("p2p", 0.0))
        sizes = sorted(int(k) for k in self.sync_cost if k.isdigit())
        if not sizes or group <= 1:
            return 0.0
        g = min(max(group, sizes[0]), sizes[-1])
        lo = max(k for k in sizes if k <= g)
        hi = min(k for k in sizes if k >= g)
        a, b = float(self.sync_cost[str(lo)]), float(self.sync_cost[str(hi)])
        if hi == lo:
            return scale * a
        f = (math.log2(g) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
        return scale * (a + f * (b - a))

    def group_link(self, stride: int, size: int) -> Link:
        """The link of a group of ``size`` ranks ``stride`` apart in global rank order: NVLink
        when it fits in a node; across nodes, each node's ``k`` members send over their own
        NICs at once (NCCL's rings run one channel per NIC), so the group's bandwidth per
        rank is ``min(NVLink, k x NIC)``."""
        if stride * size <= self.gpus_per_node:
            return self.intra_node
        k = max(1, min(size, self.gpus_per_node // max(stride, 1)))
        return Link(min(self.intra_node.bandwidth, k * self.inter_node.bandwidth),
                    self.inter_node.latency)

    def to_dict(self) -> dict:
        e = self.efficiency
        return {"name": self.name, "gpus_per_node": self.gpus_per_node,
                "memory_bytes": self.memory_bytes, "flops": dict(self.flops),
                "hbm_bandwidth": self.hbm_bandwidth,
                "intra_node": vars(self.intra_node).copy(),
                "inter_node": vars(self.inter_node).copy(),
                "efficiency": {"gemm_max": e.gemm_max, "gemm_half_dim": e.gemm_half_dim,
                               "hbm": e.hbm, "network": e.network},
                "cores": self.cores, "ranks_share_cores": self.ranks_share_cores,
                "step_overhead": self.step_overhead,
                "microbatch_overhead": self.microbatch_overhead,
                "layer_overhead": self.layer_overhead,
                "recompute_overhead": self.recompute_overhead,
                "sync_cost": dict(self.sync_cost),
                **({"megazero_runtime": self.megazero_runtime.to_dict()}
                   if self.megazero_runtime is not None else {}),
                "_sources": dict(self.sources)}


def system_from_dict(d: dict, where: str = "SYSTEM.json") -> System:
    """A ``System`` from its JSON fields; a missing or malformed field is named."""
    runtime = runtime_from_dict(d["megazero_runtime"], where) if "megazero_runtime" in d \
        else None
    try:
        eff = Efficiency(**d.get("efficiency", {}))
        system = System(
            name=str(d["name"]), gpus_per_node=int(d["gpus_per_node"]),
            memory_bytes=float(d["memory_bytes"]),
            flops={k: float(v) for k, v in d["flops"].items()},
            hbm_bandwidth=float(d["hbm_bandwidth"]),
            intra_node=Link(float(d["intra_node"]["bandwidth"]),
                            float(d["intra_node"]["latency"])),
            inter_node=Link(float(d["inter_node"]["bandwidth"]),
                            float(d["inter_node"]["latency"])),
            efficiency=eff, cores=d.get("cores"),
            ranks_share_cores=bool(d.get("ranks_share_cores", False)),
            step_overhead=float(d.get("step_overhead", 0.0)),
            microbatch_overhead=float(d.get("microbatch_overhead", 0.0)),
            layer_overhead=float(d.get("layer_overhead", 0.0)),
            recompute_overhead=float(d.get("recompute_overhead", 0.0)),
            sync_cost={str(k): float(v) for k, v in d.get("sync_cost", {}).items()},
            megazero_runtime=runtime,
            sources=dict(d.get("_sources", {})))
    except KeyError as exc:
        raise PlanInputError(f"{where}: missing field {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise PlanInputError(f"{where}: malformed field ({exc})") from None
    if system.gpus_per_node < 1 or system.memory_bytes <= 0:
        raise PlanInputError(f"{where}: gpus_per_node and memory_bytes must be positive")
    return system


def builtin_systems() -> list[str]:
    """Names of the systems shipped in ``systems/``."""
    return sorted(p.stem for p in SYSTEMS_DIR.glob("*.json"))


def read_system(name_or_path: str, flag: str = "--gpu") -> tuple[Path, dict]:
    """(path, JSON fields) of a shipped system by name or of a SYSTEM.json path; ``flag``
    names the option in errors."""
    path = Path(name_or_path)
    if not (name_or_path.endswith(".json") or os.sep in name_or_path):
        path = SYSTEMS_DIR / f"{name_or_path}.json"
        if not path.exists():
            raise PlanInputError(f"{flag}: unknown system {name_or_path!r}; shipped: "
                                 f"{', '.join(builtin_systems())}, or give a SYSTEM.json path")
    if not path.exists():
        raise PlanInputError(f"{flag}: no such file {str(path)!r}")
    try:
        return path, json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise PlanInputError(f"{flag}: {path} is not valid JSON ({exc})") from None


def load_system(name_or_path: str) -> System:
    """A shipped system by name (``a100-80g``, ``h100-80g``) or a SYSTEM.json path."""
    path, data = read_system(name_or_path)
    return system_from_dict(data, str(path))
