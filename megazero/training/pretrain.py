"""The pretraining loop: schedule -> optimizer -> log -> eval -> save, in Megatron's shape.

``pretrain(train_valid_test_datasets_provider, model_provider, forward_step_func, config)``
initialises torch.distributed and the ``ParallelState``, builds the tokenizer (the default
corpus when no ``--data-path``), the model chunks, the optimizer over the dp group and the
schedule over the pp group, loads ``--load``, then trains for ``--train-iters`` (or
``--train-samples``), printing Megatron's log line from the last rank every ``--log-interval``,
evaluating every ``--eval-interval`` and saving every ``--save-interval``. This is the one
module that wires tensor, pipeline and data parallelism together.
"""

from __future__ import annotations

import logging
import math
import sys
import time

import torch

from megazero import checkpointing
from megazero.config import MegazeroConfig
from megazero.data_parallel import build_optimizer
from megazero.distributed import comm
from megazero.distributed.init import init_distributed
from megazero.distributed.parallel_state import ParallelState
from megazero.optim import build_lr_scheduler
from megazero.pipeline_parallel.schedules import get_forward_backward_func
from megazero.tensor_parallel.random import set_random_seed
from megazero.training.data import build_data_iterators, prepare_tokenizer
from megazero.training.timers import Timers

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


def _is_log_rank(ps: ParallelState) -> bool:
    return ps.rank == ps.world_size - 1


def num_train_iters(config: MegazeroConfig) -> int:
    t = config.train
    if t.train_iters is not None:
        return t.train_iters
    if t.train_samples is not None:
        return t.train_samples // t.global_batch_size
    raise ValueError("set --train-iters or --train-samples")


def flops_per_iteration(config: MegazeroConfig) -> float:
    """Megatron's GPT FLOPs per iteration: 24 f B s L h^2 (1 + s/6h + V/16Lh), f = 3 forward +
    backward, 4 with activation recompute (Narayanan et al., 2021)."""
    m, t = config.model, config.train
    b, s, layers, h = t.global_batch_size, m.seq_length, m.num_layers, m.hidden_size
    factor = 4 if m.recompute_activations else 3
    v = m.vocab_size or 0
    return 24 * factor * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


class TrainState:
    def __init__(self):
        self.iteration = 0
        self.consumed_train_samples = 0
        self.skipped_iters = 0
        self.nan_iters = 0
        self.loss_sums: dict[str, float] = {}
        self.loss_iters = 0
        self.interval_skipped = 0
        self.interval_nan = 0
        self.last_grad_norm = None


def pretrain(train_valid_test_datasets_provider, model_provider, forward_step_func,
             config: MegazeroConfig, *, ps: ParallelState | None = None) -> dict:
    """Run Megatron-style pretraining; returns a summary dict (losses per iteration, ...)."""
    start = time.time()
    ps = ps or init_distributed(config.parallel)
    setup_logging(ps)
    tracker = set_random_seed(config.train.seed, ps)
    tokenizer = prepare_tokenizer(config, ps)
    if config.train.load and config.train.use_checkpoint_args:
        _apply_checkpoint_args(config, ps)
    timers = Timers()
    model = model_provider(config, ps, tracker)
    iters = num_train_iters(config)
    gbs = config.train.global_batch_size
    lr_scheduler = build_lr_scheduler(config.optimizer, gbs, iters * gbs)
    optimizer = build_optimizer(model, config.optimizer, ps, lr_scheduler=lr_scheduler,
                                seed=config.train.seed)
    state = TrainState()
    if config.train.load:
        state.iteration, state.consumed_train_samples = checkpointing.load_checkpoint(
            config.train.load, model_chunks=model, optimizer=optimizer,
            lr_scheduler=lr_scheduler, config=config, ps=ps, tracker=tracker)
    train_iter, valid_iter, test_iter = build_data_iterators(
        train_valid_test_datasets_provider, config, ps, tokenizer, iters,
        state.consumed_train_samples)
    if ps.rank == 0:
        logger.info("setup done in %.1f s: %s, %d parameters on this rank", time.time() - start,
                    ps.describe(), sum(p.numel() for c in model for p in c.parameters()))
    history = {"lm loss": [], "iterations": [], "validation": []}
    if not config.train.skip_train and state.iteration < iters:
        _train(forward_step_func, model, optimizer, lr_scheduler, config, ps, tracker, timers,
               state, train_iter, valid_iter, iters, start, history)
    if config.train.eval_iters > 0 and valid_iter is not None:
        history["validation"].append(evaluate_and_print(
            forward_step_func, valid_iter, model, config, ps, "the end of training for val data"))
    if config.train.eval_iters > 0 and test_iter is not None:
        history["test"] = evaluate_and_print(forward_step_func, test_iter, model, config, ps,
                                             "the end of training for test data")
    if config.train.save and state.iteration > 0 and not _saved_at(state, config):
        save(config, model, optimizer, lr_scheduler, ps, state, tracker)
    history.pop("tensorboard", None)
    history.update(iteration=state.iteration, consumed_train_samples=state.consumed_train_samples,
                   skipped_iters=state.skipped_iters, nan_iters=state.nan_iters,
                   model=model, optimizer=optimizer, parallel_state=ps)
    return history


