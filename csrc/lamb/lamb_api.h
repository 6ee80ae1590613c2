// Declarations shared by the LAMB extension's translation units: per-call constants, one
// span's buffers, and each ISA's entry points (defined in lamb_<isa>.cpp, chosen at run time
// in lamb.cpp). Types and declarations only, so any ISA's translation unit may include it.
#pragma once

#include <cstdint>

#include "megazero/optim_common.h"

namespace megazero::lamb {

// fp32 constants of one call, each rounded once from the Python double.
struct LambConsts {
  float beta1, one_minus_beta1;  // (float)beta1, (float)(1 - beta1)
  float beta2, one_minus_beta2;
  float eps;
  float bc1, bc2;       // 1 - beta^step (1 without bias correction)
  float grad_scale;     // stage 1: the gradient is multiplied by this first
  bool mask_nonfinite;  // stage 1: elements with an inf/NaN scaled gradient keep m and v
  int param_dtype, grad_dtype, copy_dtype;  // DType codes; copy_dtype kNone: no copy
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

// Stage 1 of units [lo, hi): moments, and per unit the float64 sums of p^2 (w_sq[u]) and of
// update^2 (u_sq[u]). Returns true if a non-finite scaled gradient was met (mask_nonfinite).
using Stage1Fn = bool (*)(const LambConsts&, const LambSpan*, const WorkUnit*, int64_t lo,
                          int64_t hi, double* w_sq, double* u_sq);
// Stage 2 of units [lo, hi): p -= scale * update (the update recomputed as in stage 1).
using Stage2Fn = void (*)(const LambConsts&, const LambSpan*, const WorkUnit*, int64_t lo,
                          int64_t hi);

#define MZ_LAMB_DECLARE(isa)                                                                  \
  bool lamb_stage1_##isa(const LambConsts&, const LambSpan*, const WorkUnit*, int64_t,        \
                         int64_t, double*, double*);                                          \
  void lamb_stage2_##isa(const LambConsts&, const LambSpan*, const WorkUnit*, int64_t, int64_t);

MZ_LAMB_DECLARE(scalar)
#if defined(__x86_64__)
MZ_LAMB_DECLARE(avx2)
MZ_LAMB_DECLARE(avx512)
MZ_LAMB_DECLARE(avx512bf16)
#endif
#undef MZ_LAMB_DECLARE

}  // namespace megazero::lamb
