// megazero.ops._lamb: CPU LAMB in two passes over many tensors (or segments of one flat
// buffer). Stage 1 updates the moments and returns, per span, the float64 sums of squares of
// the parameter and of the Adam-style update; the caller turns them into trust ratios (after
// an all-reduce, for ZeRO partitions); stage 2 applies p -= lr * trust_ratio * update and
// writes the optional bf16/fp16 copy. See lamb_kernel.h for the arithmetic and
// megazero/ops/cpu_lamb.py for the Python face and the PyTorch reference.
//
// Buffers arrive as raw addresses with sizes and dtype codes (no libtorch link). Units of a
// span are summed in order, so the sums do not depend on the thread count or SIMD level.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "lamb_api.h"
#include "megazero/cpu_dispatch.h"

namespace py = pybind11;
using megazero::WorkUnit;
using megazero::lamb::LambConsts;
using megazero::lamb::LambSpan;

namespace {

megazero::lamb::Stage1Fn stage1_fn(int level) {
  switch (level) {
#if defined(__x86_64__)
    case megazero::kAvx512Bf16: return megazero::lamb::lamb_stage1_avx512bf16;
    case megazero::kAvx512: return megazero::lamb::lamb_stage1_avx512;
    case megazero::kAvx2: return megazero::lamb::lamb_stage1_avx2;
#endif
    default: return megazero::lamb::lamb_stage1_scalar;
  }
}

megazero::lamb::Stage2Fn stage2_fn(int level) {
  switch (level) {
#if defined(__x86_64__)
    case megazero::kAvx512Bf16: return megazero::lamb::lamb_stage2_avx512bf16;
    case megazero::kAvx512: return megazero::lamb::lamb_stage2_avx512;
    case megazero::kAvx2: return megazero::lamb::lamb_stage2_avx2;
#endif
    default: return megazero::lamb::lamb_stage2_scalar;
  }
}

void* addr(int64_t v) { return reinterpret_cast<void*>(static_cast<uintptr_t>(v)); }

void check_dtype(int dt, bool allow_none, const char* what) {
  if ((dt == megazero::kNone && allow_none) || dt == megazero::kF32 || dt == megazero::kBF16 ||
      dt == megazero::kF16) {
    return;
  }
  throw std::invalid_argument(std::string("unsupported dtype code for ") + what);
}

LambConsts make_consts(double beta1, double beta2, double eps, double bc1, double bc2,
                       double grad_scale, bool mask_nonfinite, int param_dtype, int grad_dtype,
                       int copy_dtype) {
  LambConsts c;
  c.beta1 = static_cast<float>(beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.eps = static_cast<float>(eps);
  c.bc1 = static_cast<float>(bc1);
  c.bc2 = static_cast<float>(bc2);
  c.grad_scale = static_cast<float>(grad_scale);
  c.mask_nonfinite = mask_nonfinite;
  c.param_dtype = param_dtype;
  c.grad_dtype = grad_dtype;
  c.copy_dtype = copy_dtype;
  return c;
}

// Returns (w_sq per span, u_sq per span, found_nonfinite).
std::tuple<std::vector<double>, std::vector<double>, bool> lamb_stage1(
    const std::vector<int64_t>& params, const std::vector<int64_t>& grads,
    const std::vector<int64_t>& exp_avgs, const std::vector<int64_t>& exp_avg_sqs,
    const std::vector<int64_t>& sizes, const std::vector<double>& weight_decays,
    int param_dtype, int grad_dtype, double beta1, double beta2, double eps, double bc1,
    double bc2, double grad_scale, bool mask_nonfinite, int num_threads) {
  const size_t n = params.size();
  if (grads.size() != n || exp_avgs.size() != n || exp_avg_sqs.size() != n ||
      sizes.size() != n || weight_decays.size() != n) {
    throw std::invalid_argument("lamb_stage1: per-span lists differ in length");
  }
  check_dtype(param_dtype, false, "params");
  check_dtype(grad_dtype, false, "grads");
  const LambConsts c = make_consts(beta1, beta2, eps, bc1, bc2, grad_scale, mask_nonfinite,
                                   param_dtype, grad_dtype, megazero::kNone);
  std::vector<LambSpan> spans(n);
  for (size_t k = 0; k < n; ++k) {
    spans[k] = {addr(params[k]), addr(grads[k]), static_cast<float*>(addr(exp_avgs[k])),
                static_cast<float*>(addr(exp_avg_sqs[k])), nullptr,
                static_cast<float>(weight_decays[k]), 0.0f};
  }
  const std::vector<WorkUnit> units = megazero::make_units(sizes);
  std::vector<double> w_part(units.size(), 0.0), u_part(units.size(), 0.0);
  const auto fn = stage1_fn(megazero::active_simd_level());
  bool found;
  {
    py::gil_scoped_release release;
    found = megazero::parallel_units(units, num_threads, [&](int64_t lo, int64_t hi) {
      return fn(c, spans.data(), units.data(), lo, hi, w_part.data(), u_part.data());
    });
  }
  std::vector<double> w_sq(n, 0.0), u_sq(n, 0.0);
  for (size_t u = 0; u < units.size(); ++u) {
    w_sq[units[u].span] += w_part[u];
    u_sq[units[u].span] += u_part[u];
  }
  return {w_sq, u_sq, found};
}

void lamb_stage2(const std::vector<int64_t>& params, const std::vector<int64_t>& exp_avgs,
                 const std::vector<int64_t>& exp_avg_sqs, const std::vector<int64_t>& copies,
                 const std::vector<int64_t>& sizes, const std::vector<double>& weight_decays,
                 const std::vector<double>& scales, int param_dtype, int copy_dtype,
                 double beta1, double beta2, double eps, double bc1, double bc2,
                 int num_threads) {
  const size_t n = params.size();
  if (exp_avgs.size() != n || exp_avg_sqs.size() != n || sizes.size() != n ||
      weight_decays.size() != n || scales.size() != n) {
    throw std::invalid_argument("lamb_stage2: per-span lists differ in length");
  }
  check_dtype(param_dtype, false, "params");
  check_dtype(copy_dtype, true, "copies");
  if (copy_dtype != megazero::kNone && (param_dtype != megazero::kF32 || copies.size() != n)) {
    throw std::invalid_argument("lamb_stage2: copies need fp32 params and one copy per span");
  }
  const LambConsts c = make_consts(beta1, beta2, eps, bc1, bc2, 1.0, false, param_dtype,
                                   megazero::kF32, copy_dtype);
  std::vector<LambSpan> spans(n);
  for (size_t k = 0; k < n; ++k) {
    spans[k] = {addr(params[k]), nullptr, static_cast<float*>(addr(exp_avgs[k])),
                static_cast<float*>(addr(exp_avg_sqs[k])),
                copy_dtype == megazero::kNone ? nullptr : addr(copies[k]),
                static_cast<float>(weight_decays[k]), static_cast<float>(scales[k])};
  }
  const std::vector<WorkUnit> units = megazero::make_units(sizes);
  const auto fn = stage2_fn(megazero::active_simd_level());
  py::gil_scoped_release release;
  megazero::parallel_units(units, num_threads, [&](int64_t lo, int64_t hi) {
    fn(c, spans.data(), units.data(), lo, hi);
    return false;
  });
}

}  // namespace

PYBIND11_MODULE(_lamb, m) {
  m.doc() = "megazero CPU LAMB (two stages: moments + norms, then the trust-ratio update)";
  m.def("lamb_stage1", &lamb_stage1, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"),
        py::arg("exp_avg_sqs"), py::arg("sizes"), py::arg("weight_decays"),
        py::arg("param_dtype"), py::arg("grad_dtype"), py::arg("beta1"), py::arg("beta2"),
        py::arg("eps"), py::arg("bc1"), py::arg("bc2"), py::arg("grad_scale"),
        py::arg("mask_nonfinite"), py::arg("num_threads"));
  m.def("lamb_stage2", &lamb_stage2, py::arg("params"), py::arg("exp_avgs"),
        py::arg("exp_avg_sqs"), py::arg("copies"), py::arg("sizes"), py::arg("weight_decays"),
        py::arg("scales"), py::arg("param_dtype"), py::arg("copy_dtype"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("bc1"), py::arg("bc2"),
        py::arg("num_threads"));
  m.def("simd_level", [] { return std::string(megazero::simd_level_name(
                               megazero::active_simd_level())); });
  m.def("set_simd_level", &megazero::set_simd_level, py::arg("name"),
        "Force a SIMD level ('scalar', 'avx2', 'avx512', 'avx512_bf16') or 'auto'.");
  m.def("supported_simd_levels", &megazero::supported_simd_levels);
  m.def("openmp_max_threads", &megazero::openmp_max_threads);
}
