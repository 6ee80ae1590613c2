"""Read a megazero checkpoint at any layout and rebuild full tensors, one process, no groups.

A checkpoint is a grid of (tp, pp) cells, each with a model file and, for ZeRO >= 1, one
optimizer shard per dp rank holding per-parameter fragments. ``CheckpointReader`` finds the
pieces of any tensor (model values, fp32 main values, Adam moments) and ``full_tensor``
reassembles it: fragments -> the cell's local tensor -> across tp with each tensor's
``ShardInfo``; pipeline stages hold disjoint parameters (the tied embedding's last-stage copy
is skipped). Used by ``zero_to_fp32``, the checkpoint tool and the layout-changing loader.
"""

from __future__ import annotations

import os
from functools import cache

import torch

from megazero.checkpointing import (
    MODEL_FILE,
    CheckpointError,
    iteration_dir,
    mp_dir_name,
    read_tracker,
    safe_load,
    zero_shard_name,
)
from megazero.reshard import assemble


class CheckpointReader:
    """Lazy access to the files of one saved iteration."""

    def __init__(self, root: str, iteration: int | str | None = None):
        self.root = root
        if iteration is None:
            iteration = read_tracker(root)
            if iteration is None:
                raise CheckpointError(f"{root} has no latest_checkpointed_iteration.txt; "
                                      "pass the iteration explicitly")
        self.iteration = iteration
        self.base = iteration_dir(root, iteration)
        first = self.model_file(0, 0)
        self.layout = first["layout"]
        self.args = first["args"]
        self.tp, self.pp, self.dp = self.layout["tp"], self.layout["pp"], self.layout["dp"]
        self.stage = self.layout["zero_stage"]
        self._read_shard = cache(self._read_shard_uncached)

    def cell_dir(self, tp_rank: int, pp_rank: int) -> str:
        return os.path.join(self.base, mp_dir_name(tp_rank, pp_rank, self.pp_or_probe()))

    def pp_or_probe(self) -> int:
        if hasattr(self, "pp"):
            return self.pp
        # before the layout is known: Megatron names pp > 1 cells mp_rank_XX_YYY
        return 1 if os.path.isdir(os.path.join(self.base, "mp_rank_00")) else 2

    @cache  # noqa: B019 - one reader per checkpoint, files are immutable
    def model_file(self, tp_rank: int, pp_rank: int) -> dict:
        return safe_load(os.path.join(self.cell_dir(tp_rank, pp_rank), MODEL_FILE))

    def _read_shard_uncached(self, tp_rank: int, pp_rank: int, dp_rank: int) -> dict:
        return safe_load(os.path.join(self.cell_dir(tp_rank, pp_rank),
                                      zero_shard_name(dp_rank)))

    def shard(self, tp_rank: int, pp_rank: int, dp_rank: int) -> dict:
        return self._read_shard(tp_rank, pp_rank, dp_rank)

    # ---- tensors ---------------------------------------------------------------------------
    def param_names(self) -> list[str]:
        """Every logical parameter once (first stage's tied embedding)."""
        names = []
        for pp_rank in range(self.pp):
            for name in self.model_file(0, pp_rank)["param_meta"]:
                if name not in names:
                    names.append(name)
        return names

    def meta(self, name: str, tp_rank: int = 0) -> tuple[int, dict]:
        """(pp rank holding ``name``, its param_meta entry in tp rank's cell)."""
        for pp_rank in range(self.pp):
            meta = self.model_file(tp_rank, pp_rank)["param_meta"]
            if name in meta:
                return pp_rank, meta[name]
        raise KeyError(f"{name} is not in checkpoint {self.base}")

    def local_tensor(self, name: str, tp_rank: int, kind: str = "main") -> torch.Tensor:
        """The (tp, pp) cell's local tensor of ``name``: ``kind`` is "model" (saved dtype),
        "main" (fp32 master values), or an optimizer state name ("exp_avg", ...)."""
        pp_rank, meta = self.meta(name, tp_rank)
        shape = meta["local_shape"]
        if kind == "model" and self.stage < 3:
            state = self.model_file(tp_rank, pp_rank)
            key = "model" if "model" in state else f"model{meta.get('chunk', 0)}"
            return state[key][name]
        fragments = self._fragments(name, tp_rank, pp_rank, kind)
        numel = 1
        for s in shape:
            numel *= s
        flat = None
        covered = 0
        for entry in fragments:
            values = entry[kind]
            if flat is None:
                flat = torch.empty(numel, dtype=values.dtype)
            flat[entry["param_start"]:entry["param_end"]] = values
            covered += entry["param_end"] - entry["param_start"]
        if flat is None or covered != numel:
            raise CheckpointError(f"checkpoint {self.base}: fragments of {name} ({kind}) "
                                  f"cover {covered} of {numel} elements")
        return flat.view(shape)

    def _fragments(self, name, tp_rank, pp_rank, kind):
        if self.stage == 0:
            opt = self.model_file(tp_rank, pp_rank).get("optimizer")
            if opt is None:
                raise CheckpointError(f"{self.cell_dir(tp_rank, pp_rank)} holds no optimizer "
                                      "state (saved with --no-save-optim)")
            out = opt["fragments"].get(name, [])
        else:
            out = []
            for dp_rank in range(self.dp):
                out += self.shard(tp_rank, pp_rank, dp_rank)["fragments"].get(name, [])
        missing = [e for e in out if kind not in e]
        if missing:
            raise CheckpointError(f"checkpoint {self.base} has no {kind!r} values for {name} "
                                  "(saved with --no-save-optim?)")
        return out

    def full_tensor(self, name: str, kind: str = "main") -> torch.Tensor:
        """The full logical tensor, reassembled across tp (padding removed)."""
        pieces = []
        for tp_rank in range(self.tp):
            _, meta = self.meta(name, tp_rank)
            pieces.append((self.local_tensor(name, tp_rank, kind), meta))
            if meta.get("dim") is None:
                break  # replicated across tp: one copy is enough
        return assemble(pieces)

    def has_optimizer(self) -> bool:
        try:
            if self.stage == 0:
                return "optimizer" in self.model_file(0, 0)
            return self.shard(0, 0, 0).get("has_optimizer", True)
        except CheckpointError:
            return False


def consolidate(root: str, iteration=None, kind: str | None = None,
                dtype: torch.dtype | None = torch.float32) -> dict[str, torch.Tensor]:
    """A full state dict of the model: fp32 main values when saved, else the model values."""
    reader = CheckpointReader(root, iteration)
    if kind is None:
        kind = "main" if reader.has_optimizer() else "model"
    out = {}
    for name in reader.param_names():
        t = reader.full_tensor(name, kind)
        out[name] = t.to(dtype) if dtype is not None else t
    return out
