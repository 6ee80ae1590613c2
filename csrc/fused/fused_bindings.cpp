// pybind11 module megazero.ops._fused: the fused model ops on CPU (bias+GELU,
// bias+dropout+residual-add, LayerNorm, scaled upper-triangular masked softmax; RMSNorm,
// bias+SwiGLU and RoPE for the Llama family).
//
// Functions take raw addresses (tensor.data_ptr()) and sizes from the Python faces in
// megazero/ops/fused_*.py, never torch objects, so the module does not link libtorch. The
// kernel table is chosen per call from the active SIMD level (megazero/cpu_dispatch.h: the
// best the CPU supports; set_simd_level() forces one, tests force every level, and
// MEGAZERO_SIMD is applied by megazero.ops._cpu_ext on load, as for the optimizer extensions).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "fused_common.h"
#include "megazero/binding.h"
#include "megazero/cpu_dispatch.h"

namespace py = pybind11;
using namespace megazero_fused;

namespace {

const KernelTable* const kTables[] = MZ_SIMD_TABLES(megazero_fused, kTable);

const KernelTable& table() { return megazero::active_table(kTables); }

template <class T>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

int threads(int n) { return n > 0 ? n : 1; }

DropoutArgs dropout_args(uint64_t seed, uint64_t offset, uint32_t threshold, float scale,
                         bool enabled) {
  return DropoutArgs{seed, offset, threshold, scale, enabled};
}

}  // namespace

