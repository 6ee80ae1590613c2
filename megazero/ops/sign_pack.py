"""1-bit sign codec: fp32 signs packed 8 to a byte, and back to +-scale (CPU kernel with a
PyTorch reference). The building block of the compressed all-reduce of 1-bit Adam
(``megazero.distributed.compressed``).

Convention (kernel and reference alike, bit for bit):

- ``pack_signs(x)``: x [n] -> uint8 [ceil(n / 8)]; element i is bit ``i % 8`` of byte
  ``i // 8`` (little-endian bit order within the byte, as ``numpy.packbits(...,
  bitorder="little")``), set when ``x[i] >= 0``. So sign(+0) = sign(-0) = +1, as DeepSpeed's
  1-bit compression has it, and NaN packs as -1. Bits of the last byte past n are 0.
- ``unpack_signs(packed, n, scale)``: -> fp32 [n], ``+scale`` where the bit is set and
  ``-scale`` where it is clear. ``scale`` is one number (or a one-element tensor) or a tensor
  of k per-chunk scales, k dividing n: element i takes ``scale[i // (n // k)]``. Scales are
  rounded to fp32 first; the output holds exactly +-those values.

The kernel (``csrc/sign_pack``, built as ``megazero.ops._sign_pack``) runs for contiguous
fp32 CPU tensors holding data; its SIMD level (scalar, AVX2, AVX-512) is picked at run time
and every level gives the same bits. Elsewhere (other dtypes or devices, fake tensors of the
dry run, extension missing or disabled with ``MEGAZERO_DISABLE_OPS=sign_pack``) the PyTorch
reference runs, on any device.
"""

from __future__ import annotations

import contextlib

import torch

from megazero.ops import _cpu_ext
from megazero.ops.registry import register_op

EXTENSION = "sign_pack"


def extension():
    """The compiled module ``megazero.ops._sign_pack``, or None."""
    return _cpu_ext.get_extension(EXTENSION)


def simd_level() -> str | None:
    """SIMD level the kernel runs now, or None when the extension is missing."""
    return _cpu_ext.simd_level(EXTENSION)


def supported_simd_levels() -> list[str]:
    """SIMD levels the kernel can run here, lowest first ([] when not built)."""
    return _cpu_ext.supported_simd_levels(EXTENSION)


@contextlib.contextmanager
def forced_simd_level(level: str):
    """Run the block with the kernel at ``level`` (ValueError when the CPU lacks it)."""
    with _cpu_ext.forced_simd(level, (EXTENSION,)):
        yield


def packed_size(n: int) -> int:
    """Bytes holding the signs of n elements."""
    return (n + 7) // 8


def _shifts(device) -> torch.Tensor:
    return torch.arange(8, dtype=torch.uint8, device=device)


def _scales(scale, n: int, device) -> tuple[torch.Tensor, int]:
    """``scale`` as an fp32 tensor [k] on ``device`` and the chunk length n // k."""
    s = torch.as_tensor(scale, dtype=torch.float32).reshape(-1).to(device)
    k = s.numel()
    if k == 0 or (n % k if n else False):
        raise ValueError(f"unpack_signs: {k} scales do not cut {n} elements into equal chunks")
    return s.contiguous(), max(1, n // k)


def _check_out(out: torch.Tensor | None, numel: int, dtype: torch.dtype, what: str):
    if out is not None and (out.numel() != numel or out.dtype != dtype
                            or not out.is_contiguous()):
        raise ValueError(f"{what}: out must be a contiguous {dtype} tensor of {numel} elements, "
                         f"got {out.dtype} {tuple(out.shape)}")


def _copy_into(out: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    out.view(-1).copy_(values)
    return out


def pack_signs_reference(x: torch.Tensor) -> torch.Tensor:
    """uint8 [ceil(n / 8)]: bit i % 8 of byte i // 8 set when x[i] >= 0 (eager PyTorch)."""
    flat = x.reshape(-1)
    n, m = flat.numel(), packed_size(flat.numel())
    bits = torch.zeros(8 * m, dtype=torch.uint8, device=x.device)
    bits[:n] = flat >= 0
    return (bits.view(m, 8) << _shifts(x.device)).sum(dim=1, dtype=torch.uint8)


def unpack_signs_reference(packed: torch.Tensor, n: int, scale) -> torch.Tensor:
    """fp32 [n]: +-scale (per chunk) by the bits of ``packed`` (eager PyTorch)."""
    s, chunk = _scales(scale, n, packed.device)
    if n == 0:
        return torch.empty(0, dtype=torch.float32, device=packed.device)
    bits = ((packed.reshape(-1, 1) >> _shifts(packed.device)) & 1).reshape(-1)[:n].bool()
    s = s.repeat_interleave(chunk) if s.numel() > 1 else s
    return torch.where(bits, s, -s)


def _kernel_ok(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.is_contiguous() and _cpu_ext.holds_data(t)
               for t in tensors)


def pack_signs(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The signs of x (any shape, read flat; n elements) as uint8 [ceil(n / 8)], 1 = x >= 0.

    ``out``: a contiguous uint8 tensor of ceil(n / 8) elements to write (returned)."""
    m = packed_size(x.numel())
    _check_out(out, m, torch.uint8, "pack_signs")
    ext = extension() if x.dtype == torch.float32 and _kernel_ok(x) and \
        (out is None or _kernel_ok(out)) else None
    if ext is None:
        ref = pack_signs_reference(x)
        return ref if out is None else _copy_into(out, ref)
    if out is None:
        out = torch.empty(m, dtype=torch.uint8)
    if x.numel():
        ext.pack_signs(x.data_ptr(), out.data_ptr(), x.numel(), _cpu_ext.num_threads())
    return out


def unpack_signs(packed: torch.Tensor, n: int, scale,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [n]: ``+scale`` where bit i of ``packed`` (uint8, at least ceil(n / 8) bytes) is
    set, ``-scale`` elsewhere. ``scale``: a number, or a tensor of k per-chunk scales (k
    divides n; element i takes scale[i // (n // k)]). ``out``: a contiguous fp32 tensor of n
    elements to write (returned)."""
    if packed.dtype != torch.uint8 or packed.numel() < packed_size(n):
        raise ValueError(f"unpack_signs: need uint8 packed signs of at least "
                         f"{packed_size(n)} bytes for {n} elements, got {packed.dtype} "
                         f"[{packed.numel()}]")
    _check_out(out, n, torch.float32, "unpack_signs")
    ext = extension() if _kernel_ok(packed) and (out is None or _kernel_ok(out)) else None
    if ext is None:
        ref = unpack_signs_reference(packed.reshape(-1)[:packed_size(n)], n, scale)
        return ref if out is None else _copy_into(out, ref)
    scales, chunk = _scales(scale, n, packed.device)
    if out is None:
        out = torch.empty(n, dtype=torch.float32)
    if n:
        ext.unpack_signs(packed.data_ptr(), out.data_ptr(), n, scales.data_ptr(), chunk,
                         _cpu_ext.num_threads())
    return out


register_op("sign_pack", EXTENSION, "1-bit sign pack/unpack with per-chunk scales, the "
            "compressed all-reduce's codec (CPU)", simd_level_fn=simd_level)
