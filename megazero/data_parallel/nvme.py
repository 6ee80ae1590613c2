"""ZeRO-Infinity's optimizer offload to NVMe (``--offload-optimizer nvme --nvme-path DIR``):
ZeRO stages 1-3 whose fp32 main values and Adam moments of this rank's dp partition live in
files instead of host memory (stage 3 through ``nvme_params.NvmeZero3Optimizer``).

Layout: the partition's segments (parameter fragments, in partition order) are cut into
sub-groups of at most ``--nvme-sub-group-size`` elements (a segment crossing a sub-group's
end continues in the next: the rules streamed here are element-wise); each sub-group's values
sit in one file per kind (``main``, ``exp_avg``, ``exp_avg_sq``) at an offset aligned for
O_DIRECT. The files are scratch (``DIR/megazero-swap-<host>-<rank>-<pid>-<random>/``),
removed when the optimizer is collected or the process exits, and by the next run on this
host after a kill; checkpoints are written from them as usual (layout-free fragments), so a
kill -9 leaves the last checkpoint intact and never a checkpoint in the swap files.

A step streams the sub-groups through ``--nvme-buffer-count`` k aligned host slots (2;
DeepSpeed's offload_optimizer.buffer_count) with the I/O engine (``megazero.ops.aio``, moving
``--nvme-block-size`` pieces): while sub-group g steps (the same update rule and kernel as
``--cpu-offload``, on the same fp32 values: bit for bit the CPU-offloaded step), g + 1 .. g +
k - 1 are read into the other slots and g - 1's results are still being written. The reduced
gradients stay in the host buffer of ``--cpu-offload``; the updated main values are written
into the model's parameter storage piece by piece. Host memory for optimizer states: k slots,
k x 3 x the sub-group size in fp32, instead of 3 x the partition.

Rules stepping element by element only (Adam, SGD): LAMB's trust ratio needs whole parameters.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import socket
import tempfile
import weakref
from dataclasses import dataclass

import torch

from megazero.data_parallel.params import find_fragment, no_weight_decay
from megazero.data_parallel.zero import ZeroOptimizer
from megazero.distributed.parallel_state import ParallelState
from megazero.ops.aio import ALIGN, AsyncIO, aligned_empty
from megazero.optim.rules import LambRule, SegmentView

logger = logging.getLogger(__name__)


@dataclass
class SubGroup:
    start: int  # partition offset of the first element
    numel: int
    file_offset: int  # bytes, ALIGN-aligned
    io_numel: int  # numel rounded up to whole ALIGN blocks (what moves)
    pieces: list  # (segment index, lo, hi): elements [lo, hi) of layout.segments[index]


def plan_subgroups(segments, target: int) -> list[SubGroup]:
    """The partition's segments (in partition order) cut into sub-groups spanning at most
    ``target`` elements; a segment that crosses a sub-group's end continues in the next one
    (the update rules streamed here are element-wise), so no slot is larger than ``target``."""
    if target < 1:
        raise ValueError(f"--nvme-sub-group-size must be >= 1 (got {target})")
    order = sorted(range(len(segments)), key=lambda i: segments[i].offset)
    groups, pieces, offset, start = [], [], 0, None

    def close():
        nonlocal offset, pieces, start
        i, _, hi = pieces[-1]
        numel = segments[i].offset + hi - start
        io = -(-numel * 4 // ALIGN) * ALIGN // 4
        groups.append(SubGroup(start, numel, offset, io, pieces))
        offset += io * 4
        pieces, start = [], None

    for i in order:
        seg, lo = segments[i], 0
        while lo < seg.numel:
            if start is not None and seg.offset + lo - start >= target:
                close()
            if start is None:
                start = seg.offset + lo
            hi = min(seg.numel, start + target - seg.offset)
            pieces.append((i, lo, hi))
            lo = hi
    if pieces:
        close()
    return groups


def swap_directory(root: str, kind: str, rank: int) -> str:
    """A fresh scratch directory ``root/megazero-<kind>-<host>-<rank>-<pid>-<random>`` for
    swap files (one per optimizer or storage: a collected one removes its own only). Swap
    directories that processes of this host left when they were killed (their pid is gone)
    are removed first: they hold nothing a checkpoint needs. ``root`` is created when missing
    (as DeepSpeed creates its swap folder)."""
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--nvme-path {root}: not a writable directory ({exc})") from exc
    if not os.access(root, os.W_OK):
        raise ValueError(f"--nvme-path {root}: not a writable directory")
    host = socket.gethostname().replace("-", "_")
    for name in os.listdir(root):
        m = _SWAP_NAME.fullmatch(name)
        if m and m["host"] == host and not _alive(int(m["pid"])):
            logger.info("removing %s: swap files of a process that is gone",
                        os.path.join(root, name))
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"megazero-{kind}-{host}-{rank}-{os.getpid()}-", dir=root)


_SWAP_NAME = re.compile(r"megazero-(swap|params)-(?P<host>[^-]+)-\d+-(?P<pid>\d+)-\w+")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_at_exit(owner, path: str) -> None:
    """Remove the swap directory when ``owner`` is collected or the process exits."""
    weakref.finalize(owner, shutil.rmtree, path, True)
    atexit.register(shutil.rmtree, path, True)


class NvmeZeroOptimizer(ZeroOptimizer):
    """ZeRO stages 1-3 with the optimizer states on NVMe (see the module docstring); at
    stage 3 through ``NvmeZero3Optimizer``, which passes its layout and storage on."""

    def __init__(self, model_chunks, opt_config, ps: ParallelState, *, lr_scheduler=None,
                 unit_policy=None, **zero3_parts):
        if opt_config.zero_stage not in (1, 2, 3):
            raise ValueError(f"--offload-optimizer nvme runs at --zero-stage 1-3 (got "
                             f"{opt_config.zero_stage})")
        super().__init__(model_chunks, opt_config, ps, lr_scheduler=lr_scheduler,
                         unit_policy=unit_policy, **zero3_parts)
        if isinstance(self.rule, LambRule):
            raise ValueError("--offload-optimizer nvme steps sub-groups of parameters one at "
                             "a time; LAMB needs whole parameters: use --optimizer adam")
        self.swap_dir = swap_directory(opt_config.nvme_path, "swap", ps.rank)
        remove_at_exit(self, self.swap_dir)
        self.kinds = ("main", *self.rule.state_names)
        self.paths = {k: os.path.join(self.swap_dir, f"{k}.bin") for k in self.kinds}
        self.groups = plan_subgroups(self.layout.segments, opt_config.nvme_sub_group_size)
        slot = max(g.io_numel for g in self.groups)
        self.slots = [{k: aligned_empty(slot) for k in self.kinds}
                      for _ in range(opt_config.nvme_buffer_count)]
        self.aio = AsyncIO(num_threads=opt_config.nvme_threads,
                           block_size=opt_config.nvme_block_size)
        self._swapped = False

    # ---- the states live in files -------------------------------------------------------------
    def _build_main_and_states(self) -> None:
        """The host gradient buffer only; main values (from the parameters) and zero states
        go to the swap files."""
        part = self.layout.partition_numel
        self.main_chunks, self.state = [], {}
        self.grad_host = torch.zeros(part, dtype=torch.float32)
        slot = self.slots[0]
        model_values = self._model_reader()
        for g in self.groups:
            for k in self.kinds:
                slot[k][:g.io_numel].zero_()
            for i, lo, hi in g.pieces:
                seg = self.layout.segments[i]
                slot["main"][self._local(g, seg, lo, hi)].copy_(model_values(seg)[lo:hi])
            self._write(g, slot)
            self.aio.wait_all()
        self._swapped = True

    @property
    def views(self):  # the step builds views per sub-group over the slots
        if not self._swapped:
            self._build_main_and_states()
        return []

    def _local(self, g: SubGroup, seg, lo: int, hi: int) -> slice:
        """Where elements [lo, hi) of ``seg`` sit in ``g``'s slot."""
        return slice(seg.offset + lo - g.start, seg.offset + hi - g.start)

    def _model_reader(self):
        """``values(seg)``: the model's values of ``seg`` (a view of the bucket's owned chunk,
        fetched once per bucket: a chunk of ``--offload-param nvme`` is read from its file)."""
        cached = [None, None]

        def values(seg) -> torch.Tensor:
            if cached[0] != seg.bucket:
                cached[:] = seg.bucket, self.params.owned_chunk(self.layout.buckets[seg.bucket])
            return cached[1][seg.chunk_offset:seg.chunk_offset + seg.numel]
        return values

    def _read(self, g: SubGroup, slot) -> list[int]:
        return [self.aio.submit_read(slot[k][:g.io_numel], self.paths[k], g.file_offset)
                for k in self.kinds]

    def _write(self, g: SubGroup, slot) -> list[int]:
        return [self.aio.submit_write(slot[k][:g.io_numel], self.paths[k], g.file_offset)
                for k in self.kinds]

    def _segment_views(self, g: SubGroup, slot) -> list[SegmentView]:
        """One view per piece of ``g`` (a whole segment, or the part of it in ``g``)."""
        views = []
        for i, lo, hi in g.pieces:
            seg = self.layout.segments[i]
            loc = self._local(g, seg, lo, hi)
            wd = self._weight_decay(seg)
            views.append(SegmentView(slot["main"][loc],
                                     self.grad_host[seg.offset + lo:seg.offset + hi], None,
                                     wd, {k: slot[k][loc] for k in self.rule.state_names},
                                     self._keys[seg.name]))
        return views

    def _weight_decay(self, seg) -> float:
        return 0.0 if no_weight_decay(seg.name, seg.param) else self.config.weight_decay

    def _update(self, lr: float, grad_scale: float) -> None:
        """Stream the sub-groups through k slots: while g steps, g + 1 .. g + k - 1 are read
        (or waiting for their slot's previous sub-group to reach the disk) and g - 1 is being
        written."""
        self.views  # noqa: B018 - the swap files exist from here on
        self._grads_to_host()
        groups, k = self.groups, len(self.slots)
        writes, reads = [[] for _ in range(k)], {}

        def start_read(m: int) -> None:
            for h in writes[m % k]:  # the slot's previous sub-group is on disk
                self.aio.wait(h)
            reads[m] = self._read(groups[m], self.slots[m % k])

        for m in range(min(k - 1, len(groups))):
            start_read(m)
        for n, g in enumerate(groups):
            slot = self.slots[n % k]
            for h in reads.pop(n):
                self.aio.wait(h)
            if n + k - 1 < len(groups):
                start_read(n + k - 1)
            views = self._segment_views(g, slot)
            self.rule.apply(views, step=self.step_count, lr=lr, grad_scale=grad_scale,
                            params=self.param_table)
            for (i, lo, _), v in zip(g.pieces, views):
                self._write_model(self.layout.segments[i], lo, v.main)
            writes[n % k] = self._write(g, slot)
        self.params.flush()
        self.aio.wait_all()

    def _write_model(self, seg, lo: int, values: torch.Tensor) -> None:
        """The model's parameter storage, elements [lo, lo + numel) of ``seg`` = values."""
        self.params.write(self.layout.buckets[seg.bucket], seg.chunk_offset + lo, values)

    # ---- checkpoints and reports ---------------------------------------------------------
    def _each_piece(self, fn, write_back: bool) -> None:
        """``fn(seg, lo, hi, {kind: [hi - lo] view})`` for every piece of every segment,
        sub-group by sub-group (a segment's pieces in order, lo = 0 first)."""
        self.views  # noqa: B018
        slot = self.slots[0]
        for g in self.groups:
            for h in self._read(g, slot):
                self.aio.wait(h)
            for i, lo, hi in g.pieces:
                seg = self.layout.segments[i]
                loc = self._local(g, seg, lo, hi)
                fn(seg, lo, hi, {k: slot[k][loc] for k in self.kinds})
            if write_back:
                self._write(g, slot)
                self.aio.wait_all()

    def sharded_state_dict(self) -> dict:
        fragments, whole = {}, {}

        def take(seg, lo, hi, values):  # a segment's pieces assembled into one fragment
            if lo == 0:
                whole[seg.name, seg.param_start] = {k: torch.empty(seg.numel) for k in values}
            parts = whole[seg.name, seg.param_start]
            for k, v in values.items():
                parts[k][lo:hi].copy_(v)
            if hi == seg.numel:
                del whole[seg.name, seg.param_start]
                fragments.setdefault(seg.name, []).append(
                    {"param_start": seg.param_start, "param_end": seg.param_end, **parts})

        self._each_piece(take, write_back=False)
        return {"zero_stage": self.stage, "step": self.step_count,
                "scaler": self.scaler.state_dict(), "fragments": fragments,
                "state_names": list(self.rule.state_names)}

    def load_sharded_state_dict(self, state: dict, fragment_reader=None) -> None:
        self.step_count = int(state["step"])
        self.scaler.load_state_dict(state["scaler"])
        frags = state.get("fragments", {})
        self.param_gather.wait_all()

        saved = {}

        def put(seg, lo, hi, values):  # read each segment once, at its first piece
            key = seg.name, seg.param_start
            if lo == 0:
                saved[key] = fragment_reader(seg.name, seg.param_start, seg.param_end) \
                    if fragment_reader is not None else find_fragment(frags, seg)
            for k in self.kinds:
                values[k].copy_(saved[key][k][lo:hi])
            self._write_model(seg, lo, values["main"])
            if hi == seg.numel:
                del saved[key]

        self._each_piece(put, write_back=True)
        self.params.flush()
        if self.shard:
            self._all_gather_params()

    def reload_model_params(self) -> None:
        if not self._swapped:
            return
        model_values = self._model_reader()
        self._each_piece(lambda seg, lo, hi, values: values["main"].copy_(
            model_values(seg)[lo:hi]), write_back=True)

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"params": self.params.tensors(), "grads": [*self.grads.tensors(),
                                                           self.grad_host],
                "main_params": [], "optimizer_states": [],
                "swap_buffers": [t for s in self.slots for t in s.values()]}

    def memory_report(self) -> dict:
        report = super().memory_report()
        slots = sum(t.numel() * t.element_size() for s in self.slots for t in s.values())
        on_disk = sum(g.io_numel * 4 for g in self.groups) * len(self.kinds)
        report.update(host_main_params=0, host_optimizer_states=0, host_swap_buffers=slots,
                      nvme_bytes=on_disk)
        return report

    def close(self) -> None:
        self.aio.close()
        shutil.rmtree(self.swap_dir, ignore_errors=True)


__all__ = ["NvmeZeroOptimizer", "SubGroup", "plan_subgroups"]
