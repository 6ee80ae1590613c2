"""Named wall-clock timers (Megatron's ``timers('forward-backward').start()``), per process.

Only elapsed time is measured; the caller decides which rank reports. On CUDA the timers
synchronise the device so the numbers include queued kernels.
"""

from __future__ import annotations

import time

import torch


class _Timer:
    def __init__(self, name: str):
        self.name = name
        self.elapsed_ = 0.0
        self.count = 0
        self._start = None

    def start(self):
        if self._start is not None:
            raise RuntimeError(f"timer {self.name} already started")
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        self._start = time.perf_counter()

    def stop(self):
        if self._start is None:
            raise RuntimeError(f"timer {self.name} is not started")
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        self.elapsed_ += time.perf_counter() - self._start
        self.count += 1
        self._start = None

    def elapsed(self, reset: bool = True) -> float:
        value = self.elapsed_
        if reset:
            self.elapsed_, self.count = 0.0, 0
        return value


class Timers:
    def __init__(self):
        self._timers: dict[str, _Timer] = {}

    def __call__(self, name: str) -> _Timer:
        if name not in self._timers:
            self._timers[name] = _Timer(name)
        return self._timers[name]

    def log_string(self, names=None, normalizer: float = 1.0, reset: bool = True) -> str:
        names = names or list(self._timers)
        parts = [f"{n}: {self._timers[n].elapsed(reset) * 1000.0 / normalizer:.2f}"
                 for n in names if n in self._timers]
        return "time (ms) | " + " | ".join(parts) if parts else ""
