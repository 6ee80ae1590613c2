"""Checkpoints in Megatron's layout, written atomically, with per-tensor layout metadata.

    <save>/latest_checkpointed_iteration.txt              the bare iteration (or "release")
    <save>/iter_0000100/mp_rank_00/model_optim_rng.pt      tp rank 0 (pp = 1)
    <save>/iter_0000100/mp_rank_01_002/model_optim_rng.pt  tp rank 1, pp rank 2 (pp > 1)
    <save>/iter_0000100/mp_rank_01_002/zero_dp_rank_003_optim_states.pt   ZeRO >= 1 shards

The model file (written by dp rank 0 of each tp x pp cell) holds the model chunks, the
scheduler, iteration, consumed samples, the config as a plain dict, every dp rank's RNG states,
and ``param_meta``: for each tensor its full (unpadded) shape and which slice the file holds.
With ZeRO stage 0 it also holds the optimizer; stages >= 1 write one optimizer shard per dp
rank as per-parameter fragments. Every file holds tensors and plain Python values only and is
read with ``torch.load(weights_only=True)``; writes go to a temporary name and are renamed;
the tracker is written last, by one rank, after a barrier. Groups come from the
``ParallelState`` passed in.
"""

from __future__ import annotations

import json
import logging
import os
import random

import numpy as np
import torch

