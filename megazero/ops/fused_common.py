"""Shared plumbing of the fused model ops: extension lookup, dtype codes, SIMD level control.

The CPU kernels live in ``csrc/fused/`` and are built as ``megazero.ops._fused``; the CUDA
kernels (``*.cu`` there) as ``megazero.ops._fused_cuda``, behind the custom ops of
``cuda_fused`` and the ``cuda_*`` modules. Each op's Python face
(``fused_bias_gelu.py``, ``fused_dropout.py``, ``fused_layer_norm.py``, ``fused_softmax.py``,
``fused_rms_norm.py``, ``fused_swiglu.py``, ``fused_rope.py``) calls :func:`cpu_extension` /
:func:`cuda_extension` per call and takes its PyTorch path when it gets ``None`` (extension not
built, or disabled with ``MEGAZERO_DISABLE_OPS=fused``).

Kernels receive raw addresses (``tensor.data_ptr()``) of contiguous tensors (RoPE: strided
rows) plus sizes, and ``torch.get_num_threads()`` as their OpenMP thread count. The SIMD level
follows the optimizer extensions' rules (``megazero.ops._cpu_ext``): the best the CPU
supports, capped by ``MEGAZERO_SIMD``, forcible with :func:`forced_simd_level`.
"""

from __future__ import annotations

import contextlib

import torch

from megazero.ops import _cpu_ext
from megazero.ops._loader import load_extension

CPU_EXTENSION = "fused"
CUDA_EXTENSION = "fused_cuda"

_force_kernels = False  # set by force_kernels(): ignore the ops' size thresholds

# dtype codes shared with csrc/fused/fused_common.h (enum DType)
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def cpu_extension():
    """The compiled CPU module ``megazero.ops._fused``, or None."""
    return _cpu_ext.get_extension(CPU_EXTENSION)


class _ShapeOnly:
    """Stands for the kernel module when the tensors are fake (the dry run: shapes without
    memory). The op's Python side allocates its outputs and saves for backward exactly what
    it does around a real kernel call; only the call, which would read and write raw
    addresses, is skipped. So the dry run of a CPU job keeps what the kernels keep (a
    counter-based dropout keeps no mask, LayerNorm its mean and rstd), not what the PyTorch
    reference formulas would."""

    def __getattr__(self, name):
        return _skip


def _skip(*args, **kwargs) -> None:
    return None


SHAPE_ONLY = _ShapeOnly()


def cpu_extension_for(*tensors):
    """The kernel module for these tensors: ``cpu_extension()`` for real ones, the shape-only
    stand-in for fake ones where the extension is built (a real run on this machine would
    take the kernel), None where it is not (the real run takes the reference path too)."""
    ext = cpu_extension()
    if ext is not None and not all(t is None or _cpu_ext.holds_data(t) for t in tensors):
        return SHAPE_ONLY
    return ext


def ptr(t: torch.Tensor | None) -> int:
    """Raw address of ``t`` for a kernel; 0 for an absent or fake tensor."""
    return 0 if t is None or not _cpu_ext.holds_data(t) else t.data_ptr()


def cuda_extension():
    """The compiled CUDA module ``megazero.ops._fused_cuda``, or None."""
    return load_extension(CUDA_EXTENSION) if torch.cuda.is_available() else None


def worth_a_kernel(numel: int, min_numel: int) -> bool:
    """Whether a CPU kernel call pays off: below ``min_numel`` elements the Python and autograd
    overhead of a custom op (about 20 us) exceeds what the kernel saves over eager PyTorch."""
    return _force_kernels or numel >= min_numel


@contextlib.contextmanager
def force_kernels():
    """Run the CPU kernels whatever the tensor size (tests of tiny shapes)."""
    global _force_kernels
    previous, _force_kernels = _force_kernels, True
    try:
        yield
    finally:
        _force_kernels = previous


def dtype_code(dtype: torch.dtype) -> int | None:
    """Code of a dtype the CPU kernels take (fp32, bf16), else None."""
    return _DTYPE_CODES.get(dtype)


def cpu_kernel_args_ok(*tensors) -> bool:
    """True when every given tensor (None entries skipped) is a CPU fp32/bf16 tensor (fake
    ones included: ``cpu_extension_for`` gives them the shape-only stand-in)."""
    return all(t is None or (t.device.type == "cpu" and t.dtype in _DTYPE_CODES)
               for t in tensors)


def num_threads() -> int:
    return torch.get_num_threads()


def address(t: torch.Tensor | None) -> int:
    """Raw address passed to the kernels; 0 stands for an absent (or fake) tensor."""
    return ptr(t)


def simd_level() -> str | None:
    """SIMD level the CPU kernels use now, or None when the extension is missing."""
    return _cpu_ext.simd_level(CPU_EXTENSION)


def supported_simd_levels() -> list[str]:
    """SIMD levels the CPU kernels can run here, lowest first ([] when not built)."""
    return _cpu_ext.supported_simd_levels(CPU_EXTENSION)


@contextlib.contextmanager
def forced_simd_level(level: str):
    """Run the block with the CPU kernels at ``level`` (``scalar``, ``avx2``, ``avx512``,
    ``avx512_bf16``; ValueError when the CPU lacks it); the previous level is restored."""
    with _cpu_ext.forced_simd(level, (CPU_EXTENSION,)):
        yield


def rows_cols(x: torch.Tensor) -> tuple[int, int]:
    """View of ``x`` as [rows, cols] with cols the last dim."""
    cols = x.shape[-1]
    return (x.numel() // cols if cols else 0), cols
