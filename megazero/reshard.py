"""Reassemble full tensors from shards, and cut them for another layout.

Every parameter carries ``ShardInfo`` (full logical shape, partitioned dim, which slice this
tensor holds; padding after the slice). Checkpoints store it per tensor as ``param_meta``.
``assemble`` builds the full tensor from any set of pieces; ``cut`` takes a new layout's local
shard (with padding re-applied) from a full tensor. Nothing here communicates.
"""

from __future__ import annotations

import torch

from megazero.tensor_parallel.meta import ShardInfo, meta_of


def local_slice(shard: ShardInfo | dict):
    """(dim, start, length) of the logical slice a local tensor holds (dim None: whole)."""
    if isinstance(shard, dict):
        shard = ShardInfo.from_dict(shard)
    if shard.dim is None:
        return None, 0, None
    return shard.dim, shard.start, shard.logical_length()


def assemble(pieces: list[tuple[torch.Tensor, dict | ShardInfo]], dtype=None) -> torch.Tensor:
    """The full logical tensor from (local tensor, shard info) pieces covering it."""
    if not pieces:
        raise ValueError("no pieces to assemble")
    first = pieces[0][1]
    info = ShardInfo.from_dict(first) if isinstance(first, dict) else first
    full_shape = tuple(info.full_shape)
    dtype = dtype or pieces[0][0].dtype
    if info.dim is None:
        return pieces[0][0].detach().to(dtype).reshape(full_shape).clone()
    full = torch.empty(full_shape, dtype=dtype)
    covered = 0
    for tensor, shard in pieces:
        dim, start, length = local_slice(shard)
        if length == 0:
            continue
        src = tensor.detach().narrow(dim, 0, length)
        full.narrow(dim, start, length).copy_(src)
        covered += length
    if covered != full_shape[info.dim]:
        raise ValueError(f"shards cover {covered} of {full_shape[info.dim]} entries along "
                         f"dim {info.dim}")
    return full


def cut(full: torch.Tensor, shard: ShardInfo, local_shape) -> torch.Tensor:
    """This layout's local tensor of ``local_shape`` from the full tensor (zero padding)."""
    if shard.dim is None:
        return full.reshape(local_shape).clone()
    out = torch.zeros(local_shape, dtype=full.dtype)
    length = shard.logical_length()
    if length:
        out.narrow(shard.dim, 0, length).copy_(full.narrow(shard.dim, shard.start, length))
    return out


# ---- loading a checkpoint saved at another layout -------------------------------------------

def _rederive_rng(config, ps, iteration: int, tracker) -> None:
    """Fresh, deterministic RNG streams for a layout the checkpoint has no states for:
    seeded from (--seed, iteration, pp rank), like a new run (model-parallel stream
    ``+ 2718 + tp_rank``)."""
    import random

    import numpy as np

    from megazero.tensor_parallel.random import model_parallel_manual_seed

    seed = config.train.seed + 1_000_003 * (iteration + 1) + 100 * ps.pp_rank
    random.seed(seed)
    np.random.seed(seed % 2**32)
    model_parallel_manual_seed(seed, ps.tp_rank, tracker)


def load_resharded(root: str, iteration, saved_layout: dict, *, model_chunks, optimizer,
                   lr_scheduler, config, ps, tracker=None) -> tuple[int, int]:
    """Load checkpoint ``root``/``iteration`` saved at ``saved_layout`` into this rank's model
    and optimizer at the current layout; returns (iteration, consumed samples).

    Each rank reads (memory-mapped) only the cells and fragments overlapping its own slices:
    model values, then fp32 main values and optimizer states for its ZeRO partition. RNG
    states carry over when tp, pp and dp sizes are unchanged, else they are re-derived (see
    ``_rederive_rng``): with dropout off the run continues exactly.
    """
    from megazero.checkpoint_reader import CheckpointReader
    from megazero.checkpointing import CheckpointError, check_model_shape, set_rng_state
    from megazero.distributed import comm

    reader = CheckpointReader(root, iteration)
    check_model_shape(reader.args, config, reader.base)
    tcfg = config.train
    finetune = tcfg.finetune or iteration == "release"
    load_optim = not (finetune or tcfg.no_load_optim) and optimizer is not None
    params = {}
    for chunk in model_chunks:
        for name, p in chunk.named_parameters():
            params[name] = p

    def region(name, kind, a=0, b=None):
        meta = meta_of(params[name])
        return reader.read_flat(name, kind, meta.shard, meta.local_shape, a, b)

    zero3 = config.optimizer.zero_stage == 3
    if not zero3:
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(region(name, "model").view(p.shape).to(p.dtype))
    opt_meta = reader.optimizer_meta()
    if load_optim:
        if opt_meta is None:
            raise CheckpointError(f"checkpoint {reader.base} holds no optimizer state "
                                  "(saved with --no-save-optim); use --no-load-optim")
        names = tuple(getattr(optimizer.rule, "state_names", ()))
        missing = [k for k in names if k not in opt_meta["state_names"]]
        if missing:
            raise CheckpointError(f"checkpoint {reader.base} was saved by an optimizer with "
                                  f"states {opt_meta['state_names']}; --optimizer "
                                  f"{config.optimizer.optimizer} needs {list(names)}")
        kinds = ["main", *names] + (["model"] if zero3 else [])
        state = {"step": opt_meta["step"], "scaler": opt_meta["scaler"], "fragments": {}}
        reader_fn = lambda n, a, b: {k: region(n, k, a, b) for k in kinds}  # noqa: E731
        optimizer.load_sharded_state_dict(state, fragment_reader=reader_fn)
        sched = reader.model_file(0, 0).get("opt_param_scheduler")
        if lr_scheduler is not None and sched is not None:
            lr_scheduler.load_state_dict(sched)
    elif optimizer is not None:
        if zero3:
            optimizer.load_sharded_state_dict(
                {"fragments": {}}, load_optimizer=False,
                fragment_reader=lambda n, a, b: {"model": region(n, "model", a, b)})
        else:
            optimizer.reload_model_params()
    first = reader.model_file(0, 0)
    same_grid = all(saved_layout.get(k) == v for k, v in
                    (("tp", ps.tp_size), ("pp", ps.pp_size), ("dp", ps.dp_size)))
    if not (finetune or tcfg.no_load_rng):
        if same_grid and "rng_state" in first:
            rng = reader.model_file(ps.tp_rank, ps.pp_rank)["rng_state"]
            set_rng_state(rng[ps.dp_rank] if len(rng) > ps.dp_rank else rng[0], tracker)
        else:
            _rederive_rng(config, ps, int(first["iteration"]), tracker)
    it = 0 if finetune else int(first["iteration"])
    consumed = 0 if finetune else int(first.get("consumed_train_samples", 0))
    if ps.rank == 0:
        import logging

        logging.getLogger(__name__).info(
            "loaded checkpoint %s (iteration %s) saved at tp=%s pp=%s dp=%s zero=%s into "
            "tp=%d pp=%d dp=%d zero=%d", root, it, saved_layout.get("tp"),
            saved_layout.get("pp"), saved_layout.get("dp"), saved_layout.get("zero_stage"),
            ps.tp_size, ps.pp_size, ps.dp_size, config.optimizer.zero_stage)
    comm.barrier(ps.world_group)
    return it, consumed
