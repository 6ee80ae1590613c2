// Declarations shared by the Adam extension's translation units: the per-call constants, one
// span's buffers, and the kernel table that adam_simd.cpp defines once per SIMD level (chosen
// at run time in adam.cpp). Types and declarations only, so any level's unit may include it.
#pragma once

#include <cstdint>

#include "megazero/optim_common.h"
#include "megazero/simd.h"

namespace megazero::adam {

// fp32 constants of one call: the shared ones (beta1, ..., dtypes) and Adam's own, each
// rounded once from the Python double (as the reference in megazero/ops/cpu_adam.py does).
struct AdamConsts : MomentConsts {
  float step_size;    // lr / (1 - beta1^step); lr without bias correction
  float bc2_sqrt;     // sqrt(1 - beta2^step); 1 without bias correction
  bool adam_w_mode;   // decoupled weight decay (AdamW); else L2 added to the gradient
  bool stream_copy;   // write a 16-bit copy with non-temporal stores (large calls)
};

// One tensor (or one segment of a flat buffer). exp_avg and exp_avg_sq are always fp32.
struct AdamSpan {
  void* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  void* copy;           // low-precision copy of the updated param, or nullptr
  float weight_decay;   // L2 mode: g += weight_decay * p
  float decay;          // AdamW mode: p *= decay, decay = (float)(1 - lr * weight_decay)
};

// One SIMD level's kernels.
struct AdamKernels {
  // Updates units [lo, hi); true if a non-finite scaled gradient was met (checked only with
  // mask_nonfinite).
  bool (*update)(const AdamConsts&, const AdamSpan*, const WorkUnit*, int64_t lo, int64_t hi);
  // partial[u] = sum of squares (float64) of units[u] for u in [lo, hi); spans of dtype `dt`.
  void (*sum_squares)(int dt, const void* const* spans, const WorkUnit*, int64_t lo, int64_t hi,
                      double* partial);
};

MZ_DECLARE_SIMD_TABLES(AdamKernels, kKernels)

}  // namespace megazero::adam
