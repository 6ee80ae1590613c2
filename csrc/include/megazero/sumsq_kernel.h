// Sum of squares of one work unit in float64 (the global gradient norm), for one SIMD level.
// Include in a per-level translation unit only (see megazero/vec.h for the rules).
#pragma once

#include "megazero/vec.h"

namespace {

// Sum of x[i]^2 over i in [b, e) of a buffer of dtype DT, in the 16-lane order of Vec::Acc16.
template <int DT>
double sumsq_range(const void* x, int64_t b, int64_t e) {
  typename Vec::Acc16 acc;
  int64_t i = b;
  for (; i + kGroup <= e; i += kGroup) {
    for (int part = 0; part < kParts; ++part) {
      acc.add_sq(Vec::template load<DT>(x, i + part * Vec::W), part);
    }
  }
  if (i < e) {
    alignas(64) unsigned char buf[kGroup * 4];
    tail_in(buf, x, i, e - i, DT);
    for (int part = 0; part < kParts; ++part) {
      acc.add_sq(Vec::template load<DT>(buf, part * Vec::W), part);
    }
  }
  return acc.reduce();
}

// partial[u] = sum of squares of units[u], for u in [lo, hi). All spans have dtype `dt`.
inline void sumsq_units(int dt, const void* const* spans, const megazero::WorkUnit* units,
                        int64_t lo, int64_t hi, double* partial) {
  for (int64_t u = lo; u < hi; ++u) {
    const megazero::WorkUnit& w = units[u];
    switch (dt) {
      case kF32: partial[u] = sumsq_range<kF32>(spans[w.span], w.begin, w.end); break;
      case kBF16: partial[u] = sumsq_range<kBF16>(spans[w.span], w.begin, w.end); break;
      default: partial[u] = sumsq_range<kF16>(spans[w.span], w.begin, w.end); break;
    }
  }
}

}  // namespace
