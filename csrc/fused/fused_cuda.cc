// torch binding of the fused-op CUDA kernels: megazero.ops._fused_cuda. The Python side
// (megazero/ops/cuda_*.py) allocates every output, so the fake implementations of its custom
// ops allocate exactly the same; the functions here check devices, dtypes, shapes and
// contiguity, then launch on the current stream. The kernels themselves are raw-pointer code
// in the .cu files of this folder (fused_cuda.h).
// Lean torch headers (not torch/extension.h): the binding compiles in a third of the time.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>

#include "fused_cuda.h"

namespace {

using OptTensor = std::optional<at::Tensor>;

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

// `t` is a contiguous CUDA tensor on like's device with like's dtype and `numel` elements.
void check_like(const at::Tensor& t, const at::Tensor& like, int64_t numel, const char* name) {
  check_cuda(t, name);
  TORCH_CHECK(t.device() == like.device(), name, " is on ", t.device(), ", expected ",
              like.device());
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " has dtype ", t.scalar_type(),
              ", expected ", like.scalar_type());
  TORCH_CHECK(t.numel() == numel, name, " has ", t.numel(), " elements, expected ", numel);
}

void check_f32(const at::Tensor& t, int64_t numel, const char* name) {
  check_cuda(t, name);
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be fp32");
  TORCH_CHECK(t.numel() == numel, name, " has ", t.numel(), " elements, expected ", numel);
}

const void* opt_ptr(const OptTensor& t) { return t ? t->data_ptr() : nullptr; }

// fp32 partials [chunks, cols] (0 chunks: not wanted -> null).
float* partials_ptr(const at::Tensor& p, int64_t cols) {
  if (p.numel() == 0) return nullptr;
  check_f32(p, p.size(0) * cols, "partials");
  TORCH_CHECK(p.dim() == 2 && p.size(1) == cols, "partials must be [chunks, ", cols, "]");
  TORCH_CHECK(p.size(0) <= megazero_cuda::kMaxChunks, "at most ", megazero_cuda::kMaxChunks,
              " chunks");
  return p.data_ptr<float>();
}

cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

void check(cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, "megazero CUDA kernel failed: ", cudaGetErrorString(err));
}

int64_t cols_of(const at::Tensor& x) { return x.dim() ? x.size(-1) : 1; }
int64_t rows_of(const at::Tensor& x) {
  const int64_t c = cols_of(x);
  return c ? x.numel() / c : 0;
}

void check_bias(const OptTensor& bias, const at::Tensor& x, int64_t cols) {
  if (bias) check_like(*bias, x, cols, "bias");
}

// ------------------------------------------------------------------ bias + GELU / SwiGLU
void bias_gelu_fwd(const at::Tensor& x, const OptTensor& bias, const at::Tensor& y) {
  check_cuda(x, "x");
  const int64_t cols = cols_of(x), rows = rows_of(x);
  check_bias(bias, x, cols);
  check_like(y, x, x.numel(), "y");
  const c10::cuda::CUDAGuard guard(x.device());
  check(megazero_cuda::bias_gelu_fwd(x.data_ptr(), opt_ptr(bias), y.data_ptr(), rows, cols,
                                     dtype_code(x), stream()));
}

void bias_gelu_bwd(const at::Tensor& dy, const at::Tensor& x, const OptTensor& bias,
                   const at::Tensor& dx, const at::Tensor& partials) {
  check_cuda(x, "x");
  const int64_t cols = cols_of(x), rows = rows_of(x);
  check_like(dy, x, x.numel(), "dy");
  check_bias(bias, x, cols);
  check_like(dx, x, x.numel(), "dx");
  const c10::cuda::CUDAGuard guard(x.device());
  check(megazero_cuda::bias_gelu_bwd(dy.data_ptr(), x.data_ptr(), opt_ptr(bias), dx.data_ptr(),
                                     partials_ptr(partials, cols), partials.size(0), rows, cols,
                                     dtype_code(x), stream()));
}

void swiglu_fwd(const at::Tensor& y, const OptTensor& bias, const at::Tensor& out) {
  check_cuda(y, "y");
  const int64_t two_f = cols_of(y), rows = rows_of(y);
  TORCH_CHECK(two_f % 2 == 0, "y's last dim must be even (gate, up pairs)");
  check_bias(bias, y, two_f);
  check_like(out, y, rows * two_f / 2, "out");
  const c10::cuda::CUDAGuard guard(y.device());
  check(megazero_cuda::swiglu_fwd(y.data_ptr(), opt_ptr(bias), out.data_ptr(), rows, two_f / 2,
                                  dtype_code(y), stream()));
}

