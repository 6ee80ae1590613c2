// Plain declarations shared by megazero's CPU optimizer kernels (csrc/adam, csrc/lamb):
// dtype codes, SIMD level codes and the unit of parallel work. Only types and constants live
// here (no functions), so every translation unit may include it, whatever ISA it targets.
#pragma once

#include <cstdint>

namespace megazero {

// Element dtype of a buffer, as passed from Python (megazero/ops/_cpu_ext.py DTYPE_CODES).
enum DType : int { kNone = -1, kF32 = 0, kBF16 = 1, kF16 = 2 };

// SIMD code paths, ordered: a higher level implies every lower one.
enum SimdLevel : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

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
