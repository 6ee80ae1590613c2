"""What a training run reports and manages besides the log line, by Megatron's flags.

* wandb (``--wandb-project``, ``--wandb-exp-name``, ``--wandb-save-dir``): the logging rank
  writes the training scalars of every ``--log-interval`` and the validation loss and
  perplexity; offline unless ``WANDB_MODE`` says otherwise (``wandb`` is an optional extra).
* TensorBoard validation scalars (``<loss> validation`` and, with
  ``--log-validation-ppl-to-tensorboard``, ``<loss> validation ppl``).
* A progress line with the ETA after each log line.
* ``--profile`` with ``--profile-step-start`` / ``--profile-step-end``: a torch.profiler
  Chrome trace of those iterations, from the ranks of ``--profile-ranks``.
* ``--manual-gc`` (Python's collector off, a collection every ``--manual-gc-interval``
  iterations, at evaluation and at checkpoints) and ``--empty-unused-memory-level`` (the CUDA
  caching allocator's free blocks returned after each iteration, level 2 also after
  evaluation; the CPU has no such cache).

Rank-local: nothing here communicates.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import logging
import math
import os
import time

import torch

from megazero.distributed.parallel_state import ParallelState
from megazero.training.log import TensorBoard, is_log_rank

logger = logging.getLogger("megazero.training")


class Monitor:
    def __init__(self, config, ps: ParallelState, tensorboard: TensorBoard | None = None):
        self.config, self.ps, self.tcfg = config, ps, config.train
        self.tensorboard = tensorboard
        self.wandb = None
        self.profiler = None
        self.trace_path = None
        self.start_time = time.time()
        if self.tcfg.wandb_project and is_log_rank(ps):
            self.wandb = _start_wandb(config)
        if self.tcfg.manual_gc:
            gc.disable()
            gc.collect()

    # ---- per iteration -------------------------------------------------------------------
    def iteration_start(self, iteration: int) -> None:
        """Before iteration ``iteration`` (1-based) runs."""
        t = self.tcfg
        if t.profile and iteration == t.profile_step_start and self.ps.rank in t.profile_ranks:
            self.profiler = torch.profiler.profile(
                activities=_activities(self.ps), record_shapes=True, with_stack=False)
            self.profiler.__enter__()

    def iteration_end(self, iteration: int) -> None:
        t = self.tcfg
        if self.profiler is not None and iteration >= t.profile_step_end:
            self._write_trace(iteration)
        if t.manual_gc and t.manual_gc_interval and iteration % t.manual_gc_interval == 0:
            gc.collect()
        if t.empty_unused_memory_level >= 1 and self.ps.device.type == "cuda":
            torch.cuda.empty_cache()

    def _write_trace(self, iteration: int) -> None:
        t = self.tcfg
        self.profiler.__exit__(None, None, None)
        folder = t.profile_dir or os.path.join(t.tensorboard_dir or ".", "profile")
        os.makedirs(folder, exist_ok=True)
        self.trace_path = os.path.join(
            folder, f"trace_rank{self.ps.rank}_iters{t.profile_step_start}-{iteration}.json")
        self.profiler.export_chrome_trace(self.trace_path)
        self.profiler = None
        logger.warning("[rank %d] wrote the torch.profiler trace of iterations %d-%d to %s",
                       self.ps.rank, t.profile_step_start, iteration, self.trace_path)

    def around_evaluation(self) -> None:
        """After an evaluation (and at checkpoints): Megatron collects and empties here."""
        if self.tcfg.manual_gc:
            gc.collect()
        if self.tcfg.empty_unused_memory_level >= 2 and self.ps.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- scalars -------------------------------------------------------------------------
    def train_scalars(self, scalars: dict, iteration: int) -> None:
        if self.wandb is not None:
            self.wandb.log(scalars, step=iteration)

    def validation(self, totals: dict, iteration: int) -> None:
        """Validation loss and perplexity to TensorBoard and wandb (logging rank)."""
        if not is_log_rank(self.ps) or not totals:
            return
        scalars = {}
        for k, v in totals.items():
            scalars[f"{k} validation"] = v
            if self.tcfg.log_validation_ppl_to_tensorboard or self.wandb is not None:
                scalars[f"{k} validation ppl"] = math.exp(min(20.0, v)) \
                    if math.isfinite(v) else float("nan")
        if self.tensorboard is not None:
            tb = {k: v for k, v in scalars.items()
                  if self.tcfg.log_validation_ppl_to_tensorboard or not k.endswith(" ppl")}
            self.tensorboard.add(tb, iteration)
        if self.wandb is not None:
            self.wandb.log(scalars, step=iteration)

    def progress(self, iteration: int, start_iteration: int, iters: int) -> str:
        """`` progress: 10/200 iterations (5.0%) | elapsed 0:00:12 | ETA 0:03:48 |``."""
        elapsed = time.time() - self.start_time
        done = max(iteration - start_iteration, 1)
        eta = elapsed / done * max(iters - iteration, 0)
        pct = 100.0 * iteration / max(iters, 1)
        return (f" progress: {iteration}/{iters} iterations ({pct:.1f}%) | elapsed "
                f"{_hms(elapsed)} | ETA {_hms(eta)} |")

    def close(self) -> None:
        if self.profiler is not None:  # training ended inside the profiled range
            self._write_trace(self.tcfg.profile_step_end)
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
        if self.tcfg.manual_gc:
            gc.enable()


def _hms(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(seconds)))


def _activities(ps: ParallelState):
    acts = [torch.profiler.ProfilerActivity.CPU]
    if ps.device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def _start_wandb(config):
    """wandb run of the logging rank (offline unless ``WANDB_MODE`` is set)."""
    try:
        import wandb
    except ImportError:
        raise RuntimeError("--wandb-project needs the wandb package: pip install "
                           "'megazero[wandb]' (or pip install wandb)") from None
    t = config.train
    os.environ.setdefault("WANDB_MODE", "offline")
    save_dir = t.wandb_save_dir or os.path.join(t.save or ".", "wandb")
    os.makedirs(save_dir, exist_ok=True)
    return wandb.init(project=t.wandb_project, name=t.wandb_exp_name, dir=save_dir,
                      config=dataclasses.asdict(config))