void swiglu_bwd(const at::Tensor& dout, const at::Tensor& y, const OptTensor& bias,
                const at::Tensor& dy, const at::Tensor& partials) {
  check_cuda(y, "y");
  const int64_t two_f = cols_of(y), rows = rows_of(y);
  TORCH_CHECK(two_f % 2 == 0, "y's last dim must be even (gate, up pairs)");
  check_like(dout, y, rows * two_f / 2, "dout");
  check_bias(bias, y, two_f);
  check_like(dy, y, y.numel(), "dy");
  const c10::cuda::CUDAGuard guard(y.device());
  check(megazero_cuda::swiglu_bwd(dout.data_ptr(), y.data_ptr(), opt_ptr(bias), dy.data_ptr(),
                                  partials_ptr(partials, two_f), partials.size(0), rows,
                                  two_f / 2, dtype_code(y), stream()));
}

void column_sum(const at::Tensor& partials, const at::Tensor& out) {
  check_cuda(out, "out");
  const int64_t cols = out.numel();
  TORCH_CHECK(partials.dim() == 2 && partials.size(1) == cols && partials.size(0) > 0,
              "partials must be [chunks > 0, ", cols, "]");
  check_f32(partials, partials.numel(), "partials");
  TORCH_CHECK(partials.device() == out.device(), "partials and out on different devices");
  const c10::cuda::CUDAGuard guard(out.device());
  check(megazero_cuda::column_sum(partials.data_ptr<float>(), out.data_ptr(), partials.size(0),
                                  cols, dtype_code(out), stream()));
}

// --------------------------------------------------------------- bias + dropout + residual
megazero_cuda::DropoutArgs dropout_args(int64_t seed, int64_t threshold, double scale,
                                        bool enabled) {
  TORCH_CHECK(threshold >= 0 && threshold <= 0xffffffffLL, "threshold must fit 32 bits");
  return {static_cast<uint64_t>(seed), static_cast<uint32_t>(threshold),
          static_cast<float>(scale), enabled};
}

void bias_dropout_add_fwd(const at::Tensor& x, const OptTensor& bias, const at::Tensor& residual,
                          const at::Tensor& out, int64_t seed, int64_t threshold, double scale,
                          bool enabled) {
  check_cuda(x, "x");
  const int64_t cols = cols_of(x), rows = rows_of(x);
  check_bias(bias, x, cols);
  check_like(residual, x, x.numel(), "residual");
  check_like(out, x, x.numel(), "out");
  const c10::cuda::CUDAGuard guard(x.device());
  check(megazero_cuda::bias_dropout_add_fwd(x.data_ptr(), opt_ptr(bias), residual.data_ptr(),
                                            out.data_ptr(), rows, cols,
                                            dropout_args(seed, threshold, scale, enabled),
                                            dtype_code(x), stream()));
}

void bias_dropout_add_bwd(const at::Tensor& dy, const at::Tensor& dx, const at::Tensor& partials,
                          int64_t seed, int64_t threshold, double scale) {
  check_cuda(dy, "dy");
  const int64_t cols = cols_of(dy), rows = rows_of(dy);
  check_like(dx, dy, dy.numel(), "dx");
  const c10::cuda::CUDAGuard guard(dy.device());
  check(megazero_cuda::bias_dropout_add_bwd(dy.data_ptr(), dx.data_ptr(),
                                            partials_ptr(partials, cols), partials.size(0), rows,
                                            cols, dropout_args(seed, threshold, scale, true),
                                            dtype_code(dy), stream()));
}

// ----------------------------------------------------------------------------------- RoPE
// t, out [b, heads, s, hn] (unit stride along hn), cos/sin [b, 1, s, rot] (unit stride on rot)
void rope(const at::Tensor& t, const at::Tensor& cos, const at::Tensor& sin,
          const at::Tensor& out, bool backward) {
  TORCH_CHECK(t.is_cuda() && t.dim() == 4 && t.stride(3) == 1, "t must be [b, heads, s, hn] "
              "on CUDA with a unit stride along hn");
  TORCH_CHECK(out.sizes() == t.sizes() && out.stride(3) == 1 && out.device() == t.device() &&
              out.scalar_type() == t.scalar_type(), "out must be shaped as t");
  const int64_t b = t.size(0), s = t.size(2), hn = t.size(3), rot = cos.size(-1);
  for (const at::Tensor* c : {&cos, &sin}) {
    TORCH_CHECK(c->is_cuda() && c->device() == t.device() && c->scalar_type() == t.scalar_type(),
                "cos/sin must be CUDA tensors of t's dtype on its device");
    TORCH_CHECK(c->dim() == 4 && c->size(0) == b && c->size(1) == 1 && c->size(2) == s &&
                c->size(3) == rot && c->stride(3) == 1, "cos/sin must be [b, 1, s, rot]");
  }
  TORCH_CHECK(rot > 0 && rot % 2 == 0 && rot <= hn, "rot must be even and in (0, hn]");
  const megazero_cuda::RopeDims d{b, t.size(1), s, hn, rot,
                                  t.stride(0), t.stride(1), t.stride(2),
                                  out.stride(0), out.stride(1), out.stride(2),
                                  cos.stride(0), cos.stride(2), sin.stride(0), sin.stride(2)};
  const c10::cuda::CUDAGuard guard(t.device());
  check(megazero_cuda::rope(t.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), d,
                            backward, dtype_code(t), stream()));
}

