"""Save a checkpoint in Megatron's layout, atomically, with per-tensor layout metadata.

The model file of each (tp, pp) cell (written by its dp rank 0) holds the model chunks, the
scheduler, iteration, consumed samples, the config as a plain dict, every dp rank's RNG states,
and ``param_meta``: for each tensor its full (unpadded) shape and which slice the file holds
(``ParamMeta.to_dict``). With ZeRO stage 0 it also holds the optimizer; stages >= 1 write one
optimizer shard per dp rank as per-parameter fragments, and stage 3 keeps the model values in
those shards too. Every file holds tensors and plain Python values only; the tracker is written
last, by one rank, after a barrier over the world group of the ``ParallelState`` passed in.
"""

from __future__ import annotations

import json
import logging
import os

from megazero.checkpoint.paths import (
    CHECKPOINT_VERSION,
    LAYOUT_FILE,
    MODEL_FILE,
    atomic_save,
    atomic_write_text,
    cell_dir,
    iteration_dir,
    tracker_path,
    zero_shard_name,
)
from megazero.checkpoint.rng import get_rng_state
from megazero.distributed import comm
from megazero.distributed.parallel_state import ParallelState
from megazero.tensor_parallel.meta import meta_of

logger = logging.getLogger(__name__)

SHAPE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
              "max_position_embeddings", "vocab_size")


def param_meta(model_chunks) -> dict:
    """Full shape and held slice of every tensor of the model chunks, by state-dict key."""
    meta = {}
    for i, chunk in enumerate(model_chunks):
        for name, p in chunk.named_parameters():
            meta[name] = {**meta_of(p).to_dict(), "chunk": i}
    return meta


def model_shape(config) -> dict:
    m = config.model
    return {k: getattr(m, k) for k in SHAPE_KEYS}


def layout_of(ps: ParallelState, zero_stage: int, vocab_divisible_by: int | None = None) -> dict:
    """The parallel layout of a checkpoint (what decides each file's tensor slices)."""
    layout = {"tp": ps.tp_size, "pp": ps.pp_size, "dp": ps.dp_size,
              "virtual": ps.virtual_pp_size, "zero_stage": zero_stage}
    if vocab_divisible_by is not None:  # the vocabulary padding depends on it (and on tp)
        layout["vocab_divisible_by"] = vocab_divisible_by
    return layout


def model_states(model_chunks, buffers_only: bool = False) -> dict:
    """``{"model": state dict}`` (one chunk) or ``{"model0": ..., "model1": ...}``; with
    ``buffers_only`` (ZeRO-3, whose parameters live in the shards) only the buffers, and
    nothing at all when the model has none."""
    states = []
    for chunk in model_chunks:
        sd = chunk.state_dict()
        if buffers_only:
            params = {name for name, _ in chunk.named_parameters()}
            sd = {k: v for k, v in sd.items() if k not in params}
        states.append(sd)
    if buffers_only and not any(states):
        return {}
    if len(states) == 1:
        return {"model": states[0]}
    return {f"model{i}": sd for i, sd in enumerate(states)}


def model_file_state(*, iteration: int, consumed_train_samples: int, args: dict, layout: dict,
                     meta: dict, models: dict, scheduler: dict | None = None,
                     rng: list | None = None, optimizer: dict | None = None) -> dict:
    """The contents of one cell's ``model_optim_rng.pt`` (also written by the offline tools)."""
    state = {"checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
             "consumed_train_samples": consumed_train_samples, "args": args,
             "layout": layout, "param_meta": meta, **models}
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler
    if rng is not None:
        state["rng_state"] = rng
    if optimizer is not None:
        state["optimizer"] = optimizer
    return state


def write_layout_file(root: str, iteration, layout: dict, config) -> None:
    atomic_write_text(os.path.join(iteration_dir(root, iteration), LAYOUT_FILE),
                      json.dumps({"layout": layout, "model": model_shape(config)}, indent=1))


def save_checkpoint(root: str, iteration: int, *, model_chunks, optimizer, lr_scheduler, config,
                    ps: ParallelState, consumed_train_samples: int, tracker=None) -> str:
    """Save this rank's part of the checkpoint for ``iteration``; returns the folder."""
    tcfg = config.train
    save_optim = not tcfg.no_save_optim and optimizer is not None
    rng = [get_rng_state(tracker)] if not tcfg.no_save_rng else None
    if rng is not None and ps.dp_size > 1:
        rng = comm.all_gather_object(rng[0], ps.dp_group)
    folder = cell_dir(root, iteration, ps.tp_rank, ps.pp_rank, ps.pp_size)
    stage = config.optimizer.zero_stage
    layout = layout_of(ps, stage, config.model.make_vocab_size_divisible_by)
    if ps.dp_rank == 0:
        state = model_file_state(
            iteration=iteration, consumed_train_samples=consumed_train_samples,
            args=config.to_dict(), layout=layout, meta=param_meta(model_chunks),
            # ZeRO-3 keeps the parameters in the per-dp-rank shards
            models=model_states(model_chunks, buffers_only=stage == 3),
            scheduler=lr_scheduler.state_dict() if lr_scheduler is not None else None, rng=rng,
            optimizer=optimizer.sharded_state_dict() if save_optim and stage == 0 else None)
        atomic_save(state, os.path.join(folder, MODEL_FILE))
    if stage == 3 or (save_optim and stage > 0):
        shard = optimizer.sharded_state_dict(include_optimizer=save_optim) if stage == 3 \
            else optimizer.sharded_state_dict()
        shard["layout"] = layout
        atomic_save(shard, os.path.join(folder, zero_shard_name(ps.dp_rank)))
    if ps.rank == 0:
        write_layout_file(root, iteration, layout, config)
    comm.barrier(ps.world_group)
    if ps.rank == 0:
        atomic_write_text(tracker_path(root), f"{iteration}\n")
        logger.info("saved checkpoint at iteration %d to %s", iteration, root)
    comm.barrier(ps.world_group)
    return iteration_dir(root, iteration)
