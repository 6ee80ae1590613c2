"""Tensor memory of one rank, measured from the allocations its code makes (real or fake).

``MemoryTracker`` is a ``TorchDispatchMode``: every tensor an op returns is traced to its
storage, counted once while the storage lives (a weak reference tells when it is freed) and
given a category:

* ``params``, ``grads``, ``main_params``, ``optimizer_states``: storages the optimizer holds
  (``tag``, from ``optimizer.state_tensors()``) after the model and optimizer are built;
* ``activations``: storages allocated inside a forward step (``forward_step`` wraps the
  user's forward step and loss function; recompute inside backward does not count) and
  still alive: what forward passes keep for backward (saved tensors, outputs in flight
  between pipeline stages);
* ``temporaries``: everything else allocated while training (backward, recompute, gathered
  ZeRO-3 parameters, reduction buffers, the step's scratch);
* ``other``: live storages from before training that no category claims (buffers, data).

Bytes are counted per device type, so ``--cpu-offload``'s host states do not mix with the
accelerator's. ``peak()`` is the highest live total of a device with its breakdown at that
moment, plus each category's own highest live total (``max_<category>``: for activations,
what the forward passes in flight keep at most, whichever op the total peaked at). Scratch
a collective's backend returns is not counted (gloo's, which NCCL does not have). The same
tracker runs over fake tensors (the dry run: shapes without memory) and real
ones (a gloo run), which is how the dry run's figures are checked against a real run.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megazero.distributed.device import is_fake

STATE_CATEGORIES = ("params", "grads", "main_params", "optimizer_states")
CATEGORIES = STATE_CATEGORIES + ("activations", "temporaries", "other")


class MemoryTracker(TorchDispatchMode):
    """Live and peak bytes of tensor storages per device type and category."""

    def __init__(self):
        super().__init__()
        self._lock = threading.Lock()
        self._live: dict[int, tuple] = {}  # storage key -> (weakref, nbytes, device, category)
        self.current: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.totals: dict[str, int] = defaultdict(int)  # device -> live bytes
        self.peaks: dict[str, int] = defaultdict(int)
        self.peak_breakdown: dict[str, dict[str, int]] = {}
        self.category_peaks: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.training = False  # set by the dry run once the model and optimizer exist
        self._forward_depth = 0

    # ---- allocation events ---------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "c10d" or func.is_view:
            # A view allocates nothing (its storage was counted when it was made, or is not
            # ours: gloo splits a scratch copy of a reduce-scatter's input, which NCCL does
            # not make); a collective writes into the caller's buffers.
            return out
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out

    def _category_now(self) -> str:
        if not self.training:
            return "other"
        in_backward = torch._C._current_graph_task_id() != -1
        return "activations" if self._forward_depth > 0 and not in_backward \
            else "temporaries"

    def forward_step(self, forward_step_func):
        """``forward_step_func`` (and the loss function it returns) with their allocations
        counted as activations."""
        def counted(fn):
            def run(*args, **kwargs):
                self._forward_depth += 1
                try:
                    return fn(*args, **kwargs)
                finally:
                    self._forward_depth -= 1
            return run

        def step(data_iterator, model):
            output, loss_func = counted(forward_step_func)(data_iterator, model)
            return output, counted(loss_func)
        return step

    def track(self, t: torch.Tensor, category: str | None = None) -> None:
        """Count ``t``'s storage (once) from now until it is freed."""
        if t.device.type == "meta" and not is_fake(t):
            return
        st = t.untyped_storage()
        key = st._cdata
        with self._lock:
            if key in self._live:
                return
            n, dev = st.nbytes(), t.device.type
            cat = category or self._category_now()
            ref = weakref.ref(st, lambda _, k=key: self._free(k))
            self._live[key] = (ref, n, dev, cat)
            self.current[dev][cat] += n
            self.category_peaks[dev][cat] = max(self.category_peaks[dev][cat],
                                                self.current[dev][cat])
            self.totals[dev] += n
            if self.totals[dev] > self.peaks[dev]:
                self.peaks[dev] = self.totals[dev]
                self.peak_breakdown[dev] = dict(self.current[dev])

    def _free(self, key: int) -> None:
        with self._lock:
            entry = self._live.pop(key, None)
            if entry is not None:
                _, n, dev, cat = entry
                self.current[dev][cat] -= n
                self.totals[dev] -= n

    # ---- categories ----------------------------------------------------------------------
    def tag(self, tensors_by_category: dict) -> None:
        """Give the storages of these tensors their model-state category (tracking them if
        they were allocated before the tracker started)."""
        for category, tensors in tensors_by_category.items():
            for t in tensors:
                if t is None or t.numel() == 0:
                    continue
                self.track(t, category)
                key = t.untyped_storage()._cdata
                with self._lock:
                    ref, n, dev, old = self._live[key]
                    if old != category and old not in STATE_CATEGORIES:
                        self._live[key] = (ref, n, dev, category)
                        self.current[dev][old] -= n
                        self.current[dev][category] += n

    def reset_peak(self) -> None:
        with self._lock:
            for dev, total in self.totals.items():
                self.peaks[dev] = total
                self.peak_breakdown[dev] = dict(self.current[dev])
                self.category_peaks[dev] = defaultdict(int, self.current[dev])

    # ---- reports -------------------------------------------------------------------------
    def live_bytes(self, device_type: str, category: str | None = None) -> int:
        if category is None:
            return self.totals.get(device_type, 0)
        return self.current.get(device_type, {}).get(category, 0)

    def peak(self, device_type: str) -> dict:
        """{"peak_bytes": ..., <category>: bytes at that moment} for one device type."""
        breakdown = self.peak_breakdown.get(device_type, {})
        maxima = self.category_peaks.get(device_type, {})
        return {"peak_bytes": self.peaks.get(device_type, 0),
                **{c: breakdown.get(c, 0) for c in CATEGORIES},
                **{f"max_{c}": maxima.get(c, 0) for c in CATEGORIES}}
