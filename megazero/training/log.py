"""What training reports: Megatron's log line, validation lines, TensorBoard, memory.

Printed by the last rank (it holds the loss of the last pipeline stage) through the
``megazero`` logger, which ``setup_logging`` sends to stdout; other ranks log warnings only.
Nothing here communicates.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import sys

from megazero.config import MegazeroConfig
from megazero.distributed.parallel_state import ParallelState

logger = logging.getLogger("megazero.training")


def setup_logging(ps: ParallelState) -> None:
    """INFO (the log line) on the last rank, which holds the loss; WARNING elsewhere."""
    level = logging.INFO if ps.rank == ps.world_size - 1 or ps.rank == 0 else logging.WARNING
    root = logging.getLogger("megazero")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False


def is_log_rank(ps: ParallelState) -> bool:
    return ps.rank == ps.world_size - 1


def flops_per_iteration(config: MegazeroConfig, global_batch_size: int | None = None) -> float:
    """Megatron's GPT FLOPs per iteration (Narayanan et al., 2021): the transformer layers'
    24 f B s L h^2 (1 + s/6h), f = 3 passes (forward + backward), 4 with activation recompute,
    plus the output layer's 6 B s h V, which recompute does not repeat. With recompute this is
    their 96 B s L h^2 (1 + s/6h + V/16Lh); without, 72 B s L h^2 (1 + s/6h + V/12Lh)."""
    m, t = config.model, config.train
    b = global_batch_size or t.global_batch_size  # the ramp-up's current batch when given
    s, layers, h = m.seq_length, m.num_layers, m.hidden_size
    factor = 4 if m.recompute_activations else 3
    v = m.vocab_size or 0
    return 24 * factor * b * s * layers * h * h * (1 + s / (6 * h)) + 6 * b * s * h * v


def throughput_tflops(config: MegazeroConfig, ps: ParallelState, elapsed: float,
                      global_batch_size: int | None = None) -> float:
    """Model TFLOP/s per rank at ``elapsed`` seconds per iteration (``flops_per_iteration``
    over the world)."""
    if not elapsed:
        return 0.0
    return flops_per_iteration(config, global_batch_size) / (elapsed * ps.world_size * 1e12)


def training_log_line(config: MegazeroConfig, ps: ParallelState, *, iteration: int, iters: int,
                      consumed_samples: int, elapsed: float, lr: float, losses: dict,
                      loss_scale: float, grad_norm: float | None, skipped: int,
                      nan: int, global_batch_size: int | None = None) -> str:
    """`` iteration N/ M | consumed samples: ... | lm loss: X | ...`` (Megatron's, plus tokens
    per second and TFLOP/s per rank). ``elapsed``: seconds per iteration."""
    tcfg = config.train
    gbs = global_batch_size or tcfg.global_batch_size  # the ramp-up's current batch
    tokens = gbs * config.model.seq_length
    tflops = throughput_tflops(config, ps, elapsed, gbs)
    line = f" iteration {iteration:8d}/{iters:8d} |"
    line += f" consumed samples: {consumed_samples:12d} |"
    line += f" elapsed time per iteration (ms): {elapsed * 1000.0:.1f} |"
    line += f" learning rate: {lr:.3E} |"
    line += f" global batch size: {gbs:5d} |"
    for k, v in losses.items():
        line += f" {k}: {v:.6E} |"
    line += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None and math.isfinite(grad_norm):
        line += f" grad norm: {grad_norm:.3f} |"
    line += f" number of skipped iterations: {skipped:3d} |"
    line += f" number of nan iterations: {nan:3d} |"
    line += f" tokens per second: {tokens / elapsed:.1f} |" if elapsed else ""
    line += f" TFLOP/s per rank: {tflops:.3f} |"
    if tcfg.log_throughput:  # Megatron's wording, which its users' scripts grep for
        line += f" throughput per GPU (TFLOP/s/GPU): {tflops:.1f} |"
    return line


def _sci(v: float) -> str:
    """Megatron's %.6E, with a NaN printed as ``nan``."""
    return "nan" if math.isnan(v) else f"{v:.6E}"


