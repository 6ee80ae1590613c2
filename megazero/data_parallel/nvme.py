"""ZeRO-Infinity's optimizer offload to NVMe (``--offload-optimizer nvme --nvme-path DIR``):
ZeRO stages 1-2 whose fp32 main values and Adam moments of this rank's dp partition live in
files instead of host memory.

Layout: the partition's segments (parameter fragments, in partition order) are cut into
sub-groups of about ``--nvme-sub-group-size`` elements; each sub-group's values sit in one file
per kind (``main``, ``exp_avg``, ``exp_avg_sq``) at an offset aligned for O_DIRECT. The files
are scratch (``DIR/megazero-swap-<rank>-<pid>/``), removed when the optimizer is closed or the
process exits; checkpoints are written from them as usual (layout-free fragments), so a kill -9
leaves the last checkpoint intact and never a checkpoint in the swap files.

A step streams the sub-groups through two aligned host slots with the I/O engine
(``megazero.ops.aio``): while sub-group g steps (the same update rule and kernel as
``--cpu-offload``, on the same fp32 values: bit for bit the CPU-offloaded step), g + 1 is read
into the other slot and g - 1's results are still being written. The reduced gradients stay in
the host buffer of ``--cpu-offload``; the updated main values are copied into the model's
parameters per segment. Host memory for optimizer states: two slots, 2 x 3 x the largest
sub-group in fp32, instead of 3 x the partition.

Rules stepping element by element only (Adam, SGD): LAMB's trust ratio needs whole parameters.
"""

from __future__ import annotations

import atexit
import os
import shutil
import weakref
from dataclasses import dataclass

import torch

from megazero.data_parallel.params import find_fragment, no_weight_decay
from megazero.data_parallel.zero import ZeroOptimizer
from megazero.distributed.parallel_state import ParallelState
from megazero.ops.aio import ALIGN, AsyncIO, aligned_empty
from megazero.optim.rules import LambRule, SegmentView


@dataclass
class SubGroup:
    start: int  # partition offset of the first element
    numel: int
    file_offset: int  # bytes, ALIGN-aligned
    io_numel: int  # numel rounded up to whole ALIGN blocks (what moves)
    segments: list  # indices into layout.segments


