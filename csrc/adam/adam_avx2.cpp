// AVX2+FMA+F16C: instantiation of the Adam kernels (adam_kernel.h) and of the
// float64 sum of squares (megazero/sumsq_kernel.h).
// System headers come first, outside the target region, so only megazero's own internal
// functions are compiled for this ISA (see csrc/include/megazero/vec.h).
#include <cstddef>
#include <cstdint>
#include <immintrin.h>

#include "adam_api.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#pragma GCC target("avx2,fma,f16c")
#define MZ_ISA_AVX2 1
#include "adam_kernel.h"
#include "megazero/sumsq_kernel.h"

namespace megazero::adam {

bool adam_units_avx2(const AdamConsts& c, const AdamSpan* spans, const WorkUnit* units,
                     int64_t lo, int64_t hi) {
  return adam_units(c, spans, units, lo, hi);
}

void sumsq_units_avx2(int dt, const void* const* spans, const WorkUnit* units, int64_t lo,
                      int64_t hi, double* partial) {
  sumsq_units(dt, spans, units, lo, hi, partial);
}

}  // namespace megazero::adam

#pragma GCC pop_options
#endif  // defined(__x86_64__)
