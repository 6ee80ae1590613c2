"""Save a checkpoint in Megatron's layout, atomically, with per-tensor layout metadata.

The model file of each (tp, pp) cell (written by its dp rank 0) holds the model chunks, the
scheduler, iteration, consumed samples, the config as a plain dict, every dp rank's RNG states,
and ``param_meta``: for each tensor its full (unpadded) shape and which slice the file holds
(``ParamMeta.to_dict``). With ZeRO stage 0 it also holds the optimizer; stages >= 1 write one
optimizer shard per dp rank as per-parameter fragments (``[param_start, param_end)`` of the
cell's local tensor), and stage 3 keeps the model values in those shards too. Every file
holds tensors and plain Python values only, records its coordinates (``"coords"``: kind,
iteration, tp/pp and, for shards, dp rank and size) and has a ``.crc`` sidecar with the CRC-32
of its bytes (``paths.atomic_save``); ``layout.json`` says so (``"checksums": "crc32"``). The
tracker is written last, by one rank, after a barrier over the world group of the
``ParallelState`` passed in. NaN or inf in what would be written is an error, before any file
is touched.
"""

from __future__ import annotations

import json
import logging
import os

import torch

from megazero.checkpoint.paths import (
    CHECKPOINT_VERSION,
    FORMAT,
    LAYOUT_FILE,
    MODEL_FILE,
    CheckpointError,
    atomic_save,
    atomic_write_text,
    cell_dir,
    file_coords,
    iteration_dir,
    read_tracker,
    remove_stale_temps,
    tracker_path,
    zero_shard_name,
)
from megazero.checkpoint.rng import get_rng_state
from megazero.distributed import comm
from megazero.distributed.device import is_fake
from megazero.distributed.parallel_state import ParallelState
from megazero.tensor_parallel.meta import meta_of

logger = logging.getLogger(__name__)

SHAPE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
              "max_position_embeddings", "vocab_size")
# The architecture family; a checkpoint written before these existed is GPT-2's (the values
# here), so it reads as that and a resume with Llama flags is refused as a different model.
ARCH_DEFAULTS = {"position_embedding_type": "learned_absolute", "rotary_base": 10000,
                 "rotary_percent": 1.0, "normalization": "LayerNorm", "swiglu": False,
                 "group_query_attention": False,
                 "num_query_groups": None, "untie_embeddings_and_output_weights": False,
                 "add_bias_linear": True}


def param_meta(model_chunks) -> dict:
    """Full shape and held slice of every tensor of the model chunks, by state-dict key."""
    meta = {}
    for i, chunk in enumerate(model_chunks):
        for name, p in chunk.named_parameters():
            meta[name] = {**meta_of(p).to_dict(), "chunk": i}
    return meta


def model_shape(config) -> dict:
    """The model's shape and architecture family, as ``layout.json`` stores them."""
    m = config.model
    if m is None:  # the engine's own model: its parameters' full shapes are the check
        return {}
    return {k: getattr(m, k) for k in (*SHAPE_KEYS, *ARCH_DEFAULTS)}


def vocab_divisible_by(config) -> int | None:
    return None if config.model is None else config.model.make_vocab_size_divisible_by


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


def write_layout_file(root: str, iteration, layout: dict, config,
                      checksums: bool = False) -> None:
    """``layout.json`` of an iteration; ``checksums``: every file of it has a ``.crc``
    sidecar and records its coordinates (format 2), so a missing sidecar is an error."""
    data = {"layout": layout, "model": model_shape(config)}
    if checksums:
        data.update(checksums="crc32", megazero_format=FORMAT)
    atomic_write_text(os.path.join(iteration_dir(root, iteration), LAYOUT_FILE),
                      json.dumps(data, indent=1))


def _tensors_of(state: dict):
    """(parameter name, kind, [start, end), tensor) of every tensor in the fragments of a
    sharded optimizer state dict (fp32 main values, moments, ZeRO-3 model values)."""
    for name, entries in state.get("fragments", {}).items():
        for entry in entries:
            for kind, value in entry.items():
                if isinstance(value, torch.Tensor):
                    yield name, kind, (entry.get("param_start"), entry.get("param_end")), value


def _non_finite(t: torch.Tensor) -> str | None:
    """"3 NaN, 1 inf of 4096" when ``t`` holds non-finite values; None otherwise (and for
    fake or meta tensors, which hold no values)."""
    if is_fake(t) or t.is_meta or not (t.is_floating_point() or t.is_complex()):
        return None
    if bool(torch.isfinite(t).all()):
        return None
    nan = int(torch.isnan(t).sum())
    return f"{nan} NaN, {int(torch.isinf(t).sum())} inf of {t.numel()}"


