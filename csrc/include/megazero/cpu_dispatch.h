// Run-time side of megazero's CPU kernels: which SIMD level the CPU supports, which one is in
// use (forcible for tests) and so which kernel table runs, how an optimizer call's elements
// are cut into work units, and the OpenMP driver that gives each thread a contiguous, equally
// sized run of units.
//
// Include only from a binding translation unit, which is compiled for the baseline ISA: the
// inline functions here must not be compiled for a vector level (the linker could keep that
// copy for every caller).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "megazero/optim_common.h"
#include "megazero/simd.h"

namespace megazero {

inline const char* simd_level_name(int level) {
  switch (level) {
    case kScalar: return "scalar";
    case kAvx2: return "avx2";
    case kAvx512: return "avx512";
    case kAvx512Bf16: return "avx512_bf16";
    default: return "unknown";
  }
}

// The best level this CPU (and OS, for the wide register state) supports.
inline int detect_simd_level() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512dq");
  if (avx512 && __builtin_cpu_supports("avx512bf16")) return kAvx512Bf16;
  if (avx512) return kAvx512;
  if (avx2) return kAvx2;
#endif
  return kScalar;
}

// The level in use by this extension: the best supported until set_simd_level changes it.
inline int& active_simd_level() {
  static int level = detect_simd_level();
  return level;
}

// The kernel table of the active level out of one per level (MZ_SIMD_TABLES in
// megazero/simd.h; a build without the vector levels has the scalar one only).
template <class Table, size_t N>
const Table& active_table(const Table* const (&tables)[N]) {
  const int level = active_simd_level();
  return *tables[level < static_cast<int>(N) ? level : static_cast<int>(N) - 1];
}

inline std::vector<std::string> supported_simd_levels() {
  std::vector<std::string> names;
  for (int l = kScalar; l <= detect_simd_level(); ++l) names.emplace_back(simd_level_name(l));
  return names;
}

// "auto" restores the best supported level; any other name must be supported by this CPU.
inline void set_simd_level(const std::string& name) {
  const int best = detect_simd_level();
  if (name == "auto") {
    active_simd_level() = best;
    return;
  }
  for (int l = kScalar; l <= kAvx512Bf16; ++l) {
    if (name == simd_level_name(l)) {
      if (l > best) {
        throw std::invalid_argument("SIMD level '" + name + "' is not supported by this CPU "
                                    "(best: " + simd_level_name(best) + ")");
      }
      active_simd_level() = l;
      return;
    }
  }
  throw std::invalid_argument("unknown SIMD level '" + name +
                              "' (expected auto, scalar, avx2, avx512 or avx512_bf16)");
}

inline int openmp_max_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

// Cuts spans of the given sizes into units of at most kUnitElems elements, in span order.
inline std::vector<WorkUnit> make_units(const std::vector<int64_t>& sizes) {
  std::vector<WorkUnit> units;
  for (int64_t s = 0; s < static_cast<int64_t>(sizes.size()); ++s) {
    if (sizes[s] < 0) throw std::invalid_argument("negative span size");
    for (int64_t b = 0; b < sizes[s]; b += kUnitElems) {
      units.push_back({s, b, std::min(sizes[s], b + kUnitElems)});
    }
  }
  return units;
}

// Calls fn(first_unit, last_unit) on up to num_threads OpenMP threads (<= 0: the OpenMP
// default), each thread taking the units whose first element falls in its equal share of all
// elements; returns the logical OR of the calls' results. fn must not throw.
template <class Fn>
bool parallel_units(const std::vector<WorkUnit>& units, int num_threads, Fn&& fn) {
  const int64_t n = static_cast<int64_t>(units.size());
  if (n == 0) return false;
  std::vector<int64_t> start(n + 1, 0);
  for (int64_t u = 0; u < n; ++u) start[u + 1] = start[u] + (units[u].end - units[u].begin);
  const int64_t total = start[n];
  int64_t threads = num_threads > 0 ? num_threads : openmp_max_threads();
  threads = std::min<int64_t>({threads, n, std::max<int64_t>(1, total / kMinElemsPerThread)});
#ifdef _OPENMP
  if (threads > 1) {
    bool found = false;
#pragma omp parallel num_threads(static_cast<int>(threads)) reduction(|| : found)
    {
      const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
      const int64_t lo_elem = total * t / nt, hi_elem = total * (t + 1) / nt;
      const int64_t lo = std::lower_bound(start.begin(), start.end() - 1, lo_elem) - start.begin();
      const int64_t hi = t + 1 == nt ? n
                         : std::lower_bound(start.begin(), start.end() - 1, hi_elem) - start.begin();
      if (lo < hi) found = fn(lo, hi) || found;
    }
    return found;
  }
#endif
  return fn(int64_t{0}, n);
}

}  // namespace megazero
