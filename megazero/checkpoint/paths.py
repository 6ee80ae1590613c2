"""Where a checkpoint's files are, and how each is written and read (no process group).

Megatron's layout::

    <save>/latest_checkpointed_iteration.txt              the bare iteration (or "release")
    <save>/iter_0000100/layout.json                        the layout and model shape
    <save>/iter_0000100/mp_rank_00/model_optim_rng.pt      tp rank 0 (pp = 1)
    <save>/iter_0000100/mp_rank_01_002/model_optim_rng.pt  tp rank 1, pp rank 2 (pp > 1)
    <save>/iter_0000100/mp_rank_01_002/zero_dp_rank_003_optim_states.pt   ZeRO >= 1 shards

Every file is written to a temporary name, synced and renamed (``atomic_save``,
``atomic_write_text``) and read with ``torch.load(weights_only=True)`` (``load_file``,
memory-mapped on request), with errors that name the file.
"""

from __future__ import annotations

import json
import os

import torch

from megazero.distributed.device import fake_to_meta

TRACKER = "latest_checkpointed_iteration.txt"
LAYOUT_FILE = "layout.json"
MODEL_FILE = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded as asked; the message names file and values."""


def tracker_path(root: str) -> str:
    return os.path.join(root, TRACKER)


def iteration_dir(root: str, iteration: int | str) -> str:
    name = "release" if iteration == "release" else f"iter_{int(iteration):07d}"
    return os.path.join(root, name)


def mp_dir_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """Megatron's folder of one (tp, pp) cell: ``mp_rank_TT`` or ``mp_rank_TT_PPP``."""
    if pp_size == 1:
        return f"mp_rank_{tp_rank:02d}"
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def cell_dir(root: str, iteration: int | str, tp_rank: int, pp_rank: int, pp_size: int) -> str:
    return os.path.join(iteration_dir(root, iteration), mp_dir_name(tp_rank, pp_rank, pp_size))


def saved_pp_size(base: str) -> int:
    """1 when ``base`` (an iteration folder) holds ``mp_rank_00``, else more than one."""
    return 1 if os.path.isdir(os.path.join(base, mp_dir_name(0, 0, 1))) else 2


def zero_shard_name(dp_rank: int) -> str:
    return f"zero_dp_rank_{dp_rank:03d}_optim_states.pt"


def atomic_save(obj, path: str) -> None:
    """torch.save to ``path`` via a temporary file in the same folder and a rename (the dry
    run's fake tensors are written as meta tensors: the structure without data)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        torch.save(fake_to_meta(obj), tmp)
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


def load_file(path: str, mmap: bool = False) -> dict:
    """``torch.load(weights_only=True)`` on CPU (memory-mapped with ``mmap``), with errors
    that name the file."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
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


def read_layout_file(root: str, iteration: int | str) -> dict | None:
    """``layout.json`` of a saved iteration (``{"layout": ..., "model": ...}``), or None for
    checkpoints written before it existed."""
    path = os.path.join(iteration_dir(root, iteration), LAYOUT_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)
