"""Tensor memory of one rank, measured from the allocations its code makes (real or fake).

``MemoryTracker`` is a ``TorchDispatchMode``: every tensor an op returns is traced to its
storage, counted once while the storage lives (a weak reference tells when it is freed) and
given a category:

* ``params``, ``grads``, ``main_params``, ``optimizer_states``: storages the optimizer holds
  (``tag``, from ``optimizer.state_tensors()``) after the model and optimizer are built;
* ``activations``: storages allocated by a forward pass (outside the autograd engine) and
  still alive, which is what forward passes keep for backward (saved tensors, outputs in
  flight between pipeline stages);
* ``temporaries``: everything else allocated while training (backward, recompute, gathered
  ZeRO-3 parameters, reduction buffers, the step's scratch);
* ``other``: live storages from before training that no category claims (buffers, data).

Bytes are counted per device type, so ``--cpu-offload``'s host states do not mix with the
accelerator's. ``peak()`` is the highest live total of a device with its breakdown at that
moment. The same tracker runs over fake tensors (the dry run: shapes without memory) and real
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
        self.training = False  # set by the dry run once the model and optimizer exist

    # ---- allocation events ---------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out

    def _category_now(self) -> str:
        if not self.training:
            return "other"
        in_backward = torch._C._current_graph_task_id() != -1
        return "temporaries" if in_backward or torch.is_grad_enabled() is False \
            else "activations"

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

    # ---- reports -------------------------------------------------------------------------
    def live_bytes(self, device_type: str, category: str | None = None) -> int:
        if category is None:
            return self.totals.get(device_type, 0)
        return self.current.get(device_type, {}).get(category, 0)

    def peak(self, device_type: str) -> dict:
        """{"peak_bytes": ..., <category>: bytes at that moment} for one device type."""
        breakdown = self.peak_breakdown.get(device_type, {})
        return {"peak_bytes": self.peaks.get(device_type, 0),
                **{c: breakdown.get(c, 0) for c in CATEGORIES}}
