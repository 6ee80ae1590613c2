// torch binding of the fused-op CUDA kernels: megazero.ops._fused_cuda (LayerNorm and causal
// softmax, forward and backward). Checks devices, dtypes and contiguity, allocates outputs
// with torch's caching allocator, and launches on the current stream; the kernels themselves
// are raw-pointer code in layer_norm_cuda.cu and softmax_cuda.cu.
// Lean torch headers (not torch/extension.h): the binding compiles in a third of the time.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <vector>

#include "fused_cuda.h"

namespace {

int dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return megazero_cuda::kFloat32;
    case at::kBFloat16: return megazero_cuda::kBFloat16;
    case at::kHalf: return megazero_cuda::kFloat16;
    default: TORCH_CHECK(false, "megazero fused CUDA ops take fp32, bf16 or fp16, got ",
                         t.scalar_type());
  }
  return 0;
}

void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

const void* opt_ptr(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr() : nullptr;
}

void check(cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, "megazero CUDA kernel failed: ", cudaGetErrorString(err));
}

// x [rows, h] -> (y [rows, h], mean [rows], rstd [rows])
std::vector<at::Tensor> layer_norm_fwd(const at::Tensor& x, const std::optional<at::Tensor>& w,
                                       const std::optional<at::Tensor>& b, double eps) {
  check_cuda(x, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t h = x.size(-1), rows = h ? x.numel() / h : 0;
  int wdt = dtype_code(x);
  if (w) {
    check_cuda(*w, "weight");
    TORCH_CHECK(w->numel() == h, "weight must have ", h, " elements");
    wdt = dtype_code(*w);
  }
  if (b) {
    TORCH_CHECK(w, "bias needs a weight");
    check_cuda(*b, "bias");
    TORCH_CHECK(b->numel() == h && b->scalar_type() == w->scalar_type(), "bad bias");
  }
  auto y = at::empty_like(x);
  auto stats = x.new_empty({2, rows}, x.options().dtype(at::kFloat));
  check(megazero_cuda::layer_norm_fwd(
      x.data_ptr(), opt_ptr(w), opt_ptr(b), y.data_ptr(), stats[0].data_ptr<float>(),
      stats[1].data_ptr<float>(), rows, h, static_cast<float>(eps), dtype_code(x), wdt,
      c10::cuda::getCurrentCUDAStream().stream()));
  return {y, stats[0], stats[1]};
}

// -> (dx, dw, db); dw/db undefined without a weight
std::vector<at::Tensor> layer_norm_bwd(const at::Tensor& dy, const at::Tensor& x,
                                       const at::Tensor& mean, const at::Tensor& rstd,
                                       const std::optional<at::Tensor>& w) {
  check_cuda(dy, "dy");
  check_cuda(x, "x");
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type(), "dy/x mismatch");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t h = x.size(-1), rows = h ? x.numel() / h : 0;
  auto dx = at::empty_like(x);
  at::Tensor dw, db, scratch;
  int wdt = dtype_code(x);
  if (w) {
    check_cuda(*w, "weight");
    wdt = dtype_code(*w);
    dw = at::empty_like(*w);
    db = at::empty_like(*w);
    scratch = x.new_empty({megazero_cuda::layer_norm_bwd_scratch(rows, h)},
                          x.options().dtype(at::kFloat));
  }
  check(megazero_cuda::layer_norm_bwd(
      dy.data_ptr(), x.data_ptr(), mean.data_ptr<float>(), rstd.data_ptr<float>(), opt_ptr(w),
      dx.data_ptr(), w ? dw.data_ptr() : nullptr, w ? db.data_ptr() : nullptr,
      w ? scratch.data_ptr<float>() : nullptr, rows, h, dtype_code(x), wdt,
      c10::cuda::getCurrentCUDAStream().stream()));
  return {dx, dw, db};
}

// scores [..., sq, sk] -> probabilities of the same shape
at::Tensor softmax_fwd(const at::Tensor& x, double scale) {
  check_cuda(x, "scores");
  TORCH_CHECK(x.dim() >= 2, "scores must be [..., sq, sk]");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t sq = x.size(-2), sk = x.size(-1);
  auto y = at::empty_like(x);
  const int64_t batches = sq * sk != 0 ? x.numel() / (sq * sk) : 0;
  check(megazero_cuda::causal_softmax_fwd(x.data_ptr(), y.data_ptr(), batches, sq, sk,
                                          static_cast<float>(scale), dtype_code(x),
                                          c10::cuda::getCurrentCUDAStream().stream()));
  return y;
}

at::Tensor softmax_bwd(const at::Tensor& dy, const at::Tensor& y, double scale) {
  check_cuda(dy, "dy");
  check_cuda(y, "y");
  TORCH_CHECK(dy.sizes() == y.sizes() && dy.scalar_type() == y.scalar_type(), "dy/y mismatch");
  const c10::cuda::CUDAGuard guard(y.device());
  const int64_t sq = y.size(-2), sk = y.size(-1);
  auto dx = at::empty_like(y);
  check(megazero_cuda::causal_softmax_bwd(
      dy.data_ptr(), y.data_ptr(), dx.data_ptr(), sq * sk != 0 ? y.numel() / (sq * sk) : 0, sq, sk,
      static_cast<float>(scale), dtype_code(y), c10::cuda::getCurrentCUDAStream().stream()));
  return dx;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megazero fused model ops (CUDA): LayerNorm and causal softmax";
  m.def("layer_norm_fwd", &layer_norm_fwd, "LayerNorm forward -> (y, mean, rstd)");
  m.def("layer_norm_bwd", &layer_norm_bwd, "LayerNorm backward -> (dx, dw, db)");
  m.def("softmax_fwd", &softmax_fwd, "scaled upper-triangular masked softmax forward");
  m.def("softmax_bwd", &softmax_bwd, "scaled upper-triangular masked softmax backward");
}
