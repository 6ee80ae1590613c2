"""Write a megazero checkpoint for any (tp, pp) layout in one process, without process groups.

Each cell (tp rank, pp rank) of the target layout is built as a ``GPTModel`` on the meta device
with ``comm.OfflineGroup`` stand-ins for its groups (``offline_parallel_state``): that gives the
cell's parameter names, local shapes and ``ShardInfo`` exactly as a training run at that layout
would create them, and no memory. ``write_checkpoint`` then fills each cell from full (logical,
unpadded) tensors with ``checkpoint.reshard.cut`` (vocabulary padding re-applied) and writes
Megatron's layout for dp=1 and ZeRO stage 0::

    OUT/iter_0000100/mp_rank_00_001/model_optim_rng.pt   model, param_meta, args, layout,
                                                          optimizer (stage-0 fragments), ...
    OUT/iter_0000100/layout.json
    OUT/latest_checkpointed_iteration.txt                 written last

Files are written atomically (temporary name + rename) and the tracker last, as
``checkpoint.save_checkpoint`` does. A stage's cells are filled together, so each full
tensor is read once and peak memory is about one pipeline stage of the target layout.
"""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Callable

import torch

from megazero.checkpoint.paths import (
    MODEL_FILE,
    CheckpointError,
    atomic_save,
    atomic_write_text,
    cell_dir,
    file_coords,
    iteration_dir,
    tracker_path,
)
from megazero.checkpoint.reshard import cut
from megazero.checkpoint.save import model_file_state, param_meta, write_layout_file
from megazero.config import MegazeroConfig
from megazero.distributed import comm
from megazero.distributed.parallel_state import ParallelState, rank_grid, rank_of
from megazero.model import build_gpt_model_chunks
from megazero.tensor_parallel.meta import meta_of


def offline_parallel_state(tp_size: int, tp_rank: int, pp_size: int = 1, pp_rank: int = 0,
                           dp_size: int = 1, dp_rank: int = 0,
                           virtual_pp_size: int | None = None) -> ParallelState:
    """The ``ParallelState`` of one rank of a (tp, dp, pp) grid, with ``OfflineGroup``s.

    Sizes, ranks and rank lists are those ``ParallelState.build`` would give that rank; every
    group is an ``OfflineGroup`` (its size and the rank's place in it), so layers shard as that
    rank would while any collective raises ``comm.OfflineGroupError``.
    """
    for what, rank, size in (("tp", tp_rank, tp_size), ("pp", pp_rank, pp_size),
                             ("dp", dp_rank, dp_size)):
        if not 0 <= rank < size:
            raise ValueError(f"{what} rank {rank} is outside a {what} size of {size}")
    world = tp_size * pp_size * dp_size
    rank = rank_of(tp_rank, dp_rank, pp_rank, tp_size, dp_size)
    ps = ParallelState(world_size=world, rank=rank, tp_size=tp_size, pp_size=pp_size,
                       dp_size=dp_size, tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank,
                       virtual_pp_size=virtual_pp_size, device=torch.device("meta"))
    ps.embedding_ranks = []
    for kind, ranks_list in rank_grid(world, tp_size, pp_size).items():
        for ranks in ranks_list:
            if rank in ranks:
                setattr(ps, f"{kind}_ranks", list(ranks))
                setattr(ps, f"{kind}_group",
                        comm.OfflineGroup(len(ranks), ranks.index(rank), kind))
    ps.world_group = comm.OfflineGroup(world, rank, "world")
    return ps


def build_cell(model_config, tp_size: int, tp_rank: int, pp_size: int, pp_rank: int):
    """The model chunk of cell (tp_rank, pp_rank) on the meta device (no memory)."""
    ps = offline_parallel_state(tp_size, tp_rank, pp_size, pp_rank)
    return build_gpt_model_chunks(model_config, ps, device="meta")[0]


