// One SIMD level's fp32 vector type for megazero's CPU optimizer kernels, chosen by the level
// the translation unit is compiled for (MZ_ISA, see megazero/simd.h): scalar (1 lane), avx2
// (8 lanes, with FMA and F16C available), avx512 (16 lanes) and avx512bf16 (16 lanes, fp32 ->
// bf16 by the AVX512-BF16 instruction).
//
// Only for per-level translation units, which are compiled with -ffp-contract=off (no FMA
// contraction: every level and the PyTorch reference round each + - * / the same way).
// Everything is in an anonymous namespace on purpose: each level's translation unit gets its
// own internal copy, so no function compiled for AVX-512 can be shared with a baseline caller.
//
// Numerics: loads widen to fp32 exactly; stores round to nearest even. bf16 stores follow
// torch (NaN -> 0x7FC0), except that the AVX512-BF16 instruction flushes fp32 denormals
// (|x| < 2^-126) to zero. Sums of squares accumulate in float64 in 16 lanes: element k of a
// 16-element group goes to lane k, and the lanes are added in one fixed tree, so every level
// gives the same bits. stream() writes a 16-bit copy with non-temporal stores (AVX2/AVX-512;
// the caller aligns the address and calls stream_fence() afterwards).
#pragma once

#include <cstdint>

#include "megazero/optim_common.h"
#include "megazero/simd.h"

#if !defined(MZ_ISA)
#error "megazero/vec.h is for the per-level translation units (MZ_ISA, see megazero/simd.h)"
#endif
#if !defined(MZ_ISA_SCALAR)
#include <immintrin.h>
#endif

namespace {

using megazero::kBF16;
using megazero::kF16;
using megazero::kF32;
using megazero::kNone;

// ---- scalar conversions (bit-exact with torch's) ----------------------------------------
inline uint32_t f32_bits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return u;
}
inline float bits_f32(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }
inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13));  // inf, NaN
  if (exp == 0) {                                                       // zero, subnormal
    const float v = static_cast<float>(man) * 5.9604644775390625e-08f;  // man * 2^-24, exact
    return sign ? -v : v;
  }
  return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}
inline uint16_t f32_to_f16(float f) {
  const uint32_t u = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // rounds to inf (>= 65520), or inf
  if (a < 0x38800000u) {                        // below 2^-14: fp16 subnormal or zero
    // Adding 0.5 leaves the value rounded (to nearest even) to a multiple of 2^-24 in the low
    // mantissa bits; a carry into 2^-14 yields the smallest normal, which is correct.
    return sign | static_cast<uint16_t>(f32_bits(bits_f32(a) + 0.5f) - 0x3f000000u);
  }
  a += 0xc8000fffu + ((a >> 13) & 1u);  // rebias the exponent by -112, round to nearest even
  return sign | static_cast<uint16_t>(a >> 13);
}

template <int DT>
struct Elem;  // storage type and size of a dtype
template <> struct Elem<kF32> { using T = float; };
template <> struct Elem<kBF16> { using T = uint16_t; };
template <> struct Elem<kF16> { using T = uint16_t; };

constexpr int elem_size(int dt) { return dt == kF32 ? 4 : 2; }

