"""Random access to any region of any tensor of a saved checkpoint, whatever its layout.

A checkpoint is a grid of (tp, pp) cells: each has a model file (local tensors and their
``param_meta``: full shape, partitioned dim, held slice) and, with ZeRO >= 1, one shard per dp
rank holding per-parameter fragments (flat ranges of the cell's local tensor: fp32 main values,
optimizer states, and under ZeRO-3 the model values). ``read_flat`` returns the values of a
flat range of a tensor laid out for *another* layout (its ``ShardInfo`` and local shape): it
maps each position to the logical full tensor, finds the saved cell and fragment holding it
and copies just that. When the slice asked for is one a saved cell holds (a load at the saved
layout) it is copied as it is, with no index arithmetic: the same-layout load is this
reader's special case. Files are memory-mapped (``torch.load(mmap=True, weights_only=True)``),
so a rank touches only the pages of its own slices and never builds the full model. No
process group is needed.

Each file is checked once, when first opened (or up front by ``verify_files``): its ``.crc``
sidecar's coordinates and the size and CRC-32 of its bytes (one sequential read, before
anything is unpickled; ``verify=False`` skips this), then the coordinates the file records
(always). ``load.verify_together`` shares these checks among the ranks of a load.
"""

from __future__ import annotations

import logging
import os
from functools import cache

import numpy as np
import torch

from megazero.checkpoint.paths import (
    LAYOUT_FILE,
    MODEL_FILE,
    CheckpointError,
    cell_dir,
    check_coords,
    checksum_path,
    file_coords,
    foreign_file_error,
    iteration_dir,
    load_file,
    read_layout_file,
    read_tracker,
    saved_pp_size,
    verify_file,
    zero_shard_name,
)
from megazero.tensor_parallel.initializers import _global_flat_index
from megazero.tensor_parallel.meta import ShardInfo

logger = logging.getLogger(__name__)

_LAYOUT_KEYS = ("tp", "pp", "dp", "virtual", "zero_stage")


def not_megazero(path: str, state: dict) -> str:
    """Why a model file without megazero's layout cannot be read here."""
    megatron = any(isinstance(state.get(k), dict) for k in ("model", "model0")) and (
        "checkpoint_version" in state or "args" in state)
    if megatron:
        return (f"checkpoint file {path} is a Megatron-LM file, not a megazero one: --load "
                "reads Megatron checkpoints directly, or convert them with python -m "
                "megazero.tools.checkpoint from-megatron")
    return foreign_file_error(path, state)


