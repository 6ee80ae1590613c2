"""Load a checkpoint saved at any layout into this rank's model and optimizer: one path.

Every load goes through ``CheckpointReader``: each rank reads (memory-mapped) only the cells
and fragments overlapping its own slices, first the model values, then its ZeRO partition's
fp32 main values and optimizer states. At the saved layout every slice is one the reader
copies as it is (its special case); at another tp/pp/dp/ZeRO/virtual layout the reader cuts
and joins. RNG states carry over when the tp x pp x dp grid is unchanged and are re-derived
otherwise (``rng.rederive_rng``): with dropout off the run continues exactly.

A Megatron-LM checkpoint (``megatron.is_megatron_checkpoint``: Megatron's folders without
megazero's layout file and checksums) is read the same way through a ``MegatronReader``, which
assembles each full tensor from Megatron's files and cuts this rank's slice from it: the model
loads at any layout, training continues from its iteration and consumed samples, with its
optimizer state when Megatron's (non-distributed) optimizer maps onto the model, else only with
--no-load-optim or --finetune (the error says why). RNG states are not taken from Megatron
files (the seeded ones stay).

The loader changes the model, optimizer, scheduler and RNG it is given, and returns what the
caller must apply itself (``LoadedCheckpoint``: iteration, consumed samples, the saved config);
it never edits the caller's config. ``checkpoint_model_args`` reads the saved model shape for
``--use-checkpoint-args`` (from Megatron's args for a Megatron checkpoint).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from megazero.checkpoint.megatron import MegatronReader, is_megatron_checkpoint
from megazero.checkpoint.paths import (
    CheckpointError,
    read_layout_file,
    read_tracker,
    tracker_path,
)
from megazero.checkpoint.reader import CheckpointReader
from megazero.checkpoint.rng import rederive_rng, set_rng_state
from megazero.checkpoint.save import ARCH_DEFAULTS, layout_of, model_shape, vocab_divisible_by
from megazero.distributed import comm
from megazero.distributed.parallel_state import ParallelState, rank_of
from megazero.tensor_parallel.meta import meta_of

logger = logging.getLogger(__name__)

_LAYOUT_KEYS = ("tp", "pp", "dp", "virtual", "zero_stage")


@dataclass
class LoadedCheckpoint:
    """What a load gives the caller to apply (nothing was loaded when ``iteration`` is None:
    no tracker file, training starts from scratch)."""

    iteration: int | str | None = None  # the checkpoint's (the tracker's) iteration
    start_iteration: int = 0  # where training continues (0 for --finetune and releases)
    consumed_train_samples: int = 0
    args: dict = field(default_factory=dict)  # the config the checkpoint was saved with
    layout: dict = field(default_factory=dict)  # the layout it was saved at

    @property
    def loaded(self) -> bool:
        return self.iteration is not None


def check_model_shape(saved_args: dict, config, where: str) -> None:
    current = model_shape(config)
    if not current:  # the engine's own model: the parameters' full shapes are checked
        return
    if "model" in saved_args and saved_args["model"] is None:
        raise CheckpointError(f"checkpoint {where} holds a model megazero's engine trained, "
                              "not megazero's GPT; load it with engine.load_checkpoint")
    saved = {**ARCH_DEFAULTS, **saved_args.get("model", {})}
    diffs = [f"{k}: checkpoint {saved.get(k)} vs current {v}" for k, v in current.items()
             if k in saved and saved[k] != v]
    if diffs:
        raise CheckpointError(f"checkpoint {where} was saved for a different model shape ("
                              + "; ".join(diffs) + "); pass matching flags or "
                              "--use-checkpoint-args")


def checkpoint_model_args(root: str) -> dict | None:
    """The model shape (``layout.json``'s ``model``, or a Megatron checkpoint's architecture
    from its args) of the checkpoint ``root``'s tracker names, for ``--use-checkpoint-args``;
    None when there is no checkpoint or no layout file."""
    it = read_tracker(root)
    if it is None:
        return None
    if is_megatron_checkpoint(root, it):
        return dict(MegatronReader(root, it).model_args)
    saved = read_layout_file(root, it)
    return None if saved is None else {**ARCH_DEFAULTS, **saved["model"]}


def open_reader(root: str, iteration, config) -> CheckpointReader | MegatronReader:
    """The reader of checkpoint ``root``/``iteration``: megazero's, or Megatron-LM's (the
    true vocabulary, which Megatron stores padded, is the model's)."""
    if is_megatron_checkpoint(root, iteration):
        return MegatronReader(root, iteration, vocab_size=None if config.model is None
                              else config.model.vocab_size)
    return CheckpointReader(root, iteration, verify=config.train.verify_checkpoint)


def same_layout(a: dict, b: dict) -> bool:
    same = all(a.get(k) == b.get(k) for k in _LAYOUT_KEYS)
    if "vocab_divisible_by" in a and "vocab_divisible_by" in b:
        same = same and a["vocab_divisible_by"] == b["vocab_divisible_by"]
    return same


def load_checkpoint(root: str, *, model_chunks, optimizer, lr_scheduler, config,
                    ps: ParallelState, tracker=None, iteration=None) -> LoadedCheckpoint:
    """Load iteration ``iteration`` (default: the tracker's) of checkpoint ``root``.

    Without a tracker file (and no ``iteration``), log Megatron's message and return an empty
    ``LoadedCheckpoint``: training starts fresh. A malformed tracker (a folder, binary junk,
    not a non-negative integer, an iteration without its folder) is a ``CheckpointError``.
    Every file read is checked against its recorded coordinates and (unless
    ``--no-verify-checkpoint``) its checksum (``CheckpointReader``).
    """
    if iteration is None:
        iteration = read_tracker(root)
    if iteration is None:
        if config.train.exit_on_missing_checkpoint:
            raise CheckpointError(f"--exit-on-missing-checkpoint: there is no checkpoint to "
                                  f"load at --load {root} ({tracker_path(root)} is missing)")
        if ps.rank == 0:
            logger.warning("WARNING: could not find the metadata file %s", tracker_path(root))
            logger.warning("    will not load any checkpoints and will start from random")
        return LoadedCheckpoint()
    reader = open_reader(root, iteration, config)
    tcfg = config.train
    finetune = tcfg.finetune or iteration == "release"
    load_optim = not (finetune or tcfg.no_load_optim) and optimizer is not None
    zero3 = config.optimizer.zero_stage == 3
    verify_together(reader, ps, shards=load_optim or reader.stage == 3)
    check_model_shape(reader.args, config, reader.base)
    params = {name: p for chunk in model_chunks for name, p in chunk.named_parameters()}

    def region(name, kind, a=0, b=None):
        meta = meta_of(params[name])
        return reader.read_flat(name, kind, meta.shard, meta.local_shape, a, b)

    if not zero3:
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(region(name, "model").view(p.shape).to(p.dtype))
    _load_buffers(reader, model_chunks, ps)
    if load_optim:
        _load_optimizer(reader, optimizer, lr_scheduler, config, region, zero3, ps)
    elif optimizer is not None:
        if zero3:
            optimizer.load_sharded_state_dict(
                {"fragments": {}}, load_optimizer=False,
                fragment_reader=lambda n, a, b: {"model": region(n, "model", a, b)})
        else:
            optimizer.reload_model_params()
    first = reader.training_state()
    if not (finetune or tcfg.no_load_rng):
        _load_rng(reader, config, ps, tracker, first)
    start = 0 if finetune else int(first["iteration"])
    consumed = 0 if finetune else int(first.get("consumed_train_samples", 0))
    current = layout_of(ps, config.optimizer.zero_stage, vocab_divisible_by(config))
    if ps.rank == 0:
        if isinstance(reader, MegatronReader):
            logger.info("loaded %s %s (iteration %s, %s optimizer state) into tp=%d pp=%d "
                        "dp=%d zero=%d", reader.description, root, start,
                        "with" if load_optim else "without", ps.tp_size, ps.pp_size,
                        ps.dp_size, config.optimizer.zero_stage)
        elif same_layout(reader.layout, current):
            logger.info("successfully loaded checkpoint from %s at iteration %s", root, start)
        else:
            saved = reader.layout
            logger.info("loaded checkpoint %s (iteration %s) saved at tp=%s pp=%s dp=%s zero=%s "
                        "into tp=%d pp=%d dp=%d zero=%d", root, start, saved.get("tp"),
                        saved.get("pp"), saved.get("dp"), saved.get("zero_stage"), ps.tp_size,
                        ps.pp_size, ps.dp_size, config.optimizer.zero_stage)
    comm.barrier(ps.world_group)
    return LoadedCheckpoint(iteration=iteration, start_iteration=start,
                            consumed_train_samples=consumed, args=reader.args,
                            layout=dict(reader.layout))


def verify_together(reader: CheckpointReader, ps: ParallelState, shards: bool = True) -> None:
    """Check the files a load needs before any is read, each by one rank (a share of the
    checksum passes each), and agree: a bad file is the same ``CheckpointError`` on every
    rank, never one rank failing while the others wait in a collective."""
    files = reader.files(shards=shards)
    same_grid = (reader.tp, reader.pp, reader.dp) == (ps.tp_size, ps.pp_size, ps.dp_size)

    def checker(i: int, key: tuple) -> int:
        """At the saved grid, the rank that reads the file anyway (its page cache serves the
        read after the check); otherwise round robin."""
        if not same_grid:
            return i % ps.world_size
        t, p, d = key[0], key[1], key[2] if len(key) == 3 else 0
        return rank_of(t, d, p, ps.tp_size, ps.dp_size)

    error = None
    try:
        reader.verify_files([f for i, f in enumerate(files) if checker(i, f[1]) == ps.rank])
    except CheckpointError as exc:
        error = str(exc)
    errors = [e for e in comm.all_gather_object(error, ps.world_group) if e]
    if errors:
        more = f" (and {len(errors) - 1} more problems found by other ranks)" \
            if len(errors) > 1 else ""
        raise CheckpointError(errors[0] + more)
    reader.mark_verified(path for path, _ in files)


def _load_optimizer(reader, optimizer, lr_scheduler, config, region, zero3: bool,
                    ps: ParallelState) -> None:
    opt_meta = reader.optimizer_meta()
    if opt_meta is None:
        raise CheckpointError(f"checkpoint {reader.base} holds no optimizer state megazero "
                              f"can load ({reader.no_optimizer_reason()}); load the model "
                              "alone with --no-load-optim (the iteration and consumed samples "
                              "carry over, the optimizer starts fresh) or --finetune")
    names = tuple(optimizer.rule.state_names)
    missing = [k for k in names if k not in opt_meta["state_names"]]
    if missing:
        raise CheckpointError(f"checkpoint {reader.base} was saved by an optimizer with "
                              f"states {opt_meta['state_names']}; --optimizer "
                              f"{config.optimizer.optimizer} needs {list(names)}")
    kinds = ["main", *names] + (["model"] if zero3 else [])
    state = {"step": opt_meta["step"], "scaler": opt_meta["scaler"], "fragments": {}}
    if hasattr(optimizer, "gather_rank_states") and same_layout(reader.layout, layout_of(
            ps, config.optimizer.zero_stage, vocab_divisible_by(config))):
        # per-dp-rank state (1-bit Adam's error feedback): this cell's, at the saved layout
        saved = reader.model_file(ps.tp_rank, ps.pp_rank).get("optimizer") or {}
        state["rank_states"], state["same_layout"] = saved.get("rank_states"), True
    optimizer.load_sharded_state_dict(
        state, fragment_reader=lambda n, a, b: {k: region(n, k, a, b) for k in kinds})
    sched = reader.training_state().get("opt_param_scheduler")
    if lr_scheduler is not None and sched is not None:
        lr_scheduler.load_state_dict(sched)


def _load_buffers(reader, model_chunks, ps) -> None:
    """Non-parameter state (buffers) from the saved model file of this rank's cell (buffers
    are not sharded: tp rank 0's copy when tp changed)."""
    params = [{name for name, _ in chunk.named_parameters()} for chunk in model_chunks]
    wanted = [[k for k in chunk.state_dict() if k not in names]
              for chunk, names in zip(model_chunks, params)]
    if not any(wanted):
        return
    if isinstance(reader, MegatronReader):
        raise CheckpointError(f"the model has buffers {wanted[0][:5]}, which a Megatron "
                              f"checkpoint ({reader.base}) does not hold")
    if reader.pp != ps.pp_size:
        raise CheckpointError(f"checkpoint {reader.base}: the model has buffers, which load "
                              f"only at the saved pipeline size ({reader.pp})")
    state = reader.model_file(min(ps.tp_rank, reader.tp - 1), ps.pp_rank)
    for i, (chunk, keys) in enumerate(zip(model_chunks, wanted)):
        saved = state.get("model" if len(model_chunks) == 1 else f"model{i}", {})
        absent = [k for k in keys if k not in saved]
        if absent:
            raise CheckpointError(f"checkpoint {reader.base} has no saved buffers {absent[:5]}")
        chunk.load_state_dict({k: saved[k] for k in keys}, strict=False)


def _load_rng(reader, config, ps, tracker, first) -> None:
    """The saved states when the grid is unchanged; re-derived ones when it changed; the
    current (seeded) ones when the checkpoint holds none (saved with --no-save-rng)."""
    if "rng_state" not in first:
        return
    same_grid = all(reader.layout.get(k) == v for k, v in
                    (("tp", ps.tp_size), ("pp", ps.pp_size), ("dp", ps.dp_size)))
    if same_grid:
        rng = reader.model_file(ps.tp_rank, ps.pp_rank)["rng_state"]
        set_rng_state(rng[ps.dp_rank] if len(rng) > ps.dp_rank else rng[0], tracker)
    else:
        rederive_rng(config.train.seed, int(first["iteration"]), ps, tracker)


__all__ = ["LoadedCheckpoint", "checkpoint_model_args", "check_model_shape", "load_checkpoint",
           "open_reader", "same_layout", "verify_together"]