PYBIND11_MODULE(_fused, m) {
  m.doc() = "megazero fused model ops (CPU): raw-pointer kernels with run-time SIMD dispatch";
  auto nogil = py::call_guard<py::gil_scoped_release>();

  megazero::binding::def_simd_functions(m);

  m.def(
      "bias_gelu_fwd",
      [](uintptr_t x, uintptr_t bias, uintptr_t y, int64_t rows, int64_t cols, int dt, int nt) {
        table().bias_gelu_fwd(ptr<const void>(x), ptr<const void>(bias), ptr<void>(y), rows,
                              cols, dt, threads(nt));
      },
      nogil, "y[r, c] = gelu_tanh(x[r, c] + bias[c]); bias address 0 means no bias");
  m.def(
      "bias_gelu_bwd",
      [](uintptr_t dy, uintptr_t x, uintptr_t bias, uintptr_t dx, uintptr_t dbias, int64_t rows,
         int64_t cols, int dt, int nt) {
        std::vector<float> scratch(bias ? static_cast<size_t>(threads(nt) * cols) : 0);
        table().bias_gelu_bwd(ptr<const void>(dy), ptr<const void>(x), ptr<const void>(bias),
                              ptr<void>(dx), ptr<void>(dbias), scratch.data(), rows, cols, dt,
                              threads(nt));
      },
      nogil, "dx = dy * gelu_tanh'(x + bias); dbias = dx summed over rows");
  m.def(
      "bias_dropout_add_fwd",
      [](uintptr_t x, uintptr_t bias, uintptr_t residual, uintptr_t out, int64_t rows,
         int64_t cols, uint64_t seed, uint32_t threshold, float scale, bool enabled, int dt,
         int nt, uint64_t offset) {
        table().bias_dropout_add_fwd(ptr<const void>(x), ptr<const void>(bias),
                                     ptr<const void>(residual), ptr<void>(out), rows, cols,
                                     dropout_args(seed, offset, threshold, scale, enabled), dt,
                                     threads(nt));
      },
      py::arg("x"), py::arg("bias"), py::arg("residual"), py::arg("out"), py::arg("rows"),
      py::arg("cols"), py::arg("seed"), py::arg("threshold"), py::arg("scale"),
      py::arg("enabled"), py::arg("dtype"), py::arg("nthreads"), py::arg("offset") = 0, nogil,
      "out = residual + mask(seed, offset + index) * scale * (x + bias)");
  m.def(
      "bias_dropout_add_bwd",
      [](uintptr_t dy, uintptr_t dx, uintptr_t dbias, int64_t rows, int64_t cols, uint64_t seed,
         uint32_t threshold, float scale, bool enabled, int dt, int nt, uint64_t offset) {
        std::vector<float> scratch(dbias ? static_cast<size_t>(threads(nt) * cols) : 0);
        table().bias_dropout_add_bwd(ptr<const void>(dy), ptr<void>(dx), ptr<void>(dbias),
                                     scratch.data(), rows, cols,
                                     dropout_args(seed, offset, threshold, scale, enabled), dt,
                                     threads(nt));
      },
      py::arg("dy"), py::arg("dx"), py::arg("dbias"), py::arg("rows"), py::arg("cols"),
      py::arg("seed"), py::arg("threshold"), py::arg("scale"), py::arg("enabled"),
      py::arg("dtype"), py::arg("nthreads"), py::arg("offset") = 0, nogil,
      "dx = dy * mask(seed, offset + index) * scale (mask regenerated); dbias = sum of dx");
  m.def(
      "layer_norm_fwd",
      [](uintptr_t x, uintptr_t w, uintptr_t b, uintptr_t y, uintptr_t mean, uintptr_t rstd,
         int64_t rows, int64_t h, float eps, int dt, int wdt, int nt) {
        table().layer_norm_fwd(ptr<const void>(x), ptr<const void>(w), ptr<const void>(b),
                               ptr<void>(y), ptr<float>(mean), ptr<float>(rstd), rows, h, eps,
                               dt, wdt, threads(nt));
      },
      nogil, "y = (x - mean) * rstd * w + b per row of h; writes fp32 mean and rstd");
  m.def(
      "layer_norm_bwd",
      [](uintptr_t dy, uintptr_t x, uintptr_t mean, uintptr_t rstd, uintptr_t w, uintptr_t dx,
         uintptr_t dw, uintptr_t db, int64_t rows, int64_t h, int dt, int wdt, int nt) {
        std::vector<float> scratch(dw ? static_cast<size_t>(threads(nt) * 2 * h) : 0);
        table().layer_norm_bwd(ptr<const void>(dy), ptr<const void>(x), ptr<const float>(mean),
                               ptr<const float>(rstd), ptr<const void>(w), ptr<void>(dx),
                               ptr<void>(dw), ptr<void>(db), scratch.data(), rows, h, dt, wdt,
                               threads(nt));
      },
      nogil, "LayerNorm backward: dx, and dw/db (both or neither; dw address 0 = neither)");
  m.def(
      "softmax_fwd",
      [](uintptr_t x, uintptr_t y, int64_t batches, int64_t sq, int64_t sk, float scale, int dt,
         int nt) {
        std::vector<float> scratch(dt == kFloat32 ? 0 : static_cast<size_t>(threads(nt) * sk));
        table().softmax_fwd(ptr<const void>(x), ptr<void>(y), scratch.data(), batches, sq, sk,
                            scale, dt, threads(nt));
      },
      nogil, "causal softmax(scale * x) over [batches, sq, sk]; row i keeps columns 0..i");
  m.def(
      "softmax_bwd",
      [](uintptr_t dy, uintptr_t y, uintptr_t dx, int64_t batches, int64_t sq, int64_t sk,
         float scale, int dt, int nt) {
        table().softmax_bwd(ptr<const void>(dy), ptr<const void>(y), ptr<void>(dx), batches, sq,
                            sk, scale, dt, threads(nt));
      },
      nogil, "dx = scale * y * (dy - sum(dy * y)) on the unmasked part, 0 elsewhere");
  m.def(
      "rms_norm_fwd",
      [](uintptr_t x, uintptr_t w, uintptr_t y, uintptr_t rstd, int64_t rows, int64_t h,
         float eps, int dt, int nt) {
        table().rms_norm_fwd(ptr<const void>(x), ptr<const void>(w), ptr<void>(y),
                             ptr<float>(rstd), rows, h, eps, dt, threads(nt));
      },
      nogil, "y = x * rstd * w per row of h (w in x's dtype); writes fp32 rstd");
  m.def(
      "rms_norm_bwd",
      [](uintptr_t dy, uintptr_t x, uintptr_t rstd, uintptr_t w, uintptr_t dx, uintptr_t dw,
         int64_t rows, int64_t h, int dt, int nt) {
        std::vector<float> scratch(dw ? static_cast<size_t>(threads(nt) * h) : 0);
        table().rms_norm_bwd(ptr<const void>(dy), ptr<const void>(x), ptr<const float>(rstd),
                             ptr<const void>(w), ptr<void>(dx), ptr<void>(dw), scratch.data(),
                             rows, h, dt, threads(nt));
      },
      nogil, "RMSNorm backward: dx, and dw summed over rows (dw address 0: not wanted)");
  m.def(
      "swiglu_fwd",
      [](uintptr_t y, uintptr_t bias, uintptr_t out, int64_t rows, int64_t f, int dt, int nt) {
        table().swiglu_fwd(ptr<const void>(y), ptr<const void>(bias), ptr<void>(out), rows, f,
                           dt, threads(nt));
      },
      nogil, "out[r, j] = silu(g) * u, (g, u) = y[r, 2j:2j+2] + bias; bias address 0: none");
  m.def(
      "swiglu_bwd",
      [](uintptr_t dout, uintptr_t y, uintptr_t bias, uintptr_t dy, uintptr_t dbias,
         int64_t rows, int64_t f, int dt, int nt) {
        std::vector<float> scratch(dbias ? static_cast<size_t>(threads(nt) * 2 * f) : 0);
        table().swiglu_bwd(ptr<const void>(dout), ptr<const void>(y), ptr<const void>(bias),
                           ptr<void>(dy), ptr<void>(dbias), scratch.data(), rows, f, dt,
                           threads(nt));
      },
      nogil, "SwiGLU backward: dy [rows, 2f] interleaved, dbias = dy summed over rows");
  m.def(
      "rope",
      [](uintptr_t t, uintptr_t cos, uintptr_t sin, uintptr_t out, std::vector<int64_t> sizes,
         std::vector<int64_t> strides, bool backward, int dt, int nt) {
        if (sizes.size() != 5 || strides.size() != 10)
          throw std::invalid_argument("rope: sizes (b, heads, s, hn, rot) and 10 strides");
        const int64_t* st = strides.data();
        const RopeDims d{sizes[0], sizes[1], sizes[2], sizes[3], sizes[4], st[0], st[1],
                         st[2], st[3], st[4], st[5], st[6], st[7], st[8], st[9]};
        py::gil_scoped_release release;
        table().rope(ptr<const void>(t), ptr<const void>(cos), ptr<const void>(sin),
                     ptr<void>(out), d, backward, dt, threads(nt));
      },
      "RoPE (rotate half) of t [b, heads, s, hn] on its first rot dims; sizes (b, heads, s, "
      "hn, rot), strides (t: b, heads, s; out: b, heads, s; cos: b, s; sin: b, s); backward: "
      "the gradient of t from the output's");
}
