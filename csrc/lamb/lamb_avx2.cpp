// AVX2+FMA+F16C: instantiation of the LAMB stages (lamb_kernel.h).
// System headers come first, outside the target region, so only megazero's own internal
// functions are compiled for this ISA (see csrc/include/megazero/vec.h).
#include <cstddef>
#include <cstdint>
#include <immintrin.h>

#include "lamb_api.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#pragma GCC target("avx2,fma,f16c")
#define MZ_ISA_AVX2 1
#include "lamb_kernel.h"

namespace megazero::lamb {

bool lamb_stage1_avx2(const LambConsts& c, const LambSpan* spans, const WorkUnit* units,
                      int64_t lo, int64_t hi, double* w_sq, double* u_sq) {
  return stage1_units(c, spans, units, lo, hi, w_sq, u_sq);
}

void lamb_stage2_avx2(const LambConsts& c, const LambSpan* spans, const WorkUnit* units,
                      int64_t lo, int64_t hi) {
  stage2_units(c, spans, units, lo, hi);
}

}  // namespace megazero::lamb

#pragma GCC pop_options
#endif  // defined(__x86_64__)