class CheckpointReader:
    """Lazy, memory-mapped access to the files of one saved iteration.

    Every file is checked when it is first opened: against its ``.crc`` sidecar (size and
    CRC-32 of its bytes, before it is unpickled; skipped with ``verify=False``) and its
    recorded coordinates (kind, iteration, tp/pp rank and size, dp rank and size of a ZeRO
    shard) against the place it is read from (always). A mismatch is a ``CheckpointError``
    naming the file and what differs. Checkpoints written before these records load with a
    warning."""

    def __init__(self, root: str, iteration: int | str | None = None, *, verify: bool = True):
        self.root = root
        self.verify = verify
        if iteration is None:
            iteration = read_tracker(root)
            if iteration is None:
                raise CheckpointError(f"{root} has no latest_checkpointed_iteration.txt")
        self.iteration = iteration
        self.base = iteration_dir(root, iteration)
        if not os.path.isdir(self.base):
            raise CheckpointError(f"checkpoint {root} has no folder {self.base} for iteration "
                                  f"{iteration}")
        self.layout_file = read_layout_file(root, iteration)
        # format 2 records checksums in layout.json: then every file must have its sidecar
        self.checksummed = bool(self.layout_file and self.layout_file.get("checksums"))
        self._unchecked: list[str] = []
        self._verified: set[str] = set()
        self._first = None
        self.tp = self.pp = self.dp = None
        if self.layout_file is not None:  # no file opened yet: a load verifies them first
            self.layout = dict(self.layout_file["layout"])
        else:  # checkpoints written before layout.json: the first model file's layout
            path = os.path.join(cell_dir(root, iteration, 0, 0, saved_pp_size(self.base)),
                                MODEL_FILE)
            self._first = self._open(path, self._coords("model", 0, 0))
            self.layout = self._first.get("layout")
            if not isinstance(self.layout, dict):
                raise CheckpointError(not_megazero(path, self._first))
        self.tp, self.pp, self.dp = self.layout["tp"], self.layout["pp"], self.layout["dp"]
        self.stage = self.layout["zero_stage"]
        if self._first is not None:
            check_coords(path, self._first.get("coords"), self._coords("model", 0, 0))
        self.model_file = cache(self._model_file)
        self.shard = cache(self._shard)
        self._where = {}

    @property
    def args(self) -> dict:
        """The config the checkpoint was saved with (from the first model file)."""
        args = self.model_file(0, 0).get("args")
        if not isinstance(args, dict):
            raise CheckpointError(f"checkpoint file {self._path(0, 0)} holds no saved config "
                                  "(args): not a megazero model file")
        return args

    def training_state(self) -> dict:
        """Iteration, consumed samples, scheduler and RNG states (the first model file's)."""
        return self.model_file(0, 0)

    def cell_dir(self, tp_rank: int, pp_rank: int) -> str:
        return cell_dir(self.root, self.iteration, tp_rank, pp_rank, self.pp)

    def _coords(self, kind: str, tp_rank: int, pp_rank: int, dp_rank: int | None = None) -> dict:
        """The coordinates a file read from this place must record (sizes once known)."""
        iteration = self.iteration if isinstance(self.iteration, int) else None
        return file_coords(kind, iteration, tp_rank, self.tp, pp_rank, self.pp, dp_rank,
                           self.dp if dp_rank is not None else None)

    def _check_sidecar(self, path: str, expected: dict) -> bool:
        """Verify a file against its sidecar (coordinates, size, CRC-32) before it is
        unpickled; False when it has none (allowed for checkpoints saved before format 2)."""
        if path in self._verified:
            return True
        if verify_file(path, expected) is not None:
            self._verified.add(path)
            return True
        if self.checksummed:
            raise CheckpointError(f"checkpoint file {path} has no checksum file "
                                  f"{checksum_path(path)}, which every file of this "
                                  "checkpoint has (deleted?)")
        return False

    def _open(self, path: str, expected: dict) -> dict:
        """Verify (with ``verify``), memory-map one file, and check the coordinates it
        records against ``expected``."""
        checked = self._check_sidecar(path, expected) if self.verify else False
        state = load_file(path, mmap=True)
        has_coords = check_coords(path, state.get("coords"), expected)
        if self.verify and not checked and state.get("megazero_format", 1) >= 2:
            raise CheckpointError(f"checkpoint file {path} was saved with a checksum, but its "
                                  f"checksum file {checksum_path(path)} is missing")
        if not has_coords or (self.verify and not checked):
            if not self._unchecked:
                logger.warning("checkpoint %s was saved without %s: loading its files "
                               "unverified (re-save it to add them)", self.base,
                               "checksums or coordinates" if not has_coords else "checksums")
            self._unchecked.append(path)
        return state

    def expected_coords(self, key: tuple) -> dict:
        """The coordinates of file ``key`` ((tp, pp): a model file; (tp, pp, dp): a shard)."""
        return self._coords("model", *key) if len(key) == 2 else \
            self._coords("zero_shard", *key)

    def _path(self, tp_rank: int, pp_rank: int, dp_rank: int | None = None) -> str:
        name = MODEL_FILE if dp_rank is None else zero_shard_name(dp_rank)
        return os.path.join(self.cell_dir(tp_rank, pp_rank), name)

    def _model_file(self, tp_rank: int, pp_rank: int) -> dict:
        if (tp_rank, pp_rank) == (0, 0) and self._first is not None:
            return self._first
        path = self._path(tp_rank, pp_rank)
        state = self._open(path, self._coords("model", tp_rank, pp_rank))
        layout = state.get("layout")
        diffs = [f"{k}: {self.layout.get(k)!r} vs {layout.get(k)!r}" for k in _LAYOUT_KEYS
                 if self.layout.get(k) != layout.get(k)] if isinstance(layout, dict) else \
            ["no layout in the file"]
        if diffs:
            raise CheckpointError(f"layout file {os.path.join(self.base, LAYOUT_FILE)} and "
                                  f"{path} disagree (" + "; ".join(diffs) + ")")
        return state

    def _shard(self, tp_rank: int, pp_rank: int, dp_rank: int) -> dict:
        return self._open(self._path(tp_rank, pp_rank, dp_rank),
                          self._coords("zero_shard", tp_rank, pp_rank, dp_rank))

    def files(self, shards: bool = True) -> list[tuple[str, tuple]]:
        """(path, (tp, pp) or (tp, pp, dp)) of every file this iteration holds: the model
        files and (``shards``) the ZeRO shards, when it has them."""
        shards = shards and (self.stage == 3 or self.stage > 0 and os.path.exists(
            os.path.join(self.cell_dir(0, 0), zero_shard_name(0))))
        out = []
        for p in range(self.pp):
            for t in range(self.tp):
                out.append((self._path(t, p), (t, p)))
                for d in range(self.dp if shards else 0):
                    out.append((self._path(t, p, d), (t, p, d)))
        return out

    def verify_files(self, files: list[tuple[str, tuple]]) -> None:
        """Check ``files`` (from ``files()``) now: coordinates and (with ``verify``)
        checksums, before unpickling where a sidecar allows it. Checked files are not
        checked again when they are read."""
        for path, key in files:
            expected = self.expected_coords(key)
            if self.verify and self._check_sidecar(path, expected):
                continue
            self._open(path, expected)

    def mark_verified(self, paths) -> None:
        """Files checked elsewhere (by other ranks of a load): read without a second pass."""
        if self.verify:
            self._verified.update(paths)

    def verify_all(self) -> list[str]:
        """Check every file of this iteration; returns their paths."""
        files = self.files()
        self.verify_files(files)
        return [path for path, _ in files]

    # ---- metadata --------------------------------------------------------------------------
    def param_names(self) -> list[str]:
        """Every logical parameter once (the tied embedding from the first stage)."""
        names = {}
        for pp_rank in range(self.pp):
            for name in self.model_file(0, pp_rank)["param_meta"]:
                names.setdefault(name, pp_rank)
        return list(names)

    def stage_of(self, name: str) -> int:
        if name not in self._where:
            for pp_rank in range(self.pp):
                if name in self.model_file(0, pp_rank)["param_meta"]:
                    self._where[name] = pp_rank
                    break
            else:
                raise CheckpointError(f"checkpoint {self.base} has no tensor {name!r}")
        return self._where[name]

    def meta(self, name: str, tp_rank: int = 0) -> dict:
        return self.model_file(tp_rank, self.stage_of(name))["param_meta"][name]

    def optimizer_meta(self) -> dict:
        """step, scaler and state names of the saved optimizer (None if not saved)."""
        src = self.model_file(0, 0).get("optimizer") if self.stage == 0 else None
        if self.stage > 0:
            try:
                src = self.shard(0, 0, 0)
            except CheckpointError:
                return None
        if src is None or not src.get("has_optimizer", True):
            return None
        return {"step": src["step"], "scaler": src["scaler"],
                "state_names": src.get("state_names", ["exp_avg", "exp_avg_sq"])}

    def has_optimizer(self) -> bool:
        return self.optimizer_meta() is not None

    def no_optimizer_reason(self) -> str:
        return "" if self.has_optimizer() else "saved with --no-save-optim"

    # ---- values ----------------------------------------------------------------------------
    def _fragments(self, name: str, tp_rank: int, pp_rank: int) -> list[dict]:
        if self.stage == 0:
            opt = self.model_file(tp_rank, pp_rank).get("optimizer")
            return [] if opt is None else opt["fragments"].get(name, [])
        out = []
        for dp_rank in range(self.dp):
            out += self.shard(tp_rank, pp_rank, dp_rank)["fragments"].get(name, [])
        return out

    def _saved_values(self, name, kind, tp_rank, flat_idx: torch.Tensor) -> torch.Tensor:
        """Values at saved-local flat positions ``flat_idx`` of cell (tp_rank, stage of name)."""
        if flat_idx.numel() == 0:
            return torch.zeros(0)
        pp_rank = self.stage_of(name)
        if kind == "model" and self.stage < 3:
            state = self.model_file(tp_rank, pp_rank)
            chunk = self.meta(name, tp_rank).get("chunk", 0)
            key = "model" if "model" in state else f"model{chunk}"
            return state[key][name].reshape(-1)[flat_idx]
        out, filled = None, 0
        for entry in self._fragments(name, tp_rank, pp_rank):
            if kind not in entry:
                continue
            lo, hi = entry["param_start"], entry["param_end"]
            mask = (flat_idx >= lo) & (flat_idx < hi)
            n = int(mask.sum())
            if n == 0:
                continue
            values = entry[kind]
            if out is None:
                out = torch.zeros(flat_idx.numel(), dtype=values.dtype)
            out[mask] = values[flat_idx[mask] - lo]
            filled += n
        if out is None or filled != flat_idx.numel():
            raise CheckpointError(f"checkpoint {self.base}: no saved {kind!r} values for "
                                  f"{filled and 'all of ' or ''}{name} (saved with "
                                  "--no-save-optim, or another optimizer?)")
        return out

    def read_flat(self, name: str, kind: str, shard: ShardInfo, local_shape, start: int = 0,
                  end: int | None = None) -> torch.Tensor:
        """Values of flat positions [start, end) of ``name``'s local tensor in a layout
        described by ``shard`` / ``local_shape`` (padding positions read as zero)."""
        numel = int(np.prod(local_shape, dtype=np.int64))
        end = numel if end is None else end
        meta0 = self.meta(name)
        if tuple(shard.full_shape) != tuple(meta0["full_shape"]):
            raise CheckpointError(f"{name}: checkpoint holds full shape "
                                  f"{list(meta0['full_shape'])}, the current model "
                                  f"{list(shard.full_shape)}")
        saved_tp = self._cell_with_slice(name, shard, local_shape)
        if saved_tp is not None:  # this layout's slice is a saved one: copy it as it is
            return self._saved_rows(name, kind, saved_tp, start, end, 1).view(-1)
        if len(local_shape) <= 2 and meta0.get("dim") in (None, 0, len(local_shape) - 1) \
                and shard.dim in (None, meta0.get("dim")):
            return self._read_rows(name, kind, shard, tuple(local_shape), start, end)
        return self._read_indexed(name, kind, shard, local_shape, start, end)

    def _cell_with_slice(self, name: str, shard: ShardInfo, local_shape) -> int | None:
        """The saved tp rank whose local tensor of ``name`` is exactly the slice asked for
        (same dim, start, length and local shape): a load at the saved layout, where nothing
        needs cutting. None when no saved cell matches."""
        local_shape = [int(s) for s in local_shape]
        want = (shard.dim, shard.start if shard.dim is not None else 0,
                shard.logical_length() if shard.dim is not None else None)
        for t in range(self.tp if self.meta(name).get("dim") is not None else 1):
            meta = self.meta(name, t)
            have = (meta.get("dim"), meta.get("start", 0), meta.get("length"))
            if have == want and list(meta["local_shape"]) == local_shape:
                return t
        return None

    # ---- rows: contiguous copies (the common case: 1-D and 2-D tensors) ------------------
    def _saved_rows(self, name, kind, tp_rank, row0, row1, cols) -> torch.Tensor:
        """Rows [row0, row1) of a saved cell's local tensor seen as [rows, cols]."""
        pp_rank = self.stage_of(name)
        if kind == "model" and self.stage < 3:
            state = self.model_file(tp_rank, pp_rank)
            chunk = self.meta(name, tp_rank).get("chunk", 0)
            key = "model" if "model" in state else f"model{chunk}"
            return state[key][name].reshape(-1, cols)[row0:row1]
        lo, hi = row0 * cols, row1 * cols
        out, filled = None, 0
        for entry in self._fragments(name, tp_rank, pp_rank):
            a, b = max(lo, entry["param_start"]), min(hi, entry["param_end"])
            if a >= b or kind not in entry:
                continue
            values = entry[kind]
            if out is None:
                out = torch.empty(hi - lo, dtype=values.dtype)
            out[a - lo:b - lo] = values[a - entry["param_start"]:b - entry["param_start"]]
            filled += b - a
        if out is None or filled != hi - lo:
            raise CheckpointError(f"checkpoint {self.base}: no saved {kind!r} values for "
                                  f"{name} (saved with --no-save-optim, or another optimizer?)")
        return out.view(row1 - row0, cols)

    def _read_rows(self, name, kind, shard, local_shape, start, end, max_block=1 << 22):
        """Rows path: the target's local tensor is seen as [rows, cols] (1-D: [n, 1]); each
        block of its rows is copied from the overlapping saved rows, never element-wise."""
        lcols = local_shape[1] if len(local_shape) == 2 else 1
        full = tuple(self.meta(name)["full_shape"])
        full_cols = full[1] if len(full) == 2 else 1
        out = None
        r_first, r_last = start // lcols, (end - 1) // lcols + 1
        step = max(1, max_block // max(full_cols, 1))
        for r0 in range(r_first, r_last, step):
            r1 = min(r_last, r0 + step)
            block = self._target_rows(name, kind, shard, r0, r1, lcols)  # [r1 - r0, lcols]
            if out is None:
                out = torch.zeros(end - start, dtype=block.dtype)
            a, b = max(start, r0 * lcols), min(end, r1 * lcols)
            out[a - start:b - start] = block.reshape(-1)[a - r0 * lcols:b - r0 * lcols]
        return out

    def _target_rows(self, name, kind, shard, r0, r1, lcols) -> torch.Tensor:
        """Rows [r0, r1) of the target-local tensor (padding as zero), [r1 - r0, lcols]."""
        full = tuple(self.meta(name)["full_shape"])
        full_rows, full_cols = full[0], (full[1] if len(full) == 2 else 1)
        tdim = shard.dim
        if tdim == 0:  # local row r is logical row start + r, rows past length are padding
            lo, hi = shard.start + r0, shard.start + min(r1, shard.logical_length())
        else:
            lo, hi = r0, r1
        c_lo, c_hi = (shard.start, shard.start + shard.logical_length()) if tdim == 1 \
            else (0, full_cols)
        out, dtype = None, None
        dim = self.meta(name).get("dim")
        for t in ([0] if dim is None else range(self.tp)):
            meta = self.meta(name, t)
            shape = meta["local_shape"]
            cols_t = shape[1] if len(shape) == 2 else 1
            rows = (meta["start"], meta["start"] + meta["length"]) if dim == 0 \
                else (0, full_rows)
            cols = (meta["start"], meta["start"] + meta["length"]) if dim == 1 \
                else (0, full_cols)
            ir0, ir1 = max(lo, rows[0]), min(hi, rows[1])
            ic0, ic1 = max(c_lo, cols[0]), min(c_hi, cols[1])
            if ir0 >= ir1 or ic0 >= ic1:
                continue
            block = self._saved_rows(name, kind, t, ir0 - rows[0], ir1 - rows[0], cols_t)
            if out is None:
                dtype = block.dtype
                out = torch.zeros(r1 - r0, lcols, dtype=dtype)
            out[ir0 - lo:ir1 - lo, ic0 - c_lo:ic1 - c_lo] = \
                block[:, ic0 - cols[0]:ic1 - cols[0]]
        if out is None:  # padding only
            out = torch.zeros(r1 - r0, lcols)
        return out

    def _read_indexed(self, name: str, kind: str, shard: ShardInfo, local_shape, start: int,
                      end: int) -> torch.Tensor:
        """General path: per-element index arithmetic (any rank, any partitioned dim)."""
        positions = np.arange(start, end, dtype=np.int64)
        gidx = torch.from_numpy(_global_flat_index(local_shape, shard, positions))
        valid = gidx >= 0
        meta0 = self.meta(name)
        full_shape = tuple(meta0["full_shape"])
        out = None
        want = gidx[valid]
        dim = meta0.get("dim")
        cells = [0] if dim is None else range(self.tp)
        coords = torch.stack(torch.unravel_index(want, full_shape)) if want.numel() else None
        where = valid.nonzero().flatten()
        for t in cells if want.numel() else []:
            meta = self.meta(name, t)
            if dim is None:
                hit, local = torch.ones_like(want, dtype=torch.bool), want
            else:
                s, length = meta["start"], meta["length"]
                c = coords[dim]
                hit = (c >= s) & (c < s + length)
                if not bool(hit.any()):
                    continue
                lc = coords[:, hit].clone()
                lc[dim] -= s
                local = _ravel(lc, meta["local_shape"])
            values = self._saved_values(name, kind, t, local)
            if out is None:
                out = torch.zeros(end - start, dtype=values.dtype)
            out[where[hit]] = values
        if out is None:  # nothing but padding requested
            out = torch.zeros(end - start, dtype=torch.float32)
        return out

    def full_tensor(self, name: str, kind: str = "main") -> torch.Tensor:
        """The full logical tensor (padding removed)."""
        meta = self.meta(name)
        shard = ShardInfo(tuple(meta["full_shape"]), None, 0, None)
        return self.read_flat(name, kind, shard, tuple(meta["full_shape"])) \
            .view(tuple(meta["full_shape"]))


def _ravel(coords: torch.Tensor, shape) -> torch.Tensor:
    flat = torch.zeros(coords.shape[1], dtype=torch.int64)
    for d, size in enumerate(shape):
        flat = flat * int(size) + coords[d]
    return flat


__all__ = ["CheckpointReader"]