from megazero.distributed import comm
from megazero.distributed.parallel_state import ParallelState
from megazero.tensor_parallel.meta import meta_of

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
LAYOUT_FILE = "layout.json"
MODEL_FILE = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0
SHAPE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
              "max_position_embeddings", "vocab_size")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded as asked; the message names file and values."""


def tracker_path(root: str) -> str:
    return os.path.join(root, TRACKER)


def iteration_dir(root: str, iteration: int | str) -> str:
    name = "release" if iteration == "release" else f"iter_{int(iteration):07d}"
    return os.path.join(root, name)


def mp_dir_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    if pp_size == 1:
        return f"mp_rank_{tp_rank:02d}"
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def zero_shard_name(dp_rank: int) -> str:
    return f"zero_dp_rank_{dp_rank:03d}_optim_states.pt"


def atomic_save(obj, path: str) -> None:
    """torch.save to ``path`` via a temporary file in the same folder and a rename."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        torch.save(obj, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def safe_load(path: str) -> dict:
    """``torch.load(weights_only=True)`` with errors that name the file."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - corrupt, truncated or unsafe content
        raise CheckpointError(f"checkpoint file {path} is corrupt or truncated "
                              f"({type(exc).__name__}: {exc})") from exc


def read_tracker(root: str) -> int | str | None:
    """Iteration in the tracker file, ``"release"``, or None when there is no tracker."""
    path = tracker_path(root)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if text == "release":
        return "release"
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path} must hold an iteration number or 'release', "
                              f"got {text!r}") from None


# ---- RNG ---------------------------------------------------------------------------------

def get_rng_state(tracker) -> dict:
    np_state = np.random.get_state()
    state = {"random": random.getstate(),
             "np_random": (np_state[0], torch.from_numpy(np_state[1].copy()), int(np_state[2]),
                           int(np_state[3]), float(np_state[4])),
             "torch": torch.get_rng_state(),
             "tracker": tracker.get_states() if tracker is not None else {}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict, tracker) -> None:
    random.setstate(_tupleize(state["random"]))
    name, keys, pos, has_gauss, gauss = state["np_random"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if tracker is not None and state.get("tracker"):
        tracker.set_states(state["tracker"])


def _tupleize(x):
    return tuple(_tupleize(v) for v in x) if isinstance(x, (list, tuple)) else x


# ---- metadata ----------------------------------------------------------------------------

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


def check_model_shape(saved_args: dict, config, path: str) -> None:
    saved = saved_args.get("model", {})
    current = model_shape(config)
    diffs = [f"{k}: checkpoint {saved.get(k)} vs current {v}" for k, v in current.items()
             if k in saved and saved[k] != v]
    if diffs:
        raise CheckpointError(f"checkpoint {path} was saved for a different model shape ("
                              + "; ".join(diffs) + "); pass matching flags or "
                              "--use-checkpoint-args")


def layout_of(ps: ParallelState, zero_stage: int, vocab_divisible_by: int | None = None) -> dict:
    """The parallel layout of a checkpoint (what decides each file's tensor slices)."""
    layout = {"tp": ps.tp_size, "pp": ps.pp_size, "dp": ps.dp_size,
              "virtual": ps.virtual_pp_size, "zero_stage": zero_stage}
    if vocab_divisible_by is not None:  # the vocabulary padding depends on it (and on tp)
        layout["vocab_divisible_by"] = vocab_divisible_by
    return layout


# ---- save --------------------------------------------------------------------------------

def _model_states(model_chunks) -> dict:
    if len(model_chunks) == 1:
        return {"model": model_chunks[0].state_dict()}
    return {f"model{i}": chunk.state_dict() for i, chunk in enumerate(model_chunks)}


def save_checkpoint(root: str, iteration: int, *, model_chunks, optimizer, lr_scheduler, config,
                    ps: ParallelState, consumed_train_samples: int, tracker=None) -> str:
    """Save this rank's part of the checkpoint for ``iteration``; returns the folder."""
    tcfg = config.train
    save_optim = not tcfg.no_save_optim and optimizer is not None
    rng = [get_rng_state(tracker)] if not tcfg.no_save_rng else None
    if rng is not None and ps.dp_size > 1:
        rng = comm.all_gather_object(rng[0], ps.dp_group)
    folder = os.path.join(iteration_dir(root, iteration),
                          mp_dir_name(ps.tp_rank, ps.pp_rank, ps.pp_size))
    stage = config.optimizer.zero_stage
    layout = layout_of(ps, stage, config.model.make_vocab_size_divisible_by)
    if ps.dp_rank == 0:
        state = {"checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
                 "consumed_train_samples": consumed_train_samples,
                 "args": config.to_dict(), "layout": layout,
                 "param_meta": param_meta(model_chunks)}
        if stage < 3:  # ZeRO-3 keeps the model in the per-dp-rank shards
            state.update(_model_states(model_chunks))
        if lr_scheduler is not None:
            state["opt_param_scheduler"] = lr_scheduler.state_dict()
        if rng is not None:
            state["rng_state"] = rng
        if save_optim and stage == 0:
            state["optimizer"] = optimizer.sharded_state_dict()
        atomic_save(state, os.path.join(folder, MODEL_FILE))
    if stage == 3 or (save_optim and stage > 0):
        shard = optimizer.sharded_state_dict(include_optimizer=save_optim) if stage == 3 \
            else optimizer.sharded_state_dict()
        shard["layout"] = layout
        atomic_save(shard, os.path.join(folder, zero_shard_name(ps.dp_rank)))
    if ps.rank == 0:
        atomic_write_text(os.path.join(iteration_dir(root, iteration), LAYOUT_FILE),
                          json.dumps({"layout": layout,
                                      "model": model_shape(config)}, indent=1))
    comm.barrier(ps.world_group)
    if ps.rank == 0:
        atomic_write_text(tracker_path(root), f"{iteration}\n")
        logger.info("saved checkpoint at iteration %d to %s", iteration, root)
    comm.barrier(ps.world_group)
    return iteration_dir(root, iteration)


# ---- load --------------------------------------------------------------------------------

def load_checkpoint(root: str, *, model_chunks, optimizer, lr_scheduler, config,
                    ps: ParallelState, tracker=None) -> tuple[int, int]:
    """Load the checkpoint named by ``root``'s tracker; returns (iteration, consumed samples).

    Without a tracker file, log Megatron's message and return (0, 0): training starts fresh.
    """
    it = read_tracker(root)
    if it is None:
        if ps.rank == 0:
            logger.warning("WARNING: could not find the metadata file %s", tracker_path(root))
            logger.warning("    will not load any checkpoints and will start from random")
        return 0, 0
    tcfg = config.train
    folder = os.path.join(iteration_dir(root, it), mp_dir_name(ps.tp_rank, ps.pp_rank,
                                                                ps.pp_size))
    path = os.path.join(folder, MODEL_FILE)
    saved_layout = _peek_layout(root, it)
    current = layout_of(ps, config.optimizer.zero_stage,
                        config.model.make_vocab_size_divisible_by)
    if not _same_layout(saved_layout, current):
        from megazero.reshard import load_resharded

        return load_resharded(root, it, saved_layout, model_chunks=model_chunks,
                              optimizer=optimizer, lr_scheduler=lr_scheduler, config=config,
                              ps=ps, tracker=tracker)
    state = safe_load(path)
    check_model_shape(state.get("args", {}), config, path)
    if config.optimizer.zero_stage < 3:
        _load_model(model_chunks, state, path)
    release = it == "release"
    finetune = tcfg.finetune or release
    load_optim = not (finetune or tcfg.no_load_optim) and optimizer is not None
    if config.optimizer.zero_stage == 3:
        shard_path = os.path.join(folder, zero_shard_name(ps.dp_rank))
        shard = safe_load(shard_path)
        if load_optim and not shard.get("has_optimizer", True):
            raise CheckpointError(f"{shard_path} holds no optimizer state (saved with "
                                  "--no-save-optim); use --no-load-optim")
        optimizer.load_sharded_state_dict(shard, load_optimizer=load_optim)
        if load_optim and lr_scheduler is not None and "opt_param_scheduler" in state:
            lr_scheduler.load_state_dict(state["opt_param_scheduler"])
    elif load_optim:
        if config.optimizer.zero_stage == 0:
            if "optimizer" not in state:
                raise CheckpointError(f"{path} holds no optimizer state (saved with "
                                      "--no-save-optim); use --no-load-optim")
            optimizer.load_sharded_state_dict(state["optimizer"])
        else:
            shard_path = os.path.join(folder, zero_shard_name(ps.dp_rank))
            optimizer.load_sharded_state_dict(safe_load(shard_path))
        if lr_scheduler is not None and "opt_param_scheduler" in state:
            lr_scheduler.load_state_dict(state["opt_param_scheduler"])
    elif optimizer is not None:
        optimizer.reload_model_params()
    if not (finetune or tcfg.no_load_rng) and "rng_state" in state:
        rng = state["rng_state"]
        set_rng_state(rng[ps.dp_rank] if len(rng) > ps.dp_rank else rng[0], tracker)
    iteration = 0 if finetune else int(state["iteration"])
    consumed = 0 if finetune else int(state.get("consumed_train_samples", 0))
    if ps.rank == 0:
        logger.info("successfully loaded checkpoint from %s at iteration %s", root, iteration)
    comm.barrier(ps.world_group)
    return iteration, consumed


def _load_model(model_chunks, state, path):
    keys = ["model"] if len(model_chunks) == 1 else [f"model{i}"
                                                    for i in range(len(model_chunks))]
    for key, chunk in zip(keys, model_chunks):
        if key not in state:
            raise CheckpointError(f"{path} has no {key!r} entry (saved with another "
                                  "virtual pipeline layout?)")
        missing, unexpected = chunk.load_state_dict(state[key], strict=False)
        if missing or unexpected:
            raise CheckpointError(f"{path}: model tensors do not match the current model "
                                  f"(missing {missing[:5]}, unexpected {unexpected[:5]})")


def _peek_layout(root, it) -> dict:
    """Layout of a saved checkpoint (from ``layout.json``, else tp rank 0's model file)."""
    base = iteration_dir(root, it)
    meta = os.path.join(base, LAYOUT_FILE)
    if os.path.isfile(meta):
        with open(meta) as f:
            return json.load(f)["layout"]
    for name in ("mp_rank_00", "mp_rank_00_000"):
        path = os.path.join(base, name, MODEL_FILE)
        if os.path.isfile(path):
            return safe_load(path)["layout"]
    raise CheckpointError(f"{base} holds neither {LAYOUT_FILE} nor mp_rank_00[_000]/"
                          f"{MODEL_FILE}")


def _same_layout(a: dict, b: dict) -> bool:
    keys = ("tp", "pp", "dp", "virtual", "zero_stage")
    same = all(a.get(k) == b.get(k) for k in keys)
    if "vocab_divisible_by" in a and "vocab_divisible_by" in b:
        same = same and a["vocab_divisible_by"] == b["vocab_divisible_by"]
    return same
