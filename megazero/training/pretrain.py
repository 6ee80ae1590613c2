"""The pretraining loop: schedule -> optimizer -> log -> eval -> save, in Megatron's shape.

``pretrain(train_valid_test_datasets_provider, model_provider, forward_step_func, config)``
initialises torch.distributed and the ``ParallelState``, builds the tokenizer (the default
corpus when no ``--data-path``), the model chunks, the optimizer over the dp group and the
schedule over the pp group, loads ``--load``, then trains for ``--train-iters`` (or
``--train-samples``), printing Megatron's log line from the last rank every ``--log-interval``,
evaluating every ``--eval-interval`` and saving every ``--save-interval``. This is the one
module that wires tensor, pipeline and data parallelism together: ``Trainer`` holds one run's
wired parts, and each iteration goes schedule (``get_forward_backward_func``) ->
``optimizer.finish_grad_sync`` -> ``optimizer.step`` -> log, eval, save, exit checks.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from megazero.checkpoint import (
    checkpoint_model_args,
    load_checkpoint,
    prepare_save_dir,
    save_checkpoint,
)
from megazero.config import MegazeroConfig
from megazero.data_parallel import build_optimizer
from megazero.distributed import comm
from megazero.distributed.device import host_float, host_values
from megazero.distributed.init import init_distributed
from megazero.distributed.parallel_state import ParallelState
from megazero.optim import build_lr_scheduler
from megazero.pipeline_parallel.trace import PipelineTrace
from megazero.tensor_parallel.random import set_random_seed
from megazero.training.data import build_data_iterators, prepare_tokenizer
from megazero.training.log import (
    TensorBoard,
    is_log_rank,
    log_memory,
    log_validation,
    logger,
    resident_bytes,
    setup_logging,
    throughput_tflops,
    training_log_line,
)
from megazero.training.monitor import Monitor
from megazero.training.signals import ExitSignalHandler, host_flag_any
from megazero.training.state import TrainState
from megazero.training.step import evaluate, train_step
from megazero.training.timers import Timers


def num_train_iters(config: MegazeroConfig) -> int:
    t = config.train
    if t.train_iters is not None:
        return t.train_iters
    if t.train_samples is not None:
        if t.rampup_batch_size is None:
            return t.train_samples // t.global_batch_size
        iters = consumed = 0  # the ramp-up's iterations: count them
        while consumed + config.global_batch_size_at(consumed) <= t.train_samples:
            consumed += config.global_batch_size_at(consumed)
            iters += 1
        return iters
    raise ValueError("set --train-iters or --train-samples")


@dataclass
class PretrainResult:
    """What ``pretrain`` returns: plain per-interval values in ``history`` (each loss name ->
    one mean per ``--log-interval``, "iterations", "loss scale", "validation", "test"), where
    training ended, and the run's objects for callers that inspect them."""

    history: dict
    iteration: int
    consumed_train_samples: int
    skipped_iters: int
    nan_iters: int
    model: list
    optimizer: object
    parallel_state: ParallelState


def pretrain(train_valid_test_datasets_provider, model_provider, forward_step_func,
             config: MegazeroConfig, *, ps: ParallelState | None = None,
             zero3_unit_policy=None, on_ready=None) -> PretrainResult:
    """Run Megatron-style pretraining (see the module docstring). ``zero3_unit_policy``:
    which modules use which parameters (``data_parallel.zero3_units``): ZeRO-3 gathers them
    together, stages 1-2 overlap the parameter all-gather with the forward by it; ``on_ready``:
    called with the ``Trainer`` once everything is built and loaded, before the first
    iteration (the dry run starts measuring there)."""
    start = time.time()
    ps = ps or init_distributed(config.parallel)
    setup_logging(ps)
    save_dir = prepare_save_dir(config, ps)  # --save writable and locked, before any work
    try:
        return _pretrain(train_valid_test_datasets_provider, model_provider, forward_step_func,
                         config, ps, zero3_unit_policy, on_ready, start)
    finally:
        save_dir.release()


