// Shared declarations of the 1-bit sign codec (megazero.ops._sign_pack), the building block of
// the compressed all-reduce of 1-bit Adam (megazero/distributed/compressed.py).
//
// Bit layout (the same in megazero/ops/sign_pack.py's PyTorch reference): element i of x [n]
// is bit (i % 8) of byte i / 8 (little-endian bit order within the byte), set when
// x[i] >= 0 -- so sign(+0) = sign(-0) = +1 as in DeepSpeed, and NaN packs as -1. The bits of
// the last byte past n are 0. Unpacking writes +scale for a set bit and -scale for a clear
// one, with one scale per chunk of `chunk` consecutive elements (chunk = n: one scale).
//
// Every SIMD level (scalar, AVX2, AVX-512; avx512bf16 reuses the AVX-512 code) compiles
// sign_pack_simd.cpp into its own object and namespace and fills one KernelTable;
// sign_pack_bindings.cpp picks the table at run time (megazero/cpu_dispatch.h). Kernels take
// raw pointers and sizes only (no libtorch); all levels produce identical bytes and floats.
#pragma once

#include <cstdint>

#include "megazero/simd.h"

namespace megazero_sign_pack {

struct KernelTable {
  // out [ceil(n / 8)] = the sign bits of x [n] (fp32).
  void (*pack)(const float* x, uint8_t* out, int64_t n, int nthreads);
  // out [n] = +-scales[i / chunk] by bit i of packed; chunk >= 1.
  void (*unpack)(const uint8_t* packed, float* out, int64_t n, const float* scales,
                 int64_t chunk, int nthreads);
};

MZ_DECLARE_SIMD_TABLES(KernelTable, kTable)

}  // namespace megazero_sign_pack