#if defined(MZ_ISA_SCALAR)
// ---- scalar: one lane ---------------------------------------------------------------------
struct Vec {
  using F = float;
  using M = bool;
  static constexpr int W = 1;
  static F set1(float x) { return x; }
  static F sqrt(F x) { return __builtin_sqrtf(x); }
  static M finite(F x) { return (f32_bits(x) & 0x7f800000u) != 0x7f800000u; }
  static F select(M m, F a, F b) { return m ? a : b; }
  static bool all(M m) { return m; }
  template <int DT>
  static F load(const void* base, int64_t i) {
    if constexpr (DT == kF32) return static_cast<const float*>(base)[i];
    else if constexpr (DT == kBF16) return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
    else return f16_to_f32(static_cast<const uint16_t*>(base)[i]);
  }
  template <int DT>
  static void store(void* base, int64_t i, F x) {
    if constexpr (DT == kF32) static_cast<float*>(base)[i] = x;
    else if constexpr (DT == kBF16) static_cast<uint16_t*>(base)[i] = f32_to_bf16(x);
    else static_cast<uint16_t*>(base)[i] = f32_to_f16(x);
  }
  static constexpr bool kCanStream = false;
  template <int DT>
  static void stream(void* base, int64_t i, F x) { store<DT>(base, i, x); }
  static void stream_fence() {}
  // Sum of squares in 16 float64 lanes; `part` is the lane (element index within the group).
  struct Acc16 {
    double a[16] = {};
    void add_sq(F x, int part) {
      const double d = x;
      a[part] = a[part] + d * d;
    }
    double reduce() const {
      double r8[8], r4[4];
      for (int j = 0; j < 8; ++j) r8[j] = a[j] + a[j + 8];
      for (int j = 0; j < 4; ++j) r4[j] = r8[j] + r8[j + 4];
      return (r4[0] + r4[2]) + (r4[1] + r4[3]);
    }
  };
};

#elif defined(MZ_ISA_AVX2)
// ---- AVX2 + FMA + F16C: 8 lanes -----------------------------------------------------------
struct Vec {
  using F = __m256;
  using M = __m256;  // all-ones lanes where true
  static constexpr int W = 8;
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F sqrt(F x) { return _mm256_sqrt_ps(x); }
  static M finite(F x) { return _mm256_cmp_ps(_mm256_sub_ps(x, x), _mm256_setzero_ps(), _CMP_EQ_OQ); }
  static F select(M m, F a, F b) { return _mm256_blendv_ps(b, a, m); }
  static bool all(M m) { return _mm256_movemask_ps(m) == 0xff; }
  template <int DT>
  static F load(const void* base, int64_t i) {
    if constexpr (DT == kF32) {
      return _mm256_loadu_ps(static_cast<const float*>(base) + i);
    } else {
      const __m128i h = _mm_loadu_si128(
          reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
      if constexpr (DT == kBF16) {
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      } else {
        return _mm256_cvtph_ps(h);
      }
    }
  }
  // fp32 lanes rounded to a 16-bit dtype (nearest even), packed into 128 bits.
  template <int DT>
  static __m128i to16(F x) {
    if constexpr (DT == kBF16) {
      const __m256i u = _mm256_castps_si256(x);
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
      __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
      r = _mm256_srli_epi32(r, 16);
      const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
      r = _mm256_castps_si256(_mm256_blendv_ps(
          _mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc0)), nan));
      // packus works per 128-bit lane: [r0-3 r0-3 | r4-7 r4-7] -> take qwords 0 and 2.
      return _mm256_castsi256_si128(
          _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
    } else {
      return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
  }
  template <int DT>
  static void store(void* base, int64_t i, F x) {
    if constexpr (DT == kF32) {
      _mm256_storeu_ps(static_cast<float*>(base) + i, x);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i), to16<DT>(x));
    }
  }
  // Non-temporal store of a 16-bit dtype; base + i must be 16-byte aligned.
  static constexpr bool kCanStream = true;
  template <int DT>
  static void stream(void* base, int64_t i, F x) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i), to16<DT>(x));
  }
  static void stream_fence() { _mm_sfence(); }
  // Lanes 0-3, 4-7 (part 0) and 8-11, 12-15 (part 1) of the 16-lane float64 sum.
  struct Acc16 {
    __m256d a0, a1, a2, a3;
    Acc16() : a0(_mm256_setzero_pd()), a1(a0), a2(a0), a3(a0) {}
    void add_sq(F x, int part) {
      const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
      const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
      if (part == 0) {
        a0 = _mm256_add_pd(a0, _mm256_mul_pd(lo, lo));
        a1 = _mm256_add_pd(a1, _mm256_mul_pd(hi, hi));
      } else {
        a2 = _mm256_add_pd(a2, _mm256_mul_pd(lo, lo));
        a3 = _mm256_add_pd(a3, _mm256_mul_pd(hi, hi));
      }
    }
    double reduce() const {
      const __m256d r4 = _mm256_add_pd(_mm256_add_pd(a0, a2), _mm256_add_pd(a1, a3));
      const __m128d r2 = _mm_add_pd(_mm256_castpd256_pd128(r4), _mm256_extractf128_pd(r4, 1));
      return _mm_cvtsd_f64(r2) + _mm_cvtsd_f64(_mm_unpackhi_pd(r2, r2));
    }
  };
};

