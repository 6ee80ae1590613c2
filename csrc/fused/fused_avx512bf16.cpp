// AVX-512 with AVX512_BF16 instantiation: as fused_avx512.cpp, bf16 stores by VCVTNEPS2BF16.
// System headers come first, outside the target region, so only megazero's own functions
// are compiled for this ISA (see fused_common.h).
#include <omp.h>

#include <cmath>
#include <cstring>
#include <immintrin.h>
#include "fused_common.h"

#pragma GCC push_options
// GCC 12 reports the intrinsics' own _mm*_undefined_* temporaries as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// No implicit FMA contraction: fused multiply-adds only where the kernels write vfma.
#pragma GCC optimize("fp-contract=off")
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
namespace megazero_fused {
namespace avx512bf16 {
#define MZ_AVX512_BF16 1
#include "vec_avx512.h"
#include "fused_kernels_impl.h"
#undef MZ_AVX512_BF16
}  // namespace avx512bf16
}  // namespace megazero_fused
#pragma GCC pop_options