// ------------------------------------------------------------------------- cross entropy
// (inner, s0, s1): where row r's value of an int64/fp32 [rows] quantity lies (see fused_cuda.h)
megazero_cuda::RowIndex row_index(const at::Tensor& t, int64_t rows, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.numel() == rows, name, " must be a CUDA tensor of ", rows,
              " elements");
  if (t.dim() == 2) return {t.size(1) ? t.size(1) : 1, t.stride(0), t.stride(1)};
  TORCH_CHECK(t.dim() == 1, name, " must be 1-D or 2-D");
  return {rows ? rows : 1, 0, t.stride(0)};
}

void check_logits(const at::Tensor& logits, const at::Tensor& target, int64_t start,
                  int64_t valid) {
  check_cuda(logits, "logits");
  TORCH_CHECK(target.scalar_type() == at::kLong && target.device() == logits.device(),
              "target must be int64 on the logits' device");
  TORCH_CHECK(start >= 0 && valid >= 0 && valid <= cols_of(logits), "bad start/valid");
}

void ce_fwd(const at::Tensor& logits, const at::Tensor& target, int64_t start, int64_t valid,
            const at::Tensor& loss, const at::Tensor& max, const at::Tensor& sum) {
  check_logits(logits, target, start, valid);
  const int64_t v = cols_of(logits), rows = rows_of(logits);
  for (const at::Tensor* t : {&loss, &max, &sum}) check_f32(*t, rows, "loss/max/sum");
  const c10::cuda::CUDAGuard guard(logits.device());
  check(megazero_cuda::ce_fwd(logits.data_ptr(), target.data_ptr<int64_t>(),
                              row_index(target, rows, "target"), rows, v, valid, start,
                              loss.data_ptr<float>(), max.data_ptr<float>(),
                              sum.data_ptr<float>(), dtype_code(logits), stream()));
}

void ce_stats(const at::Tensor& logits, const at::Tensor& target, int64_t start, int64_t valid,
              const at::Tensor& mloc, const at::Tensor& mred, const at::Tensor& stats) {
  check_logits(logits, target, start, valid);
  const int64_t v = cols_of(logits), rows = rows_of(logits);
  check_f32(mloc, rows, "max_local");
  check_f32(mred, rows, "max");
  check_f32(stats, 3 * rows, "stats");
  const c10::cuda::CUDAGuard guard(logits.device());
  check(megazero_cuda::ce_stats(logits.data_ptr(), target.data_ptr<int64_t>(),
                                row_index(target, rows, "target"), rows, v, valid, start,
                                mloc.data_ptr<float>(), mred.data_ptr<float>(),
                                stats.data_ptr<float>(), dtype_code(logits), stream()));
}

void ce_rescale(const at::Tensor& mloc, const at::Tensor& gmax, const at::Tensor& stats,
                const at::Tensor& out) {
  const int64_t rows = mloc.numel();
  check_f32(mloc, rows, "max_local");
  check_f32(gmax, rows, "max");
  check_f32(stats, 3 * rows, "stats");
  check_f32(out, 2 * rows, "out");
  const c10::cuda::CUDAGuard guard(mloc.device());
  check(megazero_cuda::ce_rescale(mloc.data_ptr<float>(), gmax.data_ptr<float>(),
                                  stats.data_ptr<float>(), out.data_ptr<float>(), rows,
                                  stream()));
}

void ce_loss(const at::Tensor& reduced, const at::Tensor& loss) {
  const int64_t rows = loss.numel();
  check_f32(reduced, 2 * rows, "reduced");
  check_f32(loss, rows, "loss");
  const c10::cuda::CUDAGuard guard(loss.device());
  check(megazero_cuda::ce_loss(reduced.data_ptr<float>(), loss.data_ptr<float>(), rows,
                               stream()));
}

