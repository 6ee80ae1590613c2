// How megazero's CPU kernels are built for several SIMD levels from one source.
//
// A kernel family (csrc/adam, csrc/lamb, csrc/fused) keeps its vector code in one file,
// <family>_simd.cpp, which setup.py compiles once per level with -DMZ_ISA=<level> and that
// level's flags (SIMD_LEVEL_FLAGS in setup.py):
//   scalar      baseline flags
//   avx2        -mavx2 -mfma -mf16c
//   avx512      -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx2 -mfma -mf16c
//   avx512bf16  the avx512 flags and -mavx512bf16 (fp32 -> bf16 by VCVTNEPS2BF16)
// and every object with -ffp-contract=off: no implicit FMA contraction, so each + - * / is
// rounded alike at every level and in the PyTorch references (an FMA only where a kernel
// writes one). Each object defines its family's kernel table as <family ns>::<MZ_ISA>::<name>;
// the binding translation unit (compiled once, baseline ISA) declares the four tables with
// MZ_DECLARE_SIMD_TABLES and picks one at run time (megazero::active_table in
// megazero/cpu_dispatch.h). Only x86-64 builds the vector levels.
//
// In a per-level translation unit (MZ_ISA defined) this header also defines exactly one of
// MZ_ISA_SCALAR, MZ_ISA_AVX2, MZ_ISA_AVX512 (plus MZ_ISA_BF16_NATIVE for avx512bf16) and
// checks that the compiler flags enable that level. Everything such a unit defines besides its
// table must have internal linkage (anonymous namespace or static): a function compiled for
// AVX-512 must never be merged with a baseline caller's copy of the same inline function.
#pragma once

#include "megazero/optim_common.h"

#if defined(__x86_64__)
#define MZ_DECLARE_SIMD_TABLES(Table, name)         \
  namespace scalar { extern const Table name; }     \
  namespace avx2 { extern const Table name; }       \
  namespace avx512 { extern const Table name; }     \
  namespace avx512bf16 { extern const Table name; }
// The addresses of the tables declared in namespace ns, indexed by megazero::SimdLevel.
#define MZ_SIMD_TABLES(ns, name) \
  {&ns::scalar::name, &ns::avx2::name, &ns::avx512::name, &ns::avx512bf16::name}
#else
#define MZ_DECLARE_SIMD_TABLES(Table, name) namespace scalar { extern const Table name; }
#define MZ_SIMD_TABLES(ns, name) {&ns::scalar::name}
#endif

#if defined(MZ_ISA)
#define MZ_ISA_NUMBER_scalar 1
#define MZ_ISA_NUMBER_avx2 2
#define MZ_ISA_NUMBER_avx512 3
#define MZ_ISA_NUMBER_avx512bf16 4
#define MZ_ISA_NUMBER_(isa) MZ_ISA_NUMBER_##isa
#define MZ_ISA_NUMBER(isa) MZ_ISA_NUMBER_(isa)

#if MZ_ISA_NUMBER(MZ_ISA) == 1
#define MZ_ISA_SCALAR 1
#elif MZ_ISA_NUMBER(MZ_ISA) == 2
#define MZ_ISA_AVX2 1
#if !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#error "MZ_ISA=avx2 needs -mavx2 -mfma -mf16c"
#endif
#elif MZ_ISA_NUMBER(MZ_ISA) >= 3
#define MZ_ISA_AVX512 1
#if !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
      defined(__AVX512DQ__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#error "MZ_ISA=avx512 needs -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx2 -mfma -mf16c"
#endif
#if MZ_ISA_NUMBER(MZ_ISA) == 4
#define MZ_ISA_BF16_NATIVE 1
#if !defined(__AVX512BF16__)
#error "MZ_ISA=avx512bf16 needs -mavx512bf16 besides the avx512 flags"
#endif
#endif
#else
#error "MZ_ISA must be scalar, avx2, avx512 or avx512bf16"
#endif

#if (defined(MZ_ISA_AVX2) || defined(MZ_ISA_AVX512)) && !defined(__x86_64__)
#error "the vector SIMD levels are x86-64 only"
#endif

#if defined(__GNUC__) && !defined(__clang__)
// GCC 12 reports the intrinsics' own _mm*_undefined_* temporaries as uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#endif  // defined(MZ_ISA)
