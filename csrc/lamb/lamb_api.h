// Declarations shared by the LAMB extension's translation units: per-call constants, one
// span's buffers, and the kernel table that lamb_simd.cpp defines once per SIMD level (chosen
// at run time in lamb.cpp). Types and declarations only, so any level's unit may include it.
#pragma once

#include <cstdint>

#include "megazero/optim_common.h"
#include "megazero/simd.h"

namespace megazero::lamb {

// fp32 constants of one call: the shared ones (beta1, ..., dtypes; grad_scale and
// mask_nonfinite act in stage 1 only) and the bias corrections, rounded once from doubles.
struct LambConsts : MomentConsts {
  float bc1, bc2;  // 1 - beta^step (1 without bias correction)
};

// One tensor (or one segment of a flat buffer). Moments are always fp32.
struct LambSpan {
  void* param;
  const void* grad;     // stage 1 only
  float* exp_avg;
  float* exp_avg_sq;
  void* copy;           // stage 2: low-precision copy of the updated param, or nullptr
  float weight_decay;
  float scale;          // stage 2: (float)(lr * trust_ratio)
};

// One SIMD level's kernels.
struct LambKernels {
  // Stage 1 of units [lo, hi): moments, and per unit the float64 sums of p^2 (w_sq[u]) and of
  // update^2 (u_sq[u]). Returns true if a non-finite scaled gradient was met (mask_nonfinite).
  bool (*stage1)(const LambConsts&, const LambSpan*, const WorkUnit*, int64_t lo, int64_t hi,
                 double* w_sq, double* u_sq);
  // Stage 2 of units [lo, hi): p -= scale * update (the update recomputed as in stage 1).
  void (*stage2)(const LambConsts&, const LambSpan*, const WorkUnit*, int64_t lo, int64_t hi);
};

MZ_DECLARE_SIMD_TABLES(LambKernels, kKernels)

}  // namespace megazero::lamb