def log_validation(prefix: str, totals: dict) -> None:
    """Megatron's validation block: a bar, `` validation loss at <prefix> | ...``, a bar."""
    line = f" validation loss at {prefix} |"
    for k, v in totals.items():
        ppl = float("nan") if math.isnan(v) else math.exp(min(20, v))
        line += f" {k} value: {_sci(v)} | {k} PPL: {_sci(ppl)} |"
    bar = "-" * (len(line) + 1)
    logger.info(bar)
    logger.info(line)
    logger.info(bar)


class TensorBoard:
    """Scalars to ``--tensorboard-dir`` from the logging rank, when tensorboard is installed."""

    def __init__(self, path):
        self.writer = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=path, max_queue=1000)
        except ImportError:
            logger.warning("--tensorboard-dir given but tensorboard is not installed "
                           "(pip install tensorboard); not writing events")

    def add(self, values: dict, step: int):
        if self.writer is not None:
            for k, v in values.items():
                self.writer.add_scalar(k, v, step)
            self.writer.flush()


def resident_bytes(trim: bool = False, anonymous: bool = False) -> int | None:
    """This process's resident set size now (Linux ``/proc/self/statm``; None elsewhere).
    ``trim``: first return the C allocator's free pages to the system (glibc ``malloc_trim``),
    so that what is counted is memory in use, not freed memory the allocator kept.
    ``anonymous``: only the anonymous pages (``RssAnon`` of ``/proc/self/status``): the memory
    the process allocated, without the pages of shared libraries' code and data it has read
    from disk (file-backed, clean, dropped by the kernel under pressure; running a kernel for
    the first time makes them resident)."""
    if trim:
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
    try:
        if anonymous:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        return int(line.split()[1]) * 1024  # kB
            return None
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def log_memory(optimizer, ps: ParallelState, resident_before_model: int | None = None) -> None:
    """Per-rank bytes of model states and of every buffer the optimizer keeps (ZeRO's
    accounting), once, from every rank. On CPU also the resident memory the process gained
    since before the model was built, and how much of it the accounting does not explain
    (activations already freed, data, the allocator's retained pages). Both counts are of
    anonymous memory (``resident_bytes(anonymous=True)``), which is what allocations hold;
    the total resident set is printed beside them."""
    report = optimizer.memory_report()
    mb = {k: round(v / 2**20, 2) for k, v in report.items() if not k.endswith("_peak")}
    line = f"[rank {ps.rank}] memory (MB) of model states and buffers after the first " \
           f"iteration: {mb}"
    now = resident_bytes(trim=True, anonymous=True)
    total = resident_bytes()
    if ps.device.type == "cpu" and now is not None and resident_before_model is not None:
        gained = now - resident_before_model
        held = sum(v for k, v in report.items()  # shared segments are not anonymous
                   if not k.endswith("_peak") and not k.startswith(("host_", "shared_")))
        line += (f"; resident {total / 2**20:.1f} MB (allocator trimmed), of it anonymous "
                 f"{now / 2**20:.1f} MB, {gained / 2**20:.1f} MB more than before the model "
                 f"was built, {(gained - held) / 2**20:.1f} MB of it unaccounted")
    line += "; " + allocator_peaks(ps)
    logging.getLogger("megazero.memory").warning(line)


def allocator_peaks(ps: ParallelState) -> str:
    """The allocator's peaks so far: CUDA's ``max_memory_allocated`` / ``max_memory_reserved``
    on a GPU; on CPU, which has no tensor allocator statistics, the process's peak resident
    set (``ru_maxrss``)."""
    if ps.device.type == "cuda":
        import torch

        return (f"peak allocated {torch.cuda.max_memory_allocated(ps.device) / 2**20:.1f} MB, "
                f"peak reserved {torch.cuda.max_memory_reserved(ps.device) / 2**20:.1f} MB")
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux
    except (ImportError, OSError):
        return "peak resident unknown"
    return f"peak resident {peak:.1f} MB"