def non_finite_tensors(model_chunks, optimizer_states, check_model: bool = True,
                       limit: int = 5) -> list[str]:
    """Descriptions of the tensors about to be saved that hold NaN or inf: the model's
    parameters (``check_model``) and every fragment of the optimizer states (fp32 main
    values, moments, ZeRO-3 model values)."""
    bad = []
    if check_model:
        for chunk in model_chunks:
            for name, p in chunk.named_parameters():
                what = _non_finite(p.detach())
                if what:
                    bad.append(f"{name} (model values: {what})")
    for state in optimizer_states:
        for name, kind, (a, b), t in _tensors_of(state):
            what = _non_finite(t)
            if what:
                bad.append(f"{name} ({kind} [{a}:{b}]: {what})")
    return bad[:limit] + ([f"... {len(bad) - limit} more"] if len(bad) > limit else [])


def _sweep_before_save(root: str, iteration: int) -> None:
    """Remove dead writers' temporaries where an interrupted save leaves them: the folders
    of iterations from the tracker's on (never raises: rank 0 alone runs it before a
    collective)."""
    try:
        since = read_tracker(root, check_folder=False)
        since = min(since, iteration) if isinstance(since, int) else None
        for path in remove_stale_temps(root, since):
            logger.warning("removed %s, left by a writer that is no longer running", path)
    except (OSError, CheckpointError) as exc:
        logger.warning("could not look for stale temporary files in %s: %s", root, exc)


def save_checkpoint(root: str, iteration: int, *, model_chunks, optimizer, lr_scheduler, config,
                    ps: ParallelState, consumed_train_samples: int, tracker=None) -> str:
    """Save this rank's part of the checkpoint for ``iteration``; returns the folder.

    Before anything is written, global rank 0 removes the temporary files of dead writers
    and every rank checks the values it will write: NaN or inf in a parameter, an fp32 main
    value or an optimizer state is a ``CheckpointError`` on every rank (naming the tensor,
    the rank and the iteration) and nothing is written."""
    tcfg = config.train
    save_optim = not tcfg.no_save_optim and optimizer is not None
    rng = [get_rng_state(tracker)] if not tcfg.no_save_rng else None
    if rng is not None and ps.dp_size > 1:
        rng = comm.all_gather_object(rng[0], ps.dp_group)
    folder = cell_dir(root, iteration, ps.tp_rank, ps.pp_rank, ps.pp_size)
    stage = config.optimizer.zero_stage
    layout = layout_of(ps, stage, vocab_divisible_by(config))
    state = shard = None
    # per-dp-rank optimizer state outside the fragments (1-bit Adam's error feedback)
    gather = getattr(optimizer, "gather_rank_states", None) if save_optim else None
    rank_states = gather() if gather is not None else None
    if ps.dp_rank == 0:
        state = model_file_state(
            iteration=iteration, consumed_train_samples=consumed_train_samples,
            args=config.to_dict(), layout=layout, meta=param_meta(model_chunks),
            # ZeRO-3 keeps the parameters in the per-dp-rank shards
            models=model_states(model_chunks, buffers_only=stage == 3),
            scheduler=lr_scheduler.state_dict() if lr_scheduler is not None else None, rng=rng,
            optimizer=optimizer.sharded_state_dict() if save_optim and stage == 0 else None)
        if rank_states is not None and state.get("optimizer") is not None:
            state["optimizer"]["rank_states"] = rank_states
    if stage == 3 or (save_optim and stage > 0):
        shard = optimizer.sharded_state_dict(include_optimizer=save_optim) if stage == 3 \
            else optimizer.sharded_state_dict()
        shard["layout"] = layout
    if ps.rank == 0:
        _sweep_before_save(root, iteration)
    bad = non_finite_tensors(model_chunks, [s for s in (state and state.get("optimizer"),
                                                        shard) if s],
                             check_model=ps.dp_rank == 0 and stage < 3)
    # every rank learns of every problem (and rank 0's sweep is over before anyone writes)
    reports = comm.all_gather_object(bad, ps.world_group)
    problems = [f"rank {r}: {b}" for r, found in enumerate(reports) for b in found]
    if problems:
        raise CheckpointError(f"refusing to save iteration {iteration} to {root}: non-finite "
                              "values in " + "; ".join(problems[:8])
                              + " (the run diverged; the last checkpoint is kept)")
    where = dict(iteration=iteration, tp_rank=ps.tp_rank, tp_size=ps.tp_size,
                 pp_rank=ps.pp_rank, pp_size=ps.pp_size)
    if state is not None:
        atomic_save(state, os.path.join(folder, MODEL_FILE), file_coords("model", **where))
    if shard is not None:
        atomic_save(shard, os.path.join(folder, zero_shard_name(ps.dp_rank)),
                    file_coords("zero_shard", **where, dp_rank=ps.dp_rank,
                                dp_size=ps.dp_size))
    if ps.rank == 0:
        write_layout_file(root, iteration, layout, config, checksums=True)
    comm.barrier(ps.world_group)
    if ps.rank == 0:
        atomic_write_text(tracker_path(root), f"{iteration}\n")
        logger.info("saved checkpoint at iteration %d to %s", iteration, root)
    comm.barrier(ps.world_group)
    return iteration_dir(root, iteration)


# ---- the save folder: one writer, writable, no stale files, no tracker moved back ---------
