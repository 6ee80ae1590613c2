// Plain declarations shared by megazero's CPU kernels: SIMD level codes (all of csrc/adam,
// csrc/lamb, csrc/fused), and for the optimizer kernels (csrc/adam, csrc/lamb) dtype codes,
// the constants every optimizer call has and the unit of parallel work. Only types and
// constants live here (no functions), so every translation unit may include it, whatever
// SIMD level it is compiled for.
#pragma once

#include <cstdint>

namespace megazero {

// Element dtype of a buffer, as passed from Python (megazero/ops/_cpu_ext.py DTYPE_CODES).
enum DType : int { kNone = -1, kF32 = 0, kBF16 = 1, kF16 = 2 };

// SIMD code paths, ordered: a higher level implies every lower one.
enum SimdLevel : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

// fp32 constants of one optimizer call shared by Adam and LAMB, each rounded once from the
// Python double (the PyTorch references round the same values the same way).
struct MomentConsts {
  float beta1, one_minus_beta1;  // (float)beta1, (float)(1 - beta1)
  float beta2, one_minus_beta2;
  float eps;
  float grad_scale;     // the gradient is multiplied by this first
  bool mask_nonfinite;  // elements whose scaled gradient is inf/NaN keep their old values
  int param_dtype, grad_dtype, copy_dtype;  // DType codes; copy_dtype kNone: no copy
};

// Elements of one work unit. A multiple of 16 (the lane pattern of the float64 sums), so every
// unit but a span's last is made of whole 16-element groups.
constexpr int64_t kUnitElems = 16384;

// Below this many elements in a call, run on one thread (an OpenMP fork costs microseconds).
constexpr int64_t kMinElemsPerThread = 32768;

// A piece of one span (a tensor or a segment of a flat buffer): elements [begin, end).
// Units of a span start at multiples of kUnitElems from the span's start.
struct WorkUnit {
  int64_t span;
  int64_t begin;
  int64_t end;
};

}  // namespace megazero
