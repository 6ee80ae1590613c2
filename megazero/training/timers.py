"""Named wall-clock timers (Megatron's ``timers('forward-backward').start()``), per process.

Only elapsed time is measured; the caller decides which rank reports. With
``synchronize=True`` (``--log-timers``) the timers wait for the device at start and stop so
the numbers include queued kernels; otherwise they never synchronise (the loop's own
host reads already bound each iteration), so timing nobody asked for costs nothing.
"""

from __future__ import annotations

import time

import torch

from megazero.distributed.device import synchronize


class _Timer:
    def __init__(self, name: str, device: torch.device | None = None):
        self.name = name
        self.device = device  # synchronised at start and stop; None: never
        self.elapsed_ = 0.0
        self.count = 0
        self._start = None

    def start(self):
        if self._start is not None:
            raise RuntimeError(f"timer {self.name} already started")
        if self.device is not None:
            synchronize(self.device)
        self._start = time.perf_counter()

    def stop(self):
        if self._start is None:
            raise RuntimeError(f"timer {self.name} is not started")
        if self.device is not None:
            synchronize(self.device)
        self.elapsed_ += time.perf_counter() - self._start
        self.count += 1
        self._start = None

    def elapsed(self, reset: bool = True) -> float:
        value = self.elapsed_
        if reset:
            self.elapsed_, self.count = 0.0, 0
        return value


class Timers:
    """Timers by name; ``synchronize``: wait for ``device`` around each measurement."""

    def __init__(self, device: torch.device | None = None, synchronize: bool = False):
        self._timers: dict[str, _Timer] = {}
        self._device = torch.device(device or "cpu") if synchronize else None

    def __call__(self, name: str) -> _Timer:
        if name not in self._timers:
            self._timers[name] = _Timer(name, self._device)
        return self._timers[name]

    def log_string(self, names=None, normalizer: float = 1.0, reset: bool = True) -> str:
        names = names or list(self._timers)
        parts = [f"{n}: {self._timers[n].elapsed(reset) * 1000.0 / normalizer:.2f}"
                 for n in names if n in self._timers]
        return "time (ms) | " + " | ".join(parts) if parts else ""
