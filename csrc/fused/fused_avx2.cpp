// AVX2 + FMA instantiation of the fused model-op kernels (8 fp32 lanes).
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
#pragma GCC target("avx2,fma,f16c")
namespace megazero_fused {
namespace avx2 {

#include "vec_avx2.h"
#include "fused_kernels_impl.h"

}  // namespace avx2
}  // namespace megazero_fused
#pragma GCC pop_options
