"""Shared plumbing of megazero's CPU optimizer kernels (extensions ``_adam`` and ``_lamb``).

- ``get_extension(name)``: the compiled module, or None (then the PyTorch reference runs),
  with the ``MEGAZERO_SIMD`` override applied once per loaded module. ``MEGAZERO_SIMD`` names
  the highest SIMD level to use (``scalar``, ``avx2``, ``avx512``, ``avx512_bf16``); a level
  the CPU lacks falls back to the best one below it.
- ``simd_level(name)`` and ``forced_simd(level)``: the path in use, and forcing one (tests).
- dtype codes, the thread count (``torch.get_num_threads()``, passed into every kernel call so
  the extension's OpenMP team never outgrows torch's), fp32 rounding of Python scalars, and
  the buffer checks shared by the Python faces.

OpenMP: the extensions link ``libgomp.so.1``, the soname of the copy torch bundles, so the
dynamic loader maps one runtime for both (whichever is loaded first) and they share one
thread pool; ``python -m megazero.ops`` lists the OpenMP runtimes mapped into the process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor

from megazero.ops._loader import load_extension

logger = logging.getLogger(__name__)

SIMD_LEVELS = ("scalar", "avx2", "avx512", "avx512_bf16")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
NO_DTYPE = -1
FLOAT_DTYPES = tuple(DTYPE_CODES)
CPU_OPTIMIZER_EXTENSIONS = ("adam", "lamb")

_ENV_APPLIED: set[int] = set()


def get_extension(name: str):
    """``megazero.ops._<name>`` or None, with ``MEGAZERO_SIMD`` applied on first sight."""
    ext = load_extension(name)
    if ext is not None and id(ext) not in _ENV_APPLIED:
        _ENV_APPLIED.add(id(ext))
        _apply_env_simd(name, ext)
    return ext


def _apply_env_simd(name: str, ext) -> None:
    want = os.environ.get("MEGAZERO_SIMD", "").strip().lower()
    if not want or want == "auto":
        return
    if want not in SIMD_LEVELS:
        logger.warning("megazero: ignoring MEGAZERO_SIMD=%r (expected one of %s)", want,
                       ", ".join(SIMD_LEVELS))
        return
    supported = ext.supported_simd_levels()
    allowed = [lv for lv in supported if SIMD_LEVELS.index(lv) <= SIMD_LEVELS.index(want)]
    chosen = allowed[-1] if allowed else "scalar"
    if chosen != want:
        logger.warning("megazero: MEGAZERO_SIMD=%s is not supported by this CPU; _%s uses %s",
                       want, name, chosen)
    ext.set_simd_level(chosen)


def simd_level(name: str) -> str | None:
    """The SIMD level extension ``_<name>`` runs, or None when it is not built."""
    ext = get_extension(name)
    return None if ext is None else ext.simd_level()


def supported_simd_levels(name: str = "adam") -> list[str]:
    ext = get_extension(name)
    return [] if ext is None else list(ext.supported_simd_levels())


@contextlib.contextmanager
def forced_simd(level: str, names: tuple[str, ...] = CPU_OPTIMIZER_EXTENSIONS) -> Iterator[None]:
    """Run the named extensions (those built) at ``level``; restore their levels afterwards.

    Raises ValueError when the CPU does not support ``level``.
    """
    exts = [ext for ext in (get_extension(n) for n in names) if ext is not None]
    previous = [ext.simd_level() for ext in exts]
    try:
        for ext in exts:
            ext.set_simd_level(level)
        yield
    finally:
        for ext, lv in zip(exts, previous):
            ext.set_simd_level(lv)


def num_threads() -> int:
    return max(1, torch.get_num_threads())


def f32(x: float) -> float:
    """``x`` rounded to the nearest float32 (what the C++ side's static_cast<float> does)."""
    return struct.unpack("f", struct.pack("f", float(x)))[0]


def dtype_code(t: torch.Tensor | None) -> int:
    return NO_DTYPE if t is None else DTYPE_CODES[t.dtype]


def holds_data(t: torch.Tensor) -> bool:
    """False for a fake tensor (the dry run: shapes without memory), which a kernel taking raw
    addresses cannot read: such calls take the PyTorch reference path."""
    return not isinstance(t, FakeTensor)


def kernel_ready(*tensors: torch.Tensor | None) -> bool:
    """True when every given tensor is a contiguous CPU tensor of a kernel dtype, with data."""
    return all(t is None or (t.device.type == "cpu" and t.is_contiguous()
                             and t.dtype in DTYPE_CODES and holds_data(t)) for t in tensors)


def check_same_numel(name: str, ref: torch.Tensor, *others: torch.Tensor | None) -> None:
    for t in others:
        if t is not None and t.numel() != ref.numel():
            raise ValueError(f"{name}: tensors differ in size ({t.numel()} vs {ref.numel()})")


def check_dtypes(name: str, tensors, allowed: tuple[torch.dtype, ...], what: str) -> None:
    """All ``tensors`` share one dtype out of ``allowed``."""
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise ValueError(f"{name}: {what} have mixed dtypes {sorted(map(str, dtypes))}")
    if dtypes and next(iter(dtypes)) not in allowed:
        raise ValueError(f"{name}: {what} must be one of {[str(d) for d in allowed]}, "
                         f"got {next(iter(dtypes))}")


def normalize_segments(n: int, weight_decay,
                       keep_empty: bool = False) -> list[tuple[int, int, float]]:
    """``weight_decay`` as sorted, non-overlapping (start, end, wd) segments.

    A float means one segment over all ``n`` elements; a sequence of (start, end, wd) is
    checked (sorted, disjoint, within [0, n)) and its empty segments dropped unless
    ``keep_empty``. Elements outside every segment are left untouched by the kernels.
    """
    if isinstance(weight_decay, (int, float)):
        return [(0, n, float(weight_decay))] if n > 0 or keep_empty else []
    segments = []
    prev_end = 0
    for seg in weight_decay:
        start, end, wd = int(seg[0]), int(seg[1]), float(seg[2])
        if start < prev_end or end < start or end > n:
            raise ValueError(f"segment ({start}, {end}) is out of order, overlapping or outside "
                             f"[0, {n}); segments must be sorted and disjoint")
        prev_end = end
        if end > start or keep_empty:
            segments.append((start, end, wd))
    return segments


def per_tensor(name: str, value, n: int) -> list[float]:
    """``value`` (a number, or one per tensor) as a list of n floats."""
    if isinstance(value, (int, float)):
        return [float(value)] * n
    values = [float(v) for v in value]
    if len(values) != n:
        raise ValueError(f"{name}: {len(values)} values for {n} tensors")
    return values