def _pretrain(train_valid_test_datasets_provider, model_provider, forward_step_func, config,
              ps, zero3_unit_policy, on_ready, start) -> PretrainResult:
    tracker = set_random_seed(config.train.seed, ps)
    tokenizer = prepare_tokenizer(config, ps)
    if config.train.load and config.train.use_checkpoint_args:
        saved = checkpoint_model_args(config.train.load)
        if saved is not None:  # the vocabulary comes from the tokenizer, not the checkpoint
            config = config.replace_model(**{k: v for k, v in saved.items()
                                              if k != "vocab_size"})
    resident_before_model = resident_bytes(trim=True, anonymous=True)
    model = model_provider(config, ps, tracker)
    iters = num_train_iters(config)
    gbs = config.train.global_batch_size
    samples = config.train.train_samples if config.train.train_samples is not None \
        else iters * gbs
    lr_scheduler = build_lr_scheduler(config.optimizer, gbs, samples)
    optimizer = build_optimizer(model, config.optimizer, ps, lr_scheduler=lr_scheduler,
                                seed=config.train.seed, unit_policy=zero3_unit_policy)
    if ps.rank == 0 and getattr(optimizer, "rule", None) is not None:
        o = config.optimizer
        where = f", fp32 states in files under {o.nvme_path}" \
            if o.offload_optimizer == "nvme" else ", fp32 states in host memory" \
            if o.cpu_offload else ""
        if o.offload_param == "nvme":
            where += f", parameters in files under {o.nvme_path}"
        logger.info("Using %s optimizer; ZeRO stage %d%s", optimizer.describe(),
                    o.zero_stage, where)
    trainer = Trainer(config, ps, tracker, model, optimizer, lr_scheduler, forward_step_func)
    trainer.resident_before_model = resident_before_model
    if config.train.load:
        loaded = load_checkpoint(config.train.load, model_chunks=model, optimizer=optimizer,
                                 lr_scheduler=lr_scheduler, config=config, ps=ps,
                                 tracker=tracker)
        trainer.state.iteration = loaded.start_iteration
        trainer.state.consumed_train_samples = loaded.consumed_train_samples
    train_iter, valid_iter, test_iter = build_data_iterators(
        train_valid_test_datasets_provider, config, ps, tokenizer, iters,
        trainer.state.consumed_train_samples)
    if ps.rank == 0:
        logger.info("setup done in %.1f s: %s, %d parameters on this rank", time.time() - start,
                    ps.describe(), sum(p.numel() for c in model for p in c.parameters()))
    check_finite_weights(model, optimizer, ps)
    if on_ready is not None:
        on_ready(trainer)
    state, tcfg = trainer.state, config.train
    if not tcfg.skip_train and state.iteration < iters:
        trainer.train(train_iter, valid_iter, iters, start)
        optimizer.finish_param_sync()  # the caller reads the parameters (PretrainResult)
    if tcfg.eval_iters > 0 and valid_iter is not None:
        trainer.history["validation"].append(
            trainer.evaluate_and_print(valid_iter, "the end of training for val data"))
    if tcfg.eval_iters > 0 and test_iter is not None:
        trainer.history["test"] = trainer.evaluate_and_print(
            test_iter, "the end of training for test data")
    if tcfg.save and state.iteration > 0 and not trainer.saved_now():
        trainer.save()
    trainer.monitor.close()
    return PretrainResult(trainer.history, state.iteration, state.consumed_train_samples,
                          state.skipped_iters, state.nan_iters, model, optimizer, ps)


class TrainingDivergedError(RuntimeError):
    """Training cannot go on: too many skipped iterations in a row, or non-finite weights."""


def check_finite_weights(model, optimizer, ps: ParallelState) -> None:
    """Non-finite weights before the first step are an error on every rank (agreed over the
    world group), naming this rank's offending parameters."""
    checks, names = [], []
    for chunk in model:
        for name, p in chunk.named_parameters():
            if p.numel():
                checks.append(torch.isfinite(p.detach()).all())
                names.append(name)
    for k, t in enumerate(optimizer.state_tensors().get("params", [])):
        checks.append(torch.isfinite(t).all())
        names.append(f"parameter storage {k} (ZeRO partition)")
    local = torch.stack(checks).logical_not().to(torch.float32) if checks else None
    bad = [n for n, b in zip(names, host_values(local)) if b > 0] if local is not None else []
    flag = torch.tensor([1.0 if bad else 0.0], device=ps.device)
    comm.all_reduce(flag, ps.world_group, op=torch.distributed.ReduceOp.MAX)
    if host_float(flag) > 0:
        raise TrainingDivergedError(
            "non-finite initial weights (inf or NaN) "
            + (f"in {', '.join(bad[:8])}" + (" ..." if len(bad) > 8 else "") if bad
               else "on another rank")
            + f" ({ps.describe()}): check --init-method-std, the loaded checkpoint and the "
              "dtype (fp16 holds values up to 65504)")


