// Declarations shared by the Adam extension's translation units: the per-call constants, one
// span's buffers, and each ISA's entry points (defined in adam_<isa>.cpp, chosen at run time
// in adam.cpp). Types and declarations only, so any ISA's translation unit may include it.
#pragma once

#include <cstdint>

#include "megazero/optim_common.h"

namespace megazero::adam {

// fp32 constants of one call, each rounded once from the Python double (the PyTorch
// reference in megazero/ops/cpu_adam.py rounds the same values the same way).
struct AdamConsts {
  float beta1, one_minus_beta1;  // (float)beta1, (float)(1 - beta1)
  float beta2, one_minus_beta2;
  float eps;
  float step_size;    // lr / (1 - beta1^step); lr without bias correction
  float bc2_sqrt;     // sqrt(1 - beta2^step); 1 without bias correction
  float grad_scale;   // the gradient is multiplied by this first
  bool adam_w_mode;   // decoupled weight decay (AdamW); else L2 added to the gradient
  bool mask_nonfinite;  // elements whose scaled gradient is inf/NaN keep their old values
  bool stream_copy;     // write a 16-bit copy with non-temporal stores (large calls)
  int param_dtype, grad_dtype, copy_dtype;  // DType codes; copy_dtype kNone: no copy
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

// Updates units [lo, hi); true if a non-finite scaled gradient was met (checked only with
// mask_nonfinite).
using AdamUnitsFn = bool (*)(const AdamConsts&, const AdamSpan*, const WorkUnit*, int64_t lo,
                             int64_t hi);
// partial[u] = sum of squares (float64) of units[u] for u in [lo, hi); spans of dtype `dt`.
using SumsqUnitsFn = void (*)(int dt, const void* const* spans, const WorkUnit*, int64_t lo,
                              int64_t hi, double* partial);

bool adam_units_scalar(const AdamConsts&, const AdamSpan*, const WorkUnit*, int64_t, int64_t);
void sumsq_units_scalar(int, const void* const*, const WorkUnit*, int64_t, int64_t, double*);
#if defined(__x86_64__)
bool adam_units_avx2(const AdamConsts&, const AdamSpan*, const WorkUnit*, int64_t, int64_t);
void sumsq_units_avx2(int, const void* const*, const WorkUnit*, int64_t, int64_t, double*);
bool adam_units_avx512(const AdamConsts&, const AdamSpan*, const WorkUnit*, int64_t, int64_t);
void sumsq_units_avx512(int, const void* const*, const WorkUnit*, int64_t, int64_t, double*);
bool adam_units_avx512bf16(const AdamConsts&, const AdamSpan*, const WorkUnit*, int64_t,
                           int64_t);
#endif

}  // namespace megazero::adam
