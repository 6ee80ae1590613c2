// The fused model-op kernels (fused_kernels_impl.h, written once against the Vf interface of
// vec_{scalar,avx2,avx512}.h) compiled once per SIMD level: setup.py passes -DMZ_ISA=<level>
// and the level's flags (see megazero/simd.h), and each object defines that level's
// megazero_fused::<level>::kTable. Everything else in it is static (internal linkage).
#include <omp.h>

#include <cmath>
#include <cstring>

#include "fused_common.h"
#include "megazero/simd.h"

#if !defined(MZ_ISA_SCALAR)
#include <immintrin.h>
#endif

namespace megazero_fused {
namespace MZ_ISA {

#if defined(MZ_ISA_SCALAR)
#include "vec_scalar.h"
#elif defined(MZ_ISA_AVX2)
#include "vec_avx2.h"
#else
#include "vec_avx512.h"
#endif
#include "fused_kernels_impl.h"

}  // namespace MZ_ISA
}  // namespace megazero_fused
