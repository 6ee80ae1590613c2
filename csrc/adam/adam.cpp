// megazero.ops._adam: CPU Adam/AdamW over many tensors (or segments of one flat buffer) in
// one pass, optionally with the fused-step extras (gradient scale, non-finite masking, a
// bf16/fp16 copy of the updated parameter), and the float64 sum of squares behind the global
// gradient norm.
//
// Buffers arrive as raw addresses (torch's tensor.data_ptr()) with sizes and dtype codes; no
// libtorch link, so the extension survives torch upgrades. The Python faces
// (megazero/ops/cpu_adam.py, megazero/ops/fused_step.py) check devices, dtypes, sizes and
// contiguity before calling. The SIMD level is picked at load time from the CPU and can be
// forced with set_simd_level(); threads come from the caller (torch.get_num_threads()).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "adam_api.h"
#include "megazero/cpu_dispatch.h"

namespace py = pybind11;
using megazero::WorkUnit;
using megazero::adam::AdamConsts;
using megazero::adam::AdamSpan;

namespace {

megazero::adam::AdamUnitsFn adam_fn(int level) {
  switch (level) {
#if defined(__x86_64__)
    case megazero::kAvx512Bf16: return megazero::adam::adam_units_avx512bf16;
    case megazero::kAvx512: return megazero::adam::adam_units_avx512;
    case megazero::kAvx2: return megazero::adam::adam_units_avx2;
#endif
    default: return megazero::adam::adam_units_scalar;
  }
}

megazero::adam::SumsqUnitsFn sumsq_fn(int level) {
  switch (level) {
#if defined(__x86_64__)
    case megazero::kAvx512Bf16:  // no bf16 stores in a sum: same code as AVX-512
    case megazero::kAvx512: return megazero::adam::sumsq_units_avx512;
    case megazero::kAvx2: return megazero::adam::sumsq_units_avx2;
#endif
    default: return megazero::adam::sumsq_units_scalar;
  }
}

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

void* addr(int64_t v) { return reinterpret_cast<void*>(static_cast<uintptr_t>(v)); }

void check_dtype(int dt, bool allow_none, const char* what) {
  if ((dt == megazero::kNone && allow_none) || dt == megazero::kF32 || dt == megazero::kBF16 ||
      dt == megazero::kF16) {
    return;
  }
  throw std::invalid_argument(std::string("unsupported dtype code for ") + what);
}

// See adam_kernel.h for the exact arithmetic. Returns true if a non-finite scaled gradient was
// met (only checked with mask_nonfinite, which then leaves those elements unchanged).
bool adam_update(const std::vector<int64_t>& params, const std::vector<int64_t>& grads,
                 const std::vector<int64_t>& exp_avgs, const std::vector<int64_t>& exp_avg_sqs,
                 const std::vector<int64_t>& copies, const std::vector<int64_t>& sizes,
                 const std::vector<double>& weight_decays, int param_dtype, int grad_dtype,
                 int copy_dtype, double lr, double beta1, double beta2, double eps,
                 double step_size, double bc2_sqrt, double grad_scale, bool adam_w_mode,
                 bool mask_nonfinite, int num_threads) {
  const size_t n = params.size();
  if (grads.size() != n || exp_avgs.size() != n || exp_avg_sqs.size() != n ||
      sizes.size() != n || weight_decays.size() != n) {
    throw std::invalid_argument("adam_update: per-span lists differ in length");
  }
  check_dtype(param_dtype, false, "params");
  check_dtype(grad_dtype, false, "grads");
  check_dtype(copy_dtype, true, "copies");
  if (copy_dtype != megazero::kNone && (param_dtype != megazero::kF32 || copies.size() != n)) {
    throw std::invalid_argument("adam_update: copies need fp32 params and one copy per span");
  }
  AdamConsts c;
  c.beta1 = static_cast<float>(beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.eps = static_cast<float>(eps);
  c.step_size = static_cast<float>(step_size);
  c.bc2_sqrt = static_cast<float>(bc2_sqrt);
  c.grad_scale = static_cast<float>(grad_scale);
  c.adam_w_mode = adam_w_mode;
  c.mask_nonfinite = mask_nonfinite;
  c.param_dtype = param_dtype;
  c.grad_dtype = grad_dtype;
  c.copy_dtype = copy_dtype;
  int64_t total = 0;
  for (int64_t sz : sizes) total += sz;
  c.stream_copy = total * 2 >= stream_min_bytes();
  std::vector<AdamSpan> spans(n);
  for (size_t k = 0; k < n; ++k) {
    spans[k] = {addr(params[k]), addr(grads[k]), static_cast<float*>(addr(exp_avgs[k])),
                static_cast<float*>(addr(exp_avg_sqs[k])),
                copy_dtype == megazero::kNone ? nullptr : addr(copies[k]),
                static_cast<float>(weight_decays[k]),
                static_cast<float>(1.0 - lr * weight_decays[k])};
  }
  const std::vector<WorkUnit> units = megazero::make_units(sizes);
  const auto fn = adam_fn(megazero::active_simd_level());
  py::gil_scoped_release release;
  return megazero::parallel_units(units, num_threads, [&](int64_t lo, int64_t hi) {
    return fn(c, spans.data(), units.data(), lo, hi);
  });
}

// Sum of squares of each buffer in float64; inf/NaN when a buffer holds inf/NaN. The result
// does not depend on the thread count or the SIMD level (fixed block and lane order).
std::vector<double> sum_squares(const std::vector<int64_t>& ptrs,
                                const std::vector<int64_t>& sizes, int dtype, int num_threads) {
  if (ptrs.size() != sizes.size()) throw std::invalid_argument("sum_squares: length mismatch");
  check_dtype(dtype, false, "sum_squares");
  std::vector<const void*> spans(ptrs.size());
  for (size_t k = 0; k < ptrs.size(); ++k) spans[k] = addr(ptrs[k]);
  const std::vector<WorkUnit> units = megazero::make_units(sizes);
  std::vector<double> partial(units.size(), 0.0);
  const auto fn = sumsq_fn(megazero::active_simd_level());
  {
    py::gil_scoped_release release;
    megazero::parallel_units(units, num_threads, [&](int64_t lo, int64_t hi) {
      fn(dtype, spans.data(), units.data(), lo, hi, partial.data());
      return false;
    });
  }
  std::vector<double> out(ptrs.size(), 0.0);
  for (size_t u = 0; u < units.size(); ++u) out[units[u].span] += partial[u];
  return out;
}

}  // namespace

PYBIND11_MODULE(_adam, m) {
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
  m.def("simd_level", [] { return std::string(megazero::simd_level_name(
                               megazero::active_simd_level())); });
  m.def("set_simd_level", &megazero::set_simd_level, py::arg("name"),
        "Force a SIMD level ('scalar', 'avx2', 'avx512', 'avx512_bf16') or 'auto'.");
  m.def("supported_simd_levels", &megazero::supported_simd_levels);
  m.def("openmp_max_threads", &megazero::openmp_max_threads);
}