void ce_bwd(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& target,
            const at::Tensor& gmax, const at::Tensor& gsum, int64_t start, int64_t valid,
            const at::Tensor& dx) {
  check_logits(logits, target, start, valid);
  const int64_t v = cols_of(logits), rows = rows_of(logits);
  TORCH_CHECK(grad.scalar_type() == at::kFloat && grad.device() == logits.device(),
              "grad must be fp32 on the logits' device");
  check_f32(gmax, rows, "max");
  TORCH_CHECK(gsum.is_cuda() && gsum.scalar_type() == at::kFloat && gsum.numel() == rows &&
              gsum.dim() == 1 && gsum.stride(0) == 1, "sum must be fp32 [rows], unit stride");
  check_like(dx, logits, logits.numel(), "dx");
  const c10::cuda::CUDAGuard guard(logits.device());
  check(megazero_cuda::ce_bwd(grad.data_ptr<float>(), row_index(grad, rows, "grad"),
                              logits.data_ptr(), target.data_ptr<int64_t>(),
                              row_index(target, rows, "target"), gmax.data_ptr<float>(),
                              gsum.data_ptr<float>(), dx.data_ptr(), rows, v, valid, start,
                              dtype_code(logits), stream()));
}

// ------------------------------------------------------------------------- causal softmax
// scores [..., sq, sk] -> probabilities y of the same shape
void softmax_fwd(const at::Tensor& x, double scale, const at::Tensor& y) {
  check_cuda(x, "scores");
  TORCH_CHECK(x.dim() >= 2, "scores must be [..., sq, sk]");
  check_like(y, x, x.numel(), "y");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t sq = x.size(-2), sk = x.size(-1);
  const int64_t batches = sq * sk != 0 ? x.numel() / (sq * sk) : 0;
  check(megazero_cuda::causal_softmax_fwd(x.data_ptr(), y.data_ptr(), batches, sq, sk,
                                          static_cast<float>(scale), dtype_code(x), stream()));
}

void softmax_bwd(const at::Tensor& dy, const at::Tensor& y, double scale, const at::Tensor& dx) {
  check_cuda(y, "y");
  TORCH_CHECK(y.dim() >= 2, "y must be [..., sq, sk]");
  check_like(dy, y, y.numel(), "dy");
  check_like(dx, y, y.numel(), "dx");
  const c10::cuda::CUDAGuard guard(y.device());
  const int64_t sq = y.size(-2), sk = y.size(-1);
  check(megazero_cuda::causal_softmax_bwd(
      dy.data_ptr(), y.data_ptr(), dx.data_ptr(), sq * sk != 0 ? y.numel() / (sq * sk) : 0, sq, sk,
      static_cast<float>(scale), dtype_code(y), stream()));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megazero fused model ops (CUDA): bias-GELU, bias-dropout-add, bias-SwiGLU, RoPE, "
            "vocab-parallel cross entropy, causal softmax";
  m.attr("min_chunk_rows") = megazero_cuda::kMinChunkRows;
  m.attr("max_chunks") = megazero_cuda::kMaxChunks;
  m.def("bias_gelu_fwd", &bias_gelu_fwd, "y = gelu(x + bias)");
  m.def("bias_gelu_bwd", &bias_gelu_bwd, "dx (and dbias partials)");
  m.def("swiglu_fwd", &swiglu_fwd, "out = silu(gate) * up of y + bias");
  m.def("swiglu_bwd", &swiglu_bwd, "dy (and dbias partials)");
  m.def("column_sum", &column_sum, "out = partials summed over chunks");
  m.def("bias_dropout_add_fwd", &bias_dropout_add_fwd, "out = residual + dropout(x + bias)");
  m.def("bias_dropout_add_bwd", &bias_dropout_add_bwd, "dx (and dbias partials)");
  m.def("rope", &rope, "rotary embedding (or its backward) of t into out");
  m.def("ce_fwd", &ce_fwd, "cross entropy of one tp rank: loss, max, sum");
  m.def("ce_stats", &ce_stats, "cross entropy, tp > 1: local max, max, stats");
  m.def("ce_rescale", &ce_rescale, "cross entropy, tp > 1: stats on the global max");
  m.def("ce_loss", &ce_loss, "cross entropy, tp > 1: loss from the reduced stats");
  m.def("ce_bwd", &ce_bwd, "cross entropy backward: dlogits");
  m.def("softmax_fwd", &softmax_fwd, "scaled upper-triangular masked softmax forward");
  m.def("softmax_bwd", &softmax_bwd, "scaled upper-triangular masked softmax backward");
}