class Trainer:
    """One run's wired parts (config, ``ParallelState``, model chunks, optimizer, scheduler,
    the user's forward step) and the loop over them."""

    def __init__(self, config: MegazeroConfig, ps: ParallelState, tracker, model, optimizer,
                 lr_scheduler, forward_step_func):
        self.config, self.ps, self.tracker = config, ps, tracker
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.forward_step_func = forward_step_func
        self.timers = Timers(ps.device, synchronize=config.train.log_timers)
        self.state = TrainState()
        self.history: dict = {"lm loss": [], "iterations": [], "validation": []}
        self.tensorboard = None
        if config.train.tensorboard_dir and is_log_rank(ps):
            self.tensorboard = TensorBoard(config.train.tensorboard_dir)
        self.monitor = Monitor(config, ps, self.tensorboard)
        self.resident_before_model: int | None = None  # --log-memory's baseline

    # ---- the loop ------------------------------------------------------------------------
    def train(self, train_iter, valid_iter, iters: int, start: float) -> None:
        tcfg, ps = self.config.train, self.ps
        for chunk in self.model:
            chunk.train()
        gbs = tcfg.global_batch_size
        trace = PipelineTrace(ps) if tcfg.pipeline_trace else None
        interval_start = time.time()
        handler = ExitSignalHandler(tcfg.exit_signal) if tcfg.exit_signal_handler else None
        self.start_iteration = self.state.iteration
        try:
            self._loop(train_iter, valid_iter, iters, start, gbs, trace, interval_start,
                       handler)
        finally:
            if handler is not None:
                handler.restore()
        self.state.settle()  # the totals of iterations after the last log line
        if trace is not None:
            trace.save(tcfg.pipeline_trace)

    def _loop(self, train_iter, valid_iter, iters, start, gbs, trace, interval_start,
              handler) -> None:
        tcfg, state, ps = self.config.train, self.state, self.ps
        while state.iteration < iters:
            if trace is not None:
                trace.begin_iteration(state.iteration + 1)
            self.monitor.iteration_start(state.iteration + 1)
            gbs = self.config.global_batch_size_at(state.consumed_train_samples)  # ramp-up
            losses, ok, grad_norm = train_step(self.forward_step_func, train_iter, self.model,
                                               self.optimizer, self.config, ps, self.timers,
                                               trace, self.config.microbatches_for(gbs))
            state.iteration += 1
            state.consumed_train_samples += gbs
            state.last_global_batch_size = gbs
            if tcfg.log_memory and not state.memory_logged:
                log_memory(self.optimizer, ps, self.resident_before_model)
                state.memory_logged = True
            self.lr_scheduler.step(gbs)
            # on the device: nothing is read until the log line needs it
            state.accumulate(tuple(losses), torch.stack(list(losses.values()))
                             if losses else None, ok, grad_norm, ps.device)
            self.monitor.iteration_end(state.iteration)
            if tcfg.log_interval and state.iteration % tcfg.log_interval == 0:
                self.log((time.time() - interval_start) / tcfg.log_interval, iters)
                interval_start = time.time()
            if tcfg.save and tcfg.save_interval and state.iteration % tcfg.save_interval == 0:
                self.save()
            if (tcfg.eval_iters > 0 and valid_iter is not None
                    and state.iteration % tcfg.eval_interval == 0 and state.iteration < iters):
                self.history["validation"].append(
                    self.evaluate_and_print(valid_iter, f"iteration {state.iteration}"))
                self.monitor.around_evaluation()
                for chunk in self.model:
                    chunk.train()
            if self.should_exit(start) or (handler is not None and self.signalled(handler)):
                if tcfg.save and not self.saved_now():
                    self.save()
                break

    def check_skipped(self) -> None:
        """``--max-consecutive-skipped-iterations``: a run whose every step overflows (NaN or
        diverged) stops with an error instead of skipping and saving forever. Checked where
        the host reads the steps' outcome (every ``--log-interval``: the skips are counted on
        the device); every rank agrees on skipping, so every rank stops at the same
        iteration."""
        limit, state = self.config.train.max_consecutive_skipped_iterations, self.state
        if limit and state.consecutive_skipped >= limit:
            last = state.last_finite_loss
            where = (f"the last finite loss was {last[1]} at iteration {last[0]}" if last
                     else "no iteration had a finite loss")
            raise TrainingDivergedError(
                f"{state.consecutive_skipped} consecutive iterations skipped for non-finite "
                f"gradients, up to iteration {state.iteration} "
                f"(--max-consecutive-skipped-iterations {limit}); {where}. The run diverged: "
                "resume from an earlier checkpoint with a lower --lr, or check the data")

    def signalled(self, handler: ExitSignalHandler) -> bool:
        if not handler.agreed(self.ps):
            return False
        if self.ps.rank == 0:
            logger.info("exiting program at iteration %d after %s (--exit-signal-handler)",
                        self.state.iteration, handler.signame)
        return True

    def should_exit(self, start: float) -> bool:
        tcfg, ps, state = self.config.train, self.ps, self.state
        if tcfg.exit_interval and state.iteration % tcfg.exit_interval == 0:
            if ps.rank == 0:
                logger.info("exiting program at iteration %d (--exit-interval)", state.iteration)
            return True
        if tcfg.exit_duration_in_mins is not None:
            # agreed on the host route: the check never waits for the device
            if host_flag_any((time.time() - start) / 60 > tcfg.exit_duration_in_mins, ps):
                if ps.rank == 0:
                    logger.info("exiting program after %.2f minutes (--exit-duration-in-mins)",
                                (time.time() - start) / 60)
                return True
        return False

    # ---- checkpoints ---------------------------------------------------------------------
    def saved_now(self) -> bool:
        si = self.config.train.save_interval
        return si is not None and self.state.iteration % si == 0

    def save(self) -> None:
        save_checkpoint(self.config.train.save, self.state.iteration, model_chunks=self.model,
                        optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
                        config=self.config, ps=self.ps,
                        consumed_train_samples=self.state.consumed_train_samples,
                        tracker=self.tracker)

    # ---- reporting -----------------------------------------------------------------------
    def log(self, elapsed: float, iters: int) -> None:
        """The log line of the interval that just ended (last rank), TensorBoard, history.
        First the interval's one read from the device, and the skipped-iterations check."""
        tcfg, ps, state = self.config.train, self.ps, self.state
        state.settle(self.optimizer.loss_scale)
        self.check_skipped()
        n = max(state.loss_iters, 1)
        avg = {k: v / n for k, v in state.loss_sums.items()}
        loss_scale = state.last_loss_scale
        if is_log_rank(ps):
            logger.info(training_log_line(
                self.config, ps, iteration=state.iteration, iters=iters,
                consumed_samples=state.consumed_train_samples, elapsed=elapsed,
                lr=self.lr_scheduler.get_lr(), losses=avg, loss_scale=loss_scale,
                global_batch_size=state.last_global_batch_size,
                grad_norm=state.last_grad_norm, skipped=state.interval_skipped,
                nan=state.interval_nan))
            logger.info(self.monitor.progress(state.iteration, self.start_iteration, iters))
            if tcfg.log_timers:
                logger.info(self.timers.log_string(normalizer=tcfg.log_interval))
            self._scalars(avg, loss_scale, elapsed)
        else:
            self.timers.log_string(reset=True)
        for k, v in avg.items():
            self.history.setdefault(k, []).append(v)
        self.history["iterations"].append(state.iteration)
        self.history.setdefault("loss scale", []).append(loss_scale)
        state.loss_sums, state.loss_iters = {}, 0
        state.interval_skipped = state.interval_nan = 0

    def _scalars(self, avg: dict, loss_scale: float, elapsed: float) -> None:
        """The interval's scalars to TensorBoard and wandb (logging rank)."""
        scalars = {**{f"train/{k}": v for k, v in avg.items()},
                   "train/learning-rate": self.lr_scheduler.get_lr(),
                   "train/loss-scale": loss_scale}
        grad_norm = self.state.last_grad_norm
        if grad_norm is not None and math.isfinite(grad_norm):
            scalars["train/grad-norm"] = grad_norm
        if self.config.train.log_throughput and elapsed:
            scalars["train/throughput-tflops-per-gpu"] = throughput_tflops(
                self.config, self.ps, elapsed, self.state.last_global_batch_size)
        if self.tensorboard is not None:
            self.tensorboard.add(scalars, self.state.iteration)
        self.monitor.train_scalars(scalars, self.state.iteration)

    def evaluate_and_print(self, data_iterator, prefix: str) -> dict:
        if hasattr(data_iterator, "reset"):
            data_iterator.reset()  # every evaluation sees the same batches
        totals = evaluate(self.forward_step_func, data_iterator, self.model, self.config,
                          self.ps)
        if is_log_rank(self.ps):
            log_validation(prefix, totals)
        self.monitor.validation(totals, self.state.iteration)
        return totals
