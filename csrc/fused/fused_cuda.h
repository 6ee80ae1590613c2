// Host API of the fused model-op CUDA kernels (elementwise_cuda.cu, rope_cuda.cu,
// cross_entropy_cuda.cu, softmax_cuda.cu).
//
// Raw device pointers, sizes and a stream; no torch types, so the .cu files compile with plain
// nvcc (the nvcc test compiles them alone) and fused_cuda.cc is the only torch-aware file.
// dtype codes: 0 fp32, 1 bf16, 2 fp16. Buffers are contiguous unless strides are passed. Each
// function returns the launch's cudaError_t; each launches exactly one kernel (none when there
// is nothing to do).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace megazero_cuda {

enum DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// ---- bias gradients: backward kernels sum their fp32 gradients over chunks of rows into
// partials [chunks, cols]; column_sum adds the chunks in order into the bias gradient.
constexpr int64_t kMinChunkRows = 32;  // megazero/ops/cuda_elementwise.py: partial_rows
constexpr int64_t kMaxChunks = 256;

// Row chunks of a backward's partials: ceil(rows / 32), at most 256 (and at least 1).
int64_t row_chunks(int64_t rows);

cudaError_t column_sum(const float* partials, void* out, int64_t chunks, int64_t cols, int dt,
                       cudaStream_t stream);

// ---- bias + GELU (tanh): y = gelu(x + bias); dx = dy * gelu'(x + bias). bias may be null;
// partials (null: not wanted) take `chunks` rows (0: the kernel picks its own chunking).
cudaError_t bias_gelu_fwd(const void* x, const void* bias, void* y, int64_t rows, int64_t cols,
                          int dt, cudaStream_t stream);
cudaError_t bias_gelu_bwd(const void* dy, const void* x, const void* bias, void* dx,
                          float* partials, int64_t chunks, int64_t rows, int64_t cols, int dt,
                          cudaStream_t stream);

// ---- bias + dropout + residual add with the counter-based masks of cuda_math.cuh.
struct DropoutArgs {
  uint64_t seed;
  uint32_t threshold;  // drop element when hash < threshold
  float scale;         // 1 / (1 - p)
  bool enabled;        // false: out = residual + (x + bias)
};

cudaError_t bias_dropout_add_fwd(const void* x, const void* bias, const void* residual, void* out,
                                 int64_t rows, int64_t cols, DropoutArgs d, int dt,
                                 cudaStream_t stream);
// dx = dy * mask * scale (d.enabled is taken as true).
cudaError_t bias_dropout_add_bwd(const void* dy, void* dx, float* partials, int64_t chunks,
                                 int64_t rows, int64_t cols, DropoutArgs d, int dt,
                                 cudaStream_t stream);

// ---- bias + SwiGLU: y [rows, 2f] with (gate, up) interleaved, out [rows, f]; dy as y.
cudaError_t swiglu_fwd(const void* y, const void* bias, void* out, int64_t rows, int64_t f,
                       int dt, cudaStream_t stream);
cudaError_t swiglu_bwd(const void* dout, const void* y, const void* bias, void* dy,
                       float* partials, int64_t chunks, int64_t rows, int64_t f, int dt,
                       cudaStream_t stream);

// ---- RoPE. Sizes and element strides: t and out [b, heads, s, hn] (strides of b, heads, s;
// unit stride along hn), cos and sin [b, s, rot] (strides of b (0 when broadcast) and s).
struct RopeDims {
  int64_t b, heads, s, hn, rot;
  int64_t t_sb, t_sh, t_ss;
  int64_t o_sb, o_sh, o_ss;
  int64_t c_sb, c_ss;
  int64_t s_sb, s_ss;
};

cudaError_t rope(const void* t, const void* cos, const void* sin, void* out, RopeDims d,
                 bool backward, int dt, cudaStream_t stream);

// ---- vocabulary-parallel cross entropy over logits [rows, v] (columns from `valid` on are
// padding), target ids (int64) read at row_offset(row) = (row / inner) * s0 + (row % inner) * s1
// (a [s, b] view of any strides; 1-D: inner = rows, s0 = 0).
struct RowIndex {
  int64_t inner, s0, s1;
};

// One tp rank: loss, max and sum of exp(x - max) [rows] in one pass.
cudaError_t ce_fwd(const void* logits, const int64_t* target, RowIndex tix, int64_t rows,
                   int64_t v, int64_t valid, int64_t start, float* loss, float* max,
                   float* sum, int dt, cudaStream_t stream);
// Several: this shard's max (twice: kept, and to be all-reduced) and stats [3, rows] = (target
// logit or 0, sum of exp(x - local max), 1 where this shard holds the target).
cudaError_t ce_stats(const void* logits, const int64_t* target, RowIndex tix, int64_t rows,
                     int64_t v, int64_t valid, int64_t start, float* mloc, float* mred,
                     float* stats, int dt, cudaStream_t stream);
// out [2, rows] = (target logit - max (0 where not held), sum * exp(local max - max)).
cudaError_t ce_rescale(const float* mloc, const float* gmax, const float* stats, float* out,
                       int64_t rows, cudaStream_t stream);
// loss = log(reduced[1]) - reduced[0].
cudaError_t ce_loss(const float* reduced, float* loss, int64_t rows, cudaStream_t stream);
// dx = (exp(x - max) / sum - [column == target]) * grad (grad fp32, read like the target).
cudaError_t ce_bwd(const float* grad, RowIndex gix, const void* logits, const int64_t* target,
                   RowIndex tix, const float* gmax, const float* gsum, void* dx, int64_t rows,
                   int64_t v, int64_t valid, int64_t start, int dt, cudaStream_t stream);

// ---- causal softmax(scale * x) over [batches, sq, sk]: row i keeps columns 0..i, zeros after.
cudaError_t causal_softmax_fwd(const void* x, void* y, int64_t batches, int64_t sq, int64_t sk,
                               float scale, int dt, cudaStream_t stream);

// dx = scale * y * (dy - sum(dy * y)) on the kept part of each row, 0 elsewhere.
cudaError_t causal_softmax_bwd(const void* dy, const void* y, void* dx, int64_t batches,
                               int64_t sq, int64_t sk, float scale, int dt,
                               cudaStream_t stream);

}  // namespace megazero_cuda
