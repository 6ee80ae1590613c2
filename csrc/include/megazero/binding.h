// The pybind11 side shared by megazero's CPU extensions (_adam, _lamb, _fused): buffers arrive
// as raw addresses (torch's tensor.data_ptr()) with sizes and dtype codes, never as torch
// objects, so no extension links libtorch. Here: the argument checks of the optimizer calls,
// their shared constants and per-span buffers, the run over work units without the GIL, and
// the SIMD-level functions every module exports.
//
// Include only from a binding translation unit (baseline ISA; see megazero/cpu_dispatch.h).
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <vector>

#include "megazero/cpu_dispatch.h"
#include "megazero/optim_common.h"

namespace megazero::binding {

inline void* addr(int64_t v) { return reinterpret_cast<void*>(static_cast<uintptr_t>(v)); }

inline void check_dtype(int dt, bool allow_none, const char* what) {
  if ((dt == kNone && allow_none) || dt == kF32 || dt == kBF16 || dt == kF16) return;
  throw std::invalid_argument(std::string("unsupported dtype code for ") + what);
}

// Every per-span list of call `fn` has n entries.
inline void check_lengths(const char* fn, size_t n, std::initializer_list<size_t> lengths) {
  for (size_t len : lengths) {
    if (len != n) {
      throw std::invalid_argument(std::string(fn) + ": per-span lists differ in length");
    }
  }
}

// A copy of the updated parameters (copy_dtype not kNone) needs fp32 params, one per span.
inline void check_copies(const char* fn, int param_dtype, int copy_dtype, size_t copies,
                         size_t n) {
  check_dtype(copy_dtype, true, "copies");
  if (copy_dtype != kNone && (param_dtype != kF32 || copies != n)) {
    throw std::invalid_argument(std::string(fn) +
                                ": copies need fp32 params and one copy per span");
  }
}

inline MomentConsts moment_consts(double beta1, double beta2, double eps, double grad_scale,
                                  bool mask_nonfinite, int param_dtype, int grad_dtype,
                                  int copy_dtype) {
  return {static_cast<float>(beta1), static_cast<float>(1.0 - beta1), static_cast<float>(beta2),
          static_cast<float>(1.0 - beta2), static_cast<float>(eps),
          static_cast<float>(grad_scale), mask_nonfinite, param_dtype, grad_dtype, copy_dtype};
}

// The buffers of span k (an AdamSpan or LambSpan); empty grads or copies lists: none.
template <class Span>
Span span_buffers(size_t k, const std::vector<int64_t>& params,
                  const std::vector<int64_t>& grads, const std::vector<int64_t>& exp_avgs,
                  const std::vector<int64_t>& exp_avg_sqs, const std::vector<int64_t>& copies) {
  Span s{};
  s.param = addr(params[k]);
  s.grad = grads.empty() ? nullptr : addr(grads[k]);
  s.exp_avg = static_cast<float*>(addr(exp_avgs[k]));
  s.exp_avg_sq = static_cast<float*>(addr(exp_avg_sqs[k]));
  s.copy = copies.empty() ? nullptr : addr(copies[k]);
  return s;
}

// kernel(lo, hi) over `units` on up to num_threads OpenMP threads, without the GIL; the OR of
// the results (see megazero::parallel_units).
template <class Fn>
bool run_units(const std::vector<WorkUnit>& units, int num_threads, Fn&& kernel) {
  pybind11::gil_scoped_release release;
  return parallel_units(units, num_threads, kernel);
}

// Per-span totals of per-unit sums, added in unit order (so independent of the threads).
inline std::vector<double> sum_by_span(const std::vector<WorkUnit>& units,
                                       const std::vector<double>& partial, size_t n) {
  std::vector<double> out(n, 0.0);
  for (size_t u = 0; u < units.size(); ++u) out[units[u].span] += partial[u];
  return out;
}

// simd_level(), set_simd_level(name), supported_simd_levels(), openmp_max_threads().
inline void def_simd_functions(pybind11::module_& m) {
  m.def("simd_level", [] { return std::string(simd_level_name(active_simd_level())); },
        "SIMD level in use: scalar, avx2, avx512 or avx512_bf16");
  m.def("set_simd_level", &set_simd_level, pybind11::arg("name"),
        "Force a SIMD level ('scalar', 'avx2', 'avx512', 'avx512_bf16') or 'auto' (the best); "
        "ValueError when the CPU lacks it.");
  m.def("supported_simd_levels", &supported_simd_levels,
        "SIMD levels this CPU supports, lowest first");
  m.def("openmp_max_threads", &openmp_max_threads);
}

}  // namespace megazero::binding
