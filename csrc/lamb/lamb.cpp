// megazero.ops._lamb: CPU LAMB in two passes over many tensors (or segments of one flat
// buffer). Stage 1 updates the moments and returns, per span, the float64 sums of squares of
// the parameter and of the Adam-style update; the caller turns them into trust ratios (after
// an all-reduce, for ZeRO partitions); stage 2 applies p -= lr * trust_ratio * update and
// writes the optional bf16/fp16 copy. See lamb_simd.cpp for the arithmetic and
// megazero/ops/cpu_lamb.py for the Python face and the PyTorch reference.
//
// Buffers arrive as raw addresses with sizes and dtype codes (megazero/binding.h). Units of a
// span are summed in order, so the sums do not depend on the thread count or SIMD level.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "lamb_api.h"
#include "megazero/binding.h"
#include "megazero/cpu_dispatch.h"

namespace megazero::lamb {
namespace {

const LambKernels* const kTables[] = MZ_SIMD_TABLES(megazero::lamb, kKernels);

// Returns (w_sq per span, u_sq per span, found_nonfinite).
std::tuple<std::vector<double>, std::vector<double>, bool> lamb_stage1(
    const std::vector<int64_t>& params, const std::vector<int64_t>& grads,
    const std::vector<int64_t>& exp_avgs, const std::vector<int64_t>& exp_avg_sqs,
    const std::vector<int64_t>& sizes, const std::vector<double>& weight_decays,
    int param_dtype, int grad_dtype, double beta1, double beta2, double eps, double bc1,
    double bc2, double grad_scale, bool mask_nonfinite, int num_threads) {
  const size_t n = params.size();
  binding::check_lengths("lamb_stage1", n, {grads.size(), exp_avgs.size(),
                                            exp_avg_sqs.size(), sizes.size(),
                                            weight_decays.size()});
  binding::check_dtype(param_dtype, false, "params");
  binding::check_dtype(grad_dtype, false, "grads");
  const LambConsts c{binding::moment_consts(beta1, beta2, eps, grad_scale, mask_nonfinite,
                                            param_dtype, grad_dtype, kNone),
                     static_cast<float>(bc1), static_cast<float>(bc2)};
  std::vector<LambSpan> spans(n);
  for (size_t k = 0; k < n; ++k) {
    spans[k] = binding::span_buffers<LambSpan>(k, params, grads, exp_avgs, exp_avg_sqs, {});
    spans[k].weight_decay = static_cast<float>(weight_decays[k]);
  }
  const std::vector<WorkUnit> units = make_units(sizes);
  std::vector<double> w_part(units.size(), 0.0), u_part(units.size(), 0.0);
  const LambKernels& kernels = active_table(kTables);
  const bool found = binding::run_units(units, num_threads, [&](int64_t lo, int64_t hi) {
    return kernels.stage1(c, spans.data(), units.data(), lo, hi, w_part.data(), u_part.data());
  });
  return {binding::sum_by_span(units, w_part, n), binding::sum_by_span(units, u_part, n),
          found};
}

void lamb_stage2(const std::vector<int64_t>& params, const std::vector<int64_t>& exp_avgs,
                 const std::vector<int64_t>& exp_avg_sqs, const std::vector<int64_t>& copies,
                 const std::vector<int64_t>& sizes, const std::vector<double>& weight_decays,
                 const std::vector<double>& scales, int param_dtype, int copy_dtype,
                 double beta1, double beta2, double eps, double bc1, double bc2,
                 int num_threads) {
  const size_t n = params.size();
  binding::check_lengths("lamb_stage2", n, {exp_avgs.size(), exp_avg_sqs.size(),
                                            sizes.size(), weight_decays.size(),
                                            scales.size()});
  binding::check_dtype(param_dtype, false, "params");
  binding::check_copies("lamb_stage2", param_dtype, copy_dtype, copies.size(), n);
  const LambConsts c{binding::moment_consts(beta1, beta2, eps, 1.0, false, param_dtype, kF32,
                                            copy_dtype),
                     static_cast<float>(bc1), static_cast<float>(bc2)};
  std::vector<LambSpan> spans(n);
  for (size_t k = 0; k < n; ++k) {
    spans[k] = binding::span_buffers<LambSpan>(k, params, {}, exp_avgs, exp_avg_sqs, copies);
    spans[k].weight_decay = static_cast<float>(weight_decays[k]);
    spans[k].scale = static_cast<float>(scales[k]);
  }
  const std::vector<WorkUnit> units = make_units(sizes);
  const LambKernels& kernels = active_table(kTables);
  binding::run_units(units, num_threads, [&](int64_t lo, int64_t hi) {
    kernels.stage2(c, spans.data(), units.data(), lo, hi);
    return false;
  });
}

}  // namespace
}  // namespace megazero::lamb

PYBIND11_MODULE(_lamb, m) {
  namespace py = pybind11;
  using namespace megazero::lamb;
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
  megazero::binding::def_simd_functions(m);
}