def target_config(args: dict, tp: int, pp: int) -> MegazeroConfig:
    """The saved config ``args`` re-targeted to (tp, pp), dp=1, ZeRO stage 0, validated
    (a layout the model cannot take raises ``ConfigError`` naming the flags)."""
    d = copy.deepcopy(args)
    par = d["parallel"]
    par.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
               virtual_pipeline_model_parallel_size=None, world_size=tp * pp)
    if par.get("sequence_parallel") and tp == 1:
        par["sequence_parallel"] = False
    d["optimizer"].update(zero_stage=0, cpu_offload=False)
    t = d["train"]
    t["global_batch_size"] = t.get("global_batch_size") or t["micro_batch_size"]
    return MegazeroConfig.from_dict(d)


def write_checkpoint(out: str, iteration: int | str, config: MegazeroConfig, *,
                     full_tensor: Callable[[str, str], torch.Tensor],
                     optimizer: dict | None = None, scheduler: dict | None = None,
                     consumed_train_samples: int = 0,
                     rng_fn: Callable[[int, int], list | None] | None = None,
                     overwrite: bool = False) -> str:
    """Write checkpoint ``out``/``iteration`` at ``config``'s (tp, pp), dp=1, ZeRO stage 0.

    ``full_tensor(name, kind)`` gives the full logical tensor of parameter ``name`` for kind
    "model" and, with ``optimizer`` (``{"step", "scaler", "state_names"}``), for "main" and
    each state name; those are written as stage-0 fragments (one per parameter, its whole
    local tensor). ``rng_fn(tp_rank, pp_rank)`` gives the cell's ``rng_state`` list (or None
    for none). ``overwrite`` removes an existing folder for that iteration first. Returns the
    iteration folder.
    """
    par = config.parallel
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    if par.data_parallel_size != 1 or config.optimizer.zero_stage != 0 \
            or par.virtual_pipeline_model_parallel_size is not None:
        raise ValueError("write_checkpoint writes dp=1, ZeRO stage 0, no virtual stages")
    base = iteration_dir(out, iteration)
    if os.path.exists(base):
        if not overwrite:
            raise CheckpointError(f"{base} already exists; remove it or write elsewhere")
        shutil.rmtree(base)
    layout = {"tp": tp, "pp": pp, "dp": 1, "virtual": None, "zero_stage": 0}
    args = config.to_dict()
    dtype = config.model.torch_dtype
    # Megatron's convention: a "release" checkpoint is iteration 0 (loaded as --finetune).
    saved_iteration = 0 if iteration == "release" else int(iteration)
    kinds = ["model"] + ([] if optimizer is None else ["main", *optimizer["state_names"]])
    for pp_rank in range(pp):
        cells = [build_cell(config.model, tp, t, pp, pp_rank) for t in range(tp)]
        states = []
        for t, cell in enumerate(cells):
            states.append(model_file_state(
                iteration=saved_iteration, consumed_train_samples=int(consumed_train_samples),
                args=args, layout=layout, meta=param_meta([cell]), models={"model": {}},
                scheduler=None if scheduler is None else dict(scheduler),
                rng=None if rng_fn is None else rng_fn(t, pp_rank),
                optimizer=None if optimizer is None else {
                    "zero_stage": 0, "step": int(optimizer["step"]),
                    "scaler": optimizer["scaler"], "fragments": {},
                    "state_names": list(optimizer["state_names"])}))
        for name, _ in cells[0].named_parameters():
            full = {k: full_tensor(name, k) for k in kinds}
            for cell, st in zip(cells, states):
                p = cell.get_parameter(name)
                local = {k: cut(v, meta_of(p).shard, tuple(p.shape)) for k, v in full.items()}
                st["model"][name] = local["model"].to(dtype)
                if optimizer is not None:
                    frag = {"param_start": 0, "param_end": p.numel()}
                    frag.update({k: local[k].reshape(-1).float() for k in kinds[1:]})
                    st["optimizer"]["fragments"][name] = [frag]
            del full
        for t, st in enumerate(states):
            atomic_save(st, os.path.join(cell_dir(out, iteration, t, pp_rank, pp), MODEL_FILE),
                        file_coords("model", saved_iteration, t, tp, pp_rank, pp))
        del states
    write_layout_file(out, iteration, layout, config, checksums=True)
    atomic_write_text(tracker_path(out), f"{iteration}\n")
    return base


__all__ = ["build_cell", "offline_parallel_state", "target_config", "write_checkpoint"]
