// megazero.ops._adam: CPU Adam/AdamW over many tensors (or segments of one flat buffer) in
// one pass, optionally with the fused-step extras (gradient scale, non-finite masking, a
// bf16/fp16 copy of the updated parameter), and the float64 sum of squares behind the global
// gradient norm.
//
// Buffers arrive as raw addresses with sizes and dtype codes (megazero/binding.h). The Python
// faces (megazero/ops/cpu_adam.py, megazero/ops/fused_step.py) check devices, dtypes, sizes
// and contiguity before calling. The SIMD level is picked at load time from the CPU and can
// be forced with set_simd_level(); threads come from the caller (torch.get_num_threads()).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <vector>

#include "adam_api.h"
#include "megazero/binding.h"
#include "megazero/cpu_dispatch.h"

namespace megazero::adam {
namespace {

const AdamKernels* const kTables[] = MZ_SIMD_TABLES(megazero::adam, kKernels);

// A 16-bit copy of at least this many bytes per call is written with non-temporal stores:
// it would not stay in the caches anyway, and streaming saves reading its lines first.
int64_t& stream_min_bytes() {
  static int64_t bytes = int64_t{16} << 20;
  return bytes;
}

// Sets the streaming threshold (tests, tuning); returns the previous one.
int64_t set_stream_min_bytes(int64_t bytes) {
  const int64_t previous = stream_min_bytes();
  stream_min_bytes() = bytes;
  return previous;
}

// See adam_simd.cpp for the exact arithmetic. Returns true if a non-finite scaled gradient was
// met (only checked with mask_nonfinite, which then leaves those elements unchanged).
bool adam_update(const std::vector<int64_t>& params, const std::vector<int64_t>& grads,
                 const std::vector<int64_t>& exp_avgs, const std::vector<int64_t>& exp_avg_sqs,
                 const std::vector<int64_t>& copies, const std::vector<int64_t>& sizes,
                 const std::vector<double>& weight_decays, int param_dtype, int grad_dtype,
                 int copy_dtype, double lr, double beta1, double beta2, double eps,
                 double step_size, double bc2_sqrt, double grad_scale, bool adam_w_mode,
                 bool mask_nonfinite, int num_threads) {
  const size_t n = params.size();
  binding::check_lengths("adam_update", n, {grads.size(), exp_avgs.size(),
                                            exp_avg_sqs.size(), sizes.size(),
                                            weight_decays.size()});
  binding::check_dtype(param_dtype, false, "params");
  binding::check_dtype(grad_dtype, false, "grads");
  binding::check_copies("adam_update", param_dtype, copy_dtype, copies.size(), n);
  int64_t total = 0;
  for (int64_t sz : sizes) total += sz;
  const AdamConsts c{binding::moment_consts(beta1, beta2, eps, grad_scale, mask_nonfinite,
                                            param_dtype, grad_dtype, copy_dtype),
                     static_cast<float>(step_size), static_cast<float>(bc2_sqrt), adam_w_mode,
                     total * 2 >= stream_min_bytes()};
  std::vector<AdamSpan> spans(n);
  for (size_t k = 0; k < n; ++k) {
    spans[k] = binding::span_buffers<AdamSpan>(k, params, grads, exp_avgs, exp_avg_sqs, copies);
    spans[k].weight_decay = static_cast<float>(weight_decays[k]);
    spans[k].decay = static_cast<float>(1.0 - lr * weight_decays[k]);
  }
  const std::vector<WorkUnit> units = make_units(sizes);
  const AdamKernels& kernels = active_table(kTables);
  return binding::run_units(units, num_threads, [&](int64_t lo, int64_t hi) {
    return kernels.update(c, spans.data(), units.data(), lo, hi);
  });
}

// Sum of squares of each buffer in float64; inf/NaN when a buffer holds inf/NaN. The result
// does not depend on the thread count or the SIMD level (fixed block and lane order).
std::vector<double> sum_squares(const std::vector<int64_t>& ptrs,
                                const std::vector<int64_t>& sizes, int dtype, int num_threads) {
  binding::check_lengths("sum_squares", ptrs.size(), {sizes.size()});
  binding::check_dtype(dtype, false, "sum_squares");
  std::vector<const void*> spans(ptrs.size());
  for (size_t k = 0; k < ptrs.size(); ++k) spans[k] = binding::addr(ptrs[k]);
  const std::vector<WorkUnit> units = make_units(sizes);
  std::vector<double> partial(units.size(), 0.0);
  const AdamKernels& kernels = active_table(kTables);
  binding::run_units(units, num_threads, [&](int64_t lo, int64_t hi) {
    kernels.sum_squares(dtype, spans.data(), units.data(), lo, hi, partial.data());
    return false;
  });
  return binding::sum_by_span(units, partial, ptrs.size());
}

}  // namespace
}  // namespace megazero::adam

PYBIND11_MODULE(_adam, m) {
  namespace py = pybind11;
  using namespace megazero::adam;
  m.doc() = "megazero CPU Adam/AdamW, fused optimizer step and float64 sum of squares";
  m.def("adam_update", &adam_update, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"),
        py::arg("exp_avg_sqs"), py::arg("copies"), py::arg("sizes"), py::arg("weight_decays"),
        py::arg("param_dtype"), py::arg("grad_dtype"), py::arg("copy_dtype"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("step_size"),
        py::arg("bc2_sqrt"), py::arg("grad_scale"), py::arg("adam_w_mode"),
        py::arg("mask_nonfinite"), py::arg("num_threads"));
  m.def("sum_squares", &sum_squares, py::arg("ptrs"), py::arg("sizes"), py::arg("dtype"),
        py::arg("num_threads"));
  m.def("set_stream_min_bytes", &set_stream_min_bytes, py::arg("bytes"),
        "Copy size from which the bf16/fp16 copy bypasses the caches; returns the previous.");
  megazero::binding::def_simd_functions(m);
}