def _saved_at(state, config) -> bool:
    si = config.train.save_interval
    return si is not None and state.iteration % si == 0


def save(config, model, optimizer, lr_scheduler, ps, state, tracker):
    checkpointing.save_checkpoint(config.train.save, state.iteration, model_chunks=model,
                                  optimizer=optimizer, lr_scheduler=lr_scheduler, config=config,
                                  ps=ps, consumed_train_samples=state.consumed_train_samples,
                                  tracker=tracker)


def _apply_checkpoint_args(config, ps):
    """--use-checkpoint-args: take the model shape from the checkpoint being loaded."""
    it = checkpointing.read_tracker(config.train.load)
    if it is None:
        return
    import json
    import os

    meta = os.path.join(checkpointing.iteration_dir(config.train.load, it),
                        checkpointing.LAYOUT_FILE)
    if os.path.isfile(meta):
        with open(meta) as f:
            saved = json.load(f)["model"]
        for key, value in saved.items():
            if key != "vocab_size":
                setattr(config.model, key, value)


def train_step(forward_step_func, data_iterator, model, optimizer, config, ps, timers,
               trace=None):
    """One iteration: forward/backward over the micro-batches, grad sync, optimizer step."""
    fwd_bwd = get_forward_backward_func(ps.pp_size, ps.virtual_pp_size)
    optimizer.zero_grad()
    timers("forward-backward").start()
    losses = fwd_bwd(forward_step_func=forward_step_func, data_iterator=data_iterator,
                     model=model, num_microbatches=config.num_microbatches, ps=ps,
                     loss_scale=optimizer.loss_scale, no_sync=optimizer.no_sync,
                     tensor_shape=_tensor_shape(config, ps),
                     dtype=config.model.torch_dtype, trace=trace,
                     overlap_p2p_comm=config.parallel.overlap_p2p_comm)
    timers("forward-backward").stop()
    timers("optimizer").start()
    optimizer.finish_grad_sync()
    ok, grad_norm, skipped = optimizer.step()
    timers("optimizer").stop()
    return _reduce_losses(losses, ps), ok, grad_norm


def _tensor_shape(config, ps):
    s = config.model.seq_length
    if config.parallel.sequence_parallel and ps.tp_size > 1:
        s //= ps.tp_size
    return (s, config.train.micro_batch_size, config.model.hidden_size)


def _reduce_losses(losses: list[dict], ps: ParallelState) -> dict:
    """Mean over micro-batches and data-parallel ranks (on the last stage; {} elsewhere)."""
    if not ps.is_last_stage or not losses:
        return {}
    keys = sorted(losses[0])
    local = torch.tensor([[float(d[k]) for k in keys] for d in losses],
                         dtype=torch.float64).mean(0)
    comm.all_reduce(local, ps.dp_group)
    local /= ps.dp_size
    return dict(zip(keys, local.tolist()))