#else
// ---- AVX-512 (F, BW, VL; optionally BF16): 16 lanes ---------------------------------------
struct Vec {
  using F = __m512;
  using M = __mmask16;
  static constexpr int W = 16;
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F sqrt(F x) { return _mm512_sqrt_ps(x); }
  static M finite(F x) {
    return _mm512_cmp_ps_mask(_mm512_sub_ps(x, x), _mm512_setzero_ps(), _CMP_EQ_OQ);
  }
  static F select(M m, F a, F b) { return _mm512_mask_blend_ps(m, b, a); }
  static bool all(M m) { return m == 0xffff; }
  template <int DT>
  static F load(const void* base, int64_t i) {
    if constexpr (DT == kF32) {
      return _mm512_loadu_ps(static_cast<const float*>(base) + i);
    } else {
      const __m256i h = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
      if constexpr (DT == kBF16) {
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      } else {
        return _mm512_cvtph_ps(h);
      }
    }
  }
  // fp32 lanes rounded to a 16-bit dtype (nearest even), packed into 256 bits.
  template <int DT>
  static __m256i to16(F x) {
    if constexpr (DT == kBF16) {
#if defined(MZ_ISA_BF16_NATIVE)
      return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
#else
      const __m512i u = _mm512_castps_si512(x);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
      r = _mm512_srli_epi32(r, 16);
      const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0)));
#endif
    } else {
      return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
  }
  template <int DT>
  static void store(void* base, int64_t i, F x) {
    if constexpr (DT == kF32) {
      _mm512_storeu_ps(static_cast<float*>(base) + i, x);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(base) + i),
                          to16<DT>(x));
    }
  }
  // Non-temporal store of a 16-bit dtype; base + i must be 32-byte aligned.
  static constexpr bool kCanStream = true;
  template <int DT>
  static void stream(void* base, int64_t i, F x) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(base) + i),
                        to16<DT>(x));
  }
  static void stream_fence() { _mm_sfence(); }
  // Lanes 0-7 and 8-15 of the 16-lane float64 sum (one part per 16-element group).
  struct Acc16 {
    __m512d a0, a1;
    Acc16() : a0(_mm512_setzero_pd()), a1(a0) {}
    void add_sq(F x, int /*part*/) {
      const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
      const __m512d hi =
          _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
      a0 = _mm512_add_pd(a0, _mm512_mul_pd(lo, lo));
      a1 = _mm512_add_pd(a1, _mm512_mul_pd(hi, hi));
    }
    double reduce() const {
      const __m512d r8 = _mm512_add_pd(a0, a1);
      const __m256d r4 = _mm256_add_pd(_mm512_castpd512_pd256(r8), _mm512_extractf64x4_pd(r8, 1));
      const __m128d r2 = _mm_add_pd(_mm256_castpd256_pd128(r4), _mm256_extractf128_pd(r4, 1));
      return _mm_cvtsd_f64(r2) + _mm_cvtsd_f64(_mm_unpackhi_pd(r2, r2));
    }
  };
};
#endif

constexpr int kGroup = 16;                   // elements per group (lanes of Acc16)
constexpr int kParts = kGroup / Vec::W;      // vectors per group

// Copies the last n < kGroup elements of a buffer into (or out of) a zero-padded group-sized
// scratch buffer, so the tail runs through the same vector code as the body.
inline void tail_in(void* dst, const void* src, int64_t i, int64_t n, int dt) {
  __builtin_memset(dst, 0, kGroup * 4);
  if (src) __builtin_memcpy(dst, static_cast<const char*>(src) + i * elem_size(dt), n * elem_size(dt));
}
inline void tail_out(void* dst, const void* src, int64_t i, int64_t n, int dt) {
  if (dst) __builtin_memcpy(static_cast<char*>(dst) + i * elem_size(dt), src, n * elem_size(dt));
}

}  // namespace
