// Portable scalar instantiation of the fused model-op kernels (any CPU).
// System headers come first, outside the target region, so only megazero's own functions
// are compiled for this ISA (see fused_common.h).
#include <omp.h>

#include <cmath>
#include <cstring>

#include "fused_common.h"

// No implicit FMA contraction (as in the vector TUs).
#pragma GCC optimize("fp-contract=off")

namespace megazero_fused {
namespace scalar {

#include "vec_scalar.h"
#include "fused_kernels_impl.h"

}  // namespace scalar
}  // namespace megazero_fused