def _train(forward_step_func, model, optimizer, lr_scheduler, config, ps, tracker, timers,
           state, train_iter, valid_iter, iters, start, history):
    tcfg = config.train
    for chunk in model:
        chunk.train()
    gbs = tcfg.global_batch_size
    trace = None
    if tcfg.pipeline_trace:
        from megazero.pipeline_parallel.trace import PipelineTrace

        trace = PipelineTrace(ps)
    interval_start = time.time()
    while state.iteration < iters:
        if trace is not None:
            trace.begin_iteration(state.iteration + 1)
        losses, ok, grad_norm = train_step(forward_step_func, train_iter, model, optimizer,
                                           config, ps, timers, trace)
        state.iteration += 1
        state.consumed_train_samples += gbs
        if tcfg.log_memory and not getattr(state, "memory_logged", False):
            _log_memory(optimizer, ps)
            state.memory_logged = True
        lr_scheduler.step(gbs)
        _accumulate(state, losses, ok, grad_norm)
        if tcfg.log_interval and state.iteration % tcfg.log_interval == 0:
            elapsed = (time.time() - interval_start) / tcfg.log_interval
            _log(config, ps, state, optimizer, lr_scheduler, elapsed, iters, timers, history)
            interval_start = time.time()
        if tcfg.save and tcfg.save_interval and state.iteration % tcfg.save_interval == 0:
            save(config, model, optimizer, lr_scheduler, ps, state, tracker)
        if (tcfg.eval_iters > 0 and valid_iter is not None
                and state.iteration % tcfg.eval_interval == 0 and state.iteration < iters):
            history["validation"].append(evaluate_and_print(
                forward_step_func, valid_iter, model, config, ps, f"iteration {state.iteration}"))
            for chunk in model:
                chunk.train()
        if _should_exit(config, ps, state, start):
            if tcfg.save and not _saved_at(state, config):
                save(config, model, optimizer, lr_scheduler, ps, state, tracker)
            break
    if trace is not None:
        trace.save(tcfg.pipeline_trace)


def _should_exit(config, ps, state, start) -> bool:
    tcfg = config.train
    if tcfg.exit_interval and state.iteration % tcfg.exit_interval == 0:
        if ps.rank == 0:
            logger.info("exiting program at iteration %d (--exit-interval)", state.iteration)
        return True
    if tcfg.exit_duration_in_mins is not None:
        over = torch.tensor([1.0 if (time.time() - start) / 60 > tcfg.exit_duration_in_mins
                             else 0.0])
        comm.all_reduce(over, ps.world_group, op=torch.distributed.ReduceOp.MAX)
        if over.item() > 0:
            if ps.rank == 0:
                logger.info("exiting program after %.2f minutes (--exit-duration-in-mins)",
                            (time.time() - start) / 60)
            return True
    return False


def _accumulate(state: TrainState, losses: dict, ok: bool, grad_norm):
    state.last_grad_norm = grad_norm
    got_nan = any(not math.isfinite(v) for v in losses.values())
    if got_nan:
        state.nan_iters += 1
        state.interval_nan += 1
    if not ok:
        state.skipped_iters += 1
        state.interval_skipped += 1
    if ok and not got_nan:
        for k, v in losses.items():
            state.loss_sums[k] = state.loss_sums.get(k, 0.0) + v
        state.loss_iters += 1


class _TensorBoard:
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


def _log_memory(optimizer, ps):
    """Per-rank bytes of model states (ZeRO's accounting), once, from every rank at INFO."""
    report = optimizer.memory_report()
    mb = {k: round(v / 2**20, 2) for k, v in report.items()}
    logging.getLogger("megazero.memory").warning(
        "[rank %d] memory (MB) of model states after the first iteration: %s", ps.rank, mb)