def plan_subgroups(segments, target: int) -> list[SubGroup]:
    """Consecutive segments (partition order) grouped until ``target`` elements."""
    order = sorted(range(len(segments)), key=lambda i: segments[i].offset)
    groups, current, offset = [], [], 0

    def close():
        nonlocal offset
        first, last = segments[current[0]], segments[current[-1]]
        numel = last.offset + last.numel - first.offset
        io = -(-numel * 4 // ALIGN) * ALIGN // 4
        groups.append(SubGroup(first.offset, numel, offset, io, list(current)))
        offset += io * 4

    for i in order:
        if current and segments[i].offset + segments[i].numel - segments[current[0]].offset \
                > target:
            close()
            current = []
        current.append(i)
    if current:
        close()
    return groups


class NvmeZeroOptimizer(ZeroOptimizer):
    """ZeRO stages 1-2 with the optimizer states on NVMe (see the module docstring)."""

    def __init__(self, model_chunks, opt_config, ps: ParallelState, *, lr_scheduler=None,
                 unit_policy=None):
        if opt_config.zero_stage not in (1, 2):
            raise ValueError(f"--offload-optimizer nvme runs at --zero-stage 1 or 2 (got "
                             f"{opt_config.zero_stage})")
        super().__init__(model_chunks, opt_config, ps, lr_scheduler=lr_scheduler,
                         unit_policy=unit_policy)
        if isinstance(self.rule, LambRule):
            raise ValueError("--offload-optimizer nvme steps sub-groups of parameters one at "
                             "a time; LAMB needs whole parameters: use --optimizer adam")
        root = opt_config.nvme_path
        if not os.path.isdir(root) or not os.access(root, os.W_OK):
            raise ValueError(f"--nvme-path {root}: not a writable directory")
        self.swap_dir = os.path.join(root, f"megazero-swap-{ps.rank}-{os.getpid()}")
        os.makedirs(self.swap_dir, exist_ok=True)
        _remove_at_exit(self, self.swap_dir)
        self.kinds = ("main", *self.rule.state_names)
        self.paths = {k: os.path.join(self.swap_dir, f"{k}.bin") for k in self.kinds}
        self.groups = plan_subgroups(self.layout.segments, opt_config.nvme_sub_group_size)
        slot = max(g.io_numel for g in self.groups)
        self.slots = [{k: aligned_empty(slot) for k in self.kinds} for _ in range(2)]
        self.aio = AsyncIO(num_threads=opt_config.nvme_threads)
        self._swapped = False

    # ---- the states live in files -------------------------------------------------------------
    def _build_main_and_states(self) -> None:
        """The host gradient buffer only; main values (from the parameters) and zero states
        go to the swap files."""
        part = self.layout.partition_numel
        self.main_chunks, self.state = [], {}
        self.grad_host = torch.zeros(part, dtype=torch.float32)
        slot = self.slots[0]
        for g in self.groups:
            for k in self.kinds:
                slot[k][:g.io_numel].zero_()
            for i in g.segments:
                seg = self.layout.segments[i]
                slot["main"][self._local(g, seg)].copy_(self._model_values(seg))
            self._write(g, slot)
            self.aio.wait_all()
        self._swapped = True

    @property
    def views(self):  # the step builds views per sub-group over the slots
        if not self._swapped:
            self._build_main_and_states()
        return []

    def _local(self, g: SubGroup, seg) -> slice:
        return slice(seg.offset - g.start, seg.offset - g.start + seg.numel)

    def _model_values(self, seg) -> torch.Tensor:
        chunk = self.params.owned_chunk(self.layout.buckets[seg.bucket])
        return chunk[seg.chunk_offset:seg.chunk_offset + seg.numel]

    def _read(self, g: SubGroup, slot) -> list[int]:
        return [self.aio.submit_read(slot[k][:g.io_numel], self.paths[k], g.file_offset)
                for k in self.kinds]

    def _write(self, g: SubGroup, slot) -> list[int]:
        return [self.aio.submit_write(slot[k][:g.io_numel], self.paths[k], g.file_offset)
                for k in self.kinds]

    def _segment_views(self, g: SubGroup, slot) -> list[SegmentView]:
        views = []
        for i in g.segments:
            seg = self.layout.segments[i]
            loc = self._local(g, seg)
            wd = self._weight_decay(seg)
            views.append(SegmentView(slot["main"][loc],
                                     self.grad_host[seg.offset:seg.offset + seg.numel], None,
                                     wd, {k: slot[k][loc] for k in self.rule.state_names},
                                     self._keys[seg.name]))
        return views

    def _weight_decay(self, seg) -> float:
        return 0.0 if no_weight_decay(seg.name, seg.param) else self.config.weight_decay

    def _update(self, lr: float, grad_scale: float) -> None:
        """Stream the sub-groups: read g + 1 and write g - 1 while g steps."""
        self.views  # noqa: B018 - the swap files exist from here on
        self._grads_to_host()
        groups, writes = self.groups, [[], []]
        reads = self._read(groups[0], self.slots[0])
        for n, g in enumerate(groups):
            slot = self.slots[n % 2]
            for h in reads:
                self.aio.wait(h)
            if n + 1 < len(groups):
                other = (n + 1) % 2
                for h in writes[other]:  # the slot's previous sub-group is on disk
                    self.aio.wait(h)
                reads = self._read(groups[n + 1], self.slots[other])
            views = self._segment_views(g, slot)
            self.rule.apply(views, step=self.step_count, lr=lr, grad_scale=grad_scale,
                            params=self.param_table)
            for i, v in zip(g.segments, views):
                self._model_values(self.layout.segments[i]).copy_(v.main)
            writes[n % 2] = self._write(g, slot)
        self.aio.wait_all()

    # ---- checkpoints and reports ---------------------------------------------------------
    def _each_segment(self, fn, write_back: bool) -> None:
        """``fn(seg, {kind: [numel] view})`` for every segment, sub-group by sub-group."""
        self.views  # noqa: B018
        slot = self.slots[0]
        for g in self.groups:
            for h in self._read(g, slot):
                self.aio.wait(h)
            for i in g.segments:
                seg = self.layout.segments[i]
                loc = self._local(g, seg)
                fn(seg, {k: slot[k][loc] for k in self.kinds})
            if write_back:
                self._write(g, slot)
                self.aio.wait_all()

    def sharded_state_dict(self) -> dict:
        fragments = {}

        def take(seg, values):
            entry = {"param_start": seg.param_start, "param_end": seg.param_end,
                     "main": values["main"].clone()}
            for k in self.rule.state_names:
                entry[k] = values[k].clone()
            fragments.setdefault(seg.name, []).append(entry)

        self._each_segment(take, write_back=False)
        return {"zero_stage": self.stage, "step": self.step_count,
                "scaler": self.scaler.state_dict(), "fragments": fragments,
                "state_names": list(self.rule.state_names)}

    def load_sharded_state_dict(self, state: dict, fragment_reader=None) -> None:
        self.step_count = int(state["step"])
        self.scaler.load_state_dict(state["scaler"])
        frags = state.get("fragments", {})
        self.param_gather.wait_all()

        def put(seg, values):
            saved = fragment_reader(seg.name, seg.param_start, seg.param_end) \
                if fragment_reader is not None else find_fragment(frags, seg)
            for k in self.kinds:
                values[k].copy_(saved[k])
            self._model_values(seg).copy_(values["main"])

        self._each_segment(put, write_back=True)
        if self.shard:
            self._all_gather_params()

    def reload_model_params(self) -> None:
        if not self._swapped:
            return
        self._each_segment(lambda seg, values: values["main"].copy_(self._model_values(seg)),
                           write_back=True)

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


def _remove_at_exit(owner, path: str) -> None:
    """Remove the swap directory when ``owner`` is collected or the process exits."""
    weakref.finalize(owner, shutil.rmtree, path, True)
    atexit.register(shutil.rmtree, path, True)


__all__ = ["NvmeZeroOptimizer", "SubGroup", "plan_subgroups"]
