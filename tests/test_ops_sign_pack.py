"""The 1-bit sign codec (megazero.ops._sign_pack) against its PyTorch reference, bit for bit,
at every SIMD level this CPU supports (each forced in turn), and the reference path taken when
the extension is disabled.

Sizes include 0, 1, sizes that are not a multiple of 8 or of any SIMD width, and buffers
large enough for two OpenMP threads; inputs hold +0, -0, NaN, infinities and subnormals.
"""

import numpy as np
import pytest
import torch

from megazero.ops import registry, sign_pack

LEVELS = sign_pack.supported_simd_levels()
needs_ext = pytest.mark.skipif(not LEVELS, reason="megazero.ops._sign_pack is not built")
# 600_011 elements are 75_002 bytes: two threads under torch_threads(2)
SIZES = [0, 1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64, 65, 1000, 4099, 600_011]


def specials(x: torch.Tensor) -> torch.Tensor:
    """x with +0, -0, NaN, +-inf and subnormals sprinkled in."""
    x = x.clone()
    for k, v in enumerate((0.0, -0.0, float("nan"), float("inf"), float("-inf"), 1e-45,
                           -1e-45)):
        x[k::11] = v
    return x


def bits(t: torch.Tensor) -> torch.Tensor:
    """An fp32 tensor's bit patterns (bitwise comparison, NaNs and -0 included)."""
    return t.contiguous().view(torch.int32)


def test_reference_layout_is_little_endian_packbits():
    x = torch.tensor([1.0, -1.0, -2.0, 3.0, 0.0, -0.0, float("nan"), -5.0, 7.0, -1.0, 2.0])
    packed = sign_pack.pack_signs_reference(x)
    # bit i of byte 0 <- x[i] >= 0: x[0], x[3], x[4], x[5] -> 0b00111001; byte 1: x[8], x[10]
    assert packed.tolist() == [0b00111001, 0b00000101]
    expected = np.packbits((x >= 0).numpy(), bitorder="little")
    assert packed.numpy().tobytes() == expected.tobytes()
    out = sign_pack.unpack_signs_reference(packed, 11, 0.5)
    assert out.tolist() == [0.5, -0.5, -0.5, 0.5, 0.5, 0.5, -0.5, -0.5, 0.5, -0.5, 0.5]


@needs_ext
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("n", SIZES)
def test_pack_matches_reference(gen, level, n, torch_threads):
    x = specials(torch.randn(n, generator=gen)) if n else torch.empty(0)
    with sign_pack.forced_simd_level(level), torch_threads(2):
        packed = sign_pack.pack_signs(x)
    ref = sign_pack.pack_signs_reference(x)
    assert packed.dtype == torch.uint8 and packed.shape == (sign_pack.packed_size(n),)
    assert torch.equal(packed, ref)


@needs_ext
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("n", SIZES)
def test_unpack_matches_reference(gen, level, n, torch_threads):
    packed = torch.randint(0, 256, (sign_pack.packed_size(n),), dtype=torch.uint8,
                           generator=gen)
    chunked = [k for k in (1, 3, 5, 8) if n and n % k == 0]
    scales = [0.1, 3.0] + [torch.rand(k, generator=gen) + 0.5 for k in chunked]
    for scale in scales:
        with sign_pack.forced_simd_level(level), torch_threads(2):
            out = sign_pack.unpack_signs(packed, n, scale)
        ref = sign_pack.unpack_signs_reference(packed, n, scale)
        assert out.dtype == torch.float32 and out.shape == (n,)
        assert torch.equal(bits(out), bits(ref)), f"scale {scale}"


@needs_ext
@pytest.mark.parametrize("level", LEVELS)
def test_round_trip_and_out_buffers(gen, level):
    n = 1237
    x = specials(torch.randn(n, generator=gen))
    out_packed = torch.full((sign_pack.packed_size(n),), 7, dtype=torch.uint8)
    out = torch.empty(n)
    with sign_pack.forced_simd_level(level):
        packed = sign_pack.pack_signs(x, out=out_packed)
        y = sign_pack.unpack_signs(packed, n, 0.1, out=out)
    assert packed is out_packed and y is out
    scale = torch.tensor(0.1, dtype=torch.float32)  # the float is rounded to fp32 once
    assert torch.equal(y, torch.where(x >= 0, scale, -scale))


@needs_ext
def test_chunk_boundaries_inside_a_byte(gen):
    """Per-chunk scales with chunks that do not start on a byte boundary (n = 3 * 7)."""
    packed = torch.randint(0, 256, (3,), dtype=torch.uint8, generator=gen)
    scales = torch.tensor([1.0, 2.0, 4.0])
    out = sign_pack.unpack_signs(packed, 21, scales)
    assert torch.equal(out, sign_pack.unpack_signs_reference(packed, 21, scales))
    assert out.abs().tolist() == [1.0] * 7 + [2.0] * 7 + [4.0] * 7


def test_reference_path_when_disabled(gen, ops_disabled):
    n = 1001
    x = specials(torch.randn(n, generator=gen))
    scales = torch.rand(7, generator=gen) + 0.5
    kernel_packed = sign_pack.pack_signs(x)
    kernel_out = sign_pack.unpack_signs(kernel_packed, n, scales)
    with ops_disabled("sign_pack"):
        assert sign_pack.extension() is None and sign_pack.simd_level() is None
        packed = sign_pack.pack_signs(x)
        out = sign_pack.unpack_signs(packed, n, scales)
        into = torch.empty(n)
        assert sign_pack.unpack_signs(packed, n, scales, out=into) is into
    assert torch.equal(packed, kernel_packed)
    assert torch.equal(bits(out), bits(kernel_out)) and torch.equal(into, out)


def test_other_dtypes_take_the_reference(gen):
    x = torch.randn(77, generator=gen)
    assert torch.equal(sign_pack.pack_signs(x.bfloat16()), sign_pack.pack_signs(x))
    assert torch.equal(sign_pack.pack_signs(x[::2]), sign_pack.pack_signs(x[::2].contiguous()))


def test_bad_arguments():
    packed = torch.zeros(2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="equal chunks"):
        sign_pack.unpack_signs(packed, 10, torch.ones(3))
    with pytest.raises(ValueError, match="at least 3 bytes"):
        sign_pack.unpack_signs(packed, 17, 1.0)
    with pytest.raises(ValueError, match="out must be"):
        sign_pack.pack_signs(torch.ones(9), out=torch.empty(1, dtype=torch.uint8))


def test_registered_for_the_report():
    registry.import_op_modules()
    spec = {s.name: s for s in registry.registered_ops()}["sign_pack"]
    status = registry.op_status(spec)
    assert status["extension"] == "_sign_pack"
    assert status["built"] == bool(LEVELS) and (status["built"] or status["reason"])
    if status["built"]:
        assert status["simd"] in LEVELS