def _log(config, ps, state, optimizer, lr_scheduler, elapsed, iters, timers, history):
    tcfg = config.train
    n = max(state.loss_iters, 1)
    avg = {k: v / n for k, v in state.loss_sums.items()}
    tokens = tcfg.global_batch_size * config.model.seq_length
    tflops = flops_per_iteration(config) / (elapsed * ps.world_size * 1e12) if elapsed else 0.0
    line = f" iteration {state.iteration:8d}/{iters:8d} |"
    line += f" consumed samples: {state.consumed_train_samples:12d} |"
    line += f" elapsed time per iteration (ms): {elapsed * 1000.0:.1f} |"
    line += f" learning rate: {lr_scheduler.get_lr():.3E} |"
    line += f" global batch size: {tcfg.global_batch_size:5d} |"
    for k, v in avg.items():
        line += f" {k}: {v:.6E} |"
    line += f" loss scale: {optimizer.loss_scale:.1f} |"
    if state.last_grad_norm is not None and math.isfinite(state.last_grad_norm):
        line += f" grad norm: {state.last_grad_norm:.3f} |"
    line += f" number of skipped iterations: {state.interval_skipped:3d} |"
    line += f" number of nan iterations: {state.interval_nan:3d} |"
    line += f" tokens per second: {tokens / elapsed:.1f} |" if elapsed else ""
    line += f" TFLOP/s per rank: {tflops:.3f} |"
    if _is_log_rank(ps):
        logger.info(line)
        if tcfg.log_timers:
            logger.info(timers.log_string(normalizer=tcfg.log_interval))
        if tcfg.tensorboard_dir:
            if "tensorboard" not in history:
                history["tensorboard"] = _TensorBoard(tcfg.tensorboard_dir)
            scalars = {**{f"train/{k}": v for k, v in avg.items()},
                       "train/learning-rate": lr_scheduler.get_lr(),
                       "train/loss-scale": optimizer.loss_scale}
            if state.last_grad_norm is not None and math.isfinite(state.last_grad_norm):
                scalars["train/grad-norm"] = state.last_grad_norm
            history["tensorboard"].add(scalars, state.iteration)
    else:
        timers.log_string(reset=True)
    for k, v in avg.items():
        history.setdefault(k, []).append(v)
    history["iterations"].append(state.iteration)
    history.setdefault("loss scale", []).append(optimizer.loss_scale)
    state.loss_sums, state.loss_iters = {}, 0
    state.interval_skipped = state.interval_nan = 0


@torch.no_grad()
def evaluate(forward_step_func, data_iterator, model, config, ps) -> dict:
    for chunk in model:
        chunk.eval()
    fwd_bwd = get_forward_backward_func(ps.pp_size, ps.virtual_pp_size)
    totals: dict[str, float] = {}
    for _ in range(config.train.eval_iters):
        losses = fwd_bwd(forward_step_func=forward_step_func, data_iterator=data_iterator,
                         model=model, num_microbatches=config.num_microbatches, ps=ps,
                         forward_only=True, tensor_shape=_tensor_shape(config, ps),
                         dtype=config.model.torch_dtype,
                         overlap_p2p_comm=config.parallel.overlap_p2p_comm)
        for k, v in _reduce_losses(losses, ps).items():
            totals[k] = totals.get(k, 0.0) + v / config.train.eval_iters
    return totals


def evaluate_and_print(forward_step_func, data_iterator, model, config, ps, prefix):
    if hasattr(data_iterator, "reset"):
        data_iterator.reset()  # every evaluation sees the same batches
    totals = evaluate(forward_step_func, data_iterator, model, config, ps)
    if not _is_log_rank(ps):
        return totals
    line = f" validation loss at {prefix} |"
    for k, v in totals.items():
        line += f" {k} value: {v:.6E} | {k} PPL: {math.exp(min(20, v)):.6E} |"
    bar = "-" * (len(line) + 1)
    logger.info(bar)
    logger.info(line)
    logger.info(bar)
    return totals
