// Bias + GELU, bias + dropout + residual add, bias + SwiGLU (forward and backward) and the
// column sum that finishes a bias gradient: CUDA kernels over rows of [rows, cols] tensors.
//
// Every kernel tiles the same way: a block of 32 x 8 threads; threadIdx.x picks VEC consecutive
// columns (one 16-byte pack, or VEC = 1 where rows are not 16-byte aligned), blockIdx.x the
// 32 * VEC columns of the block, blockIdx.y a chunk of rows, which the block's 8 row lanes walk
// (row lane y takes rows y, y + 8, ...). A thread loads its bias columns once and reuses them on
// every row. Arithmetic is fp32 whatever the storage dtype.
//
// A backward that also wants the bias gradient sums its fp32 gradients over the rows of its
// chunk: per thread in registers, then over the 8 row lanes in shared memory in a fixed order,
// into partials[chunk, cols]; column_sum adds the chunks in order (a second launch: no atomics,
// the same bits every run).
#include "cuda_common.cuh"
#include "cuda_math.cuh"
#include "fused_cuda.h"

namespace megazero_cuda {
namespace {

constexpr int kTx = 32;     // column lanes of a block
constexpr int kTy = 8;      // row lanes of a block
constexpr int kMaxW = 16;   // most fp32 partial columns per thread (SwiGLU: 2 packs of 8)

// The part of the [rows, cols] tensor this thread owns: columns col..col+VEC of the rows
// r0, r0 + kTy, ... below r1.
struct Tile {
  int64_t col, r0, r1;
};

template <int VEC>
__device__ __forceinline__ Tile tile(int64_t rows, int64_t rows_per_chunk) {
  Tile t;
  t.col = (static_cast<int64_t>(blockIdx.x) * kTx + threadIdx.x) * VEC;
  const int64_t start = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  t.r0 = start + threadIdx.y;
  t.r1 = min(rows, start + rows_per_chunk);
  return t;
}

// partials[blockIdx.y, col + k] = sum over the block's row lanes of acc[k] (lanes in order);
// called by every thread of the block (a barrier inside). W <= kMaxW.
template <int W>
__device__ __forceinline__ void write_partials(const float (&acc)[W], float* partials,
                                               int64_t cols, int64_t col) {
  __shared__ float red[kTy][kTx * kMaxW];
#pragma unroll
  for (int k = 0; k < W; ++k) red[threadIdx.y][threadIdx.x * W + k] = acc[k];
  __syncthreads();
  if (threadIdx.y != 0) return;
#pragma unroll
  for (int k = 0; k < W; ++k) {
    float s = 0.0f;
#pragma unroll
    for (int y = 0; y < kTy; ++y) s += red[y][threadIdx.x * W + k];
    if (col + k < cols) partials[static_cast<int64_t>(blockIdx.y) * cols + col + k] = s;
  }
}

template <class T, int N>
__device__ __forceinline__ void load_or_zero(const T* p, float* out) {
  if (p) {
    load_f32<T, N>(p, out);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = 0.0f;
  }
}

// ---------------------------------------------------------------------------- bias + GELU
template <class T, int VEC>
__global__ void bias_gelu_fwd_kernel(const T* __restrict__ x, const T* __restrict__ bias,
                                     T* __restrict__ y, int64_t rows, int64_t cols,
                                     int64_t rows_per_chunk) {
  const Tile t = tile<VEC>(rows, rows_per_chunk);
  if (t.col >= cols) return;
  float b[VEC];
  load_or_zero<T, VEC>(bias ? bias + t.col : nullptr, b);
  for (int64_t r = t.r0; r < t.r1; r += kTy) {
    const int64_t off = r * cols + t.col;
    float v[VEC];
    load_f32<T, VEC>(x + off, v);
#pragma unroll
    for (int k = 0; k < VEC; ++k) v[k] = gelu_fwd(v[k] + b[k]);
    store_f32<T, VEC>(y + off, v);
  }
}

// dx = dy * gelu'(x + bias); partials of dbias when `partials` is given.
template <class T, int VEC>
__global__ void bias_gelu_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                     const T* __restrict__ bias, T* __restrict__ dx,
                                     float* __restrict__ partials, int64_t rows, int64_t cols,
                                     int64_t rows_per_chunk) {
  const Tile t = tile<VEC>(rows, rows_per_chunk);
  float acc[VEC] = {};
  if (t.col < cols) {
    float b[VEC];
    load_or_zero<T, VEC>(bias ? bias + t.col : nullptr, b);
    for (int64_t r = t.r0; r < t.r1; r += kTy) {
      const int64_t off = r * cols + t.col;
      float v[VEC], g[VEC];
      load_f32<T, VEC>(x + off, v);
      load_f32<T, VEC>(dy + off, g);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        g[k] *= gelu_grad(v[k] + b[k]);
        acc[k] += g[k];
      }
      store_f32<T, VEC>(dx + off, g);
    }
  }
  if (partials) write_partials<VEC>(acc, partials, cols, t.col);
}

// ------------------------------------------------------------- bias + dropout + residual add
// m[k] = scale or 0: the dropout multipliers of flat elements i0 .. i0 + VEC.
template <int VEC>
__device__ __forceinline__ void dropout_mults(uint64_t i0, const DropoutArgs& d,
                                              float (&m)[VEC]) {
  const uint32_t key0 = dropout_key(d.seed, static_cast<uint32_t>(i0 >> 32));
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    const uint64_t i = i0 + k;  // a pack may straddle a multiple of 2^32: that lane's own key
    const uint32_t hi = static_cast<uint32_t>(i >> 32);
    const uint32_t key = hi == static_cast<uint32_t>(i0 >> 32) ? key0 : dropout_key(d.seed, hi);
    m[k] = dropout_keep(i, key, d.threshold) ? d.scale : 0.0f;
  }
}

// out = residual + mask * scale * (x + bias) (mask of the flat index), or residual + x + bias.
template <class T, int VEC>
__global__ void bias_dropout_add_fwd_kernel(const T* __restrict__ x, const T* __restrict__ bias,
                                            const T* __restrict__ res, T* __restrict__ out,
                                            int64_t rows, int64_t cols, DropoutArgs d,
                                            int64_t rows_per_chunk) {
  const Tile t = tile<VEC>(rows, rows_per_chunk);
  if (t.col >= cols) return;
  float b[VEC];
  load_or_zero<T, VEC>(bias ? bias + t.col : nullptr, b);
  for (int64_t r = t.r0; r < t.r1; r += kTy) {
    const int64_t off = r * cols + t.col;
    float v[VEC], base[VEC];
    load_f32<T, VEC>(x + off, v);
    load_f32<T, VEC>(res + off, base);
    if (d.enabled) {
      float m[VEC];
      dropout_mults<VEC>(static_cast<uint64_t>(off), d, m);
#pragma unroll
      for (int k = 0; k < VEC; ++k) v[k] = (v[k] + b[k]) * m[k] + base[k];
    } else {
#pragma unroll
      for (int k = 0; k < VEC; ++k) v[k] = (v[k] + b[k]) + base[k];
    }
    store_f32<T, VEC>(out + off, v);
  }
}

// dx = dy * mask * scale (the mask regenerated from the seed); partials of dbias if given.
template <class T, int VEC>
__global__ void bias_dropout_add_bwd_kernel(const T* __restrict__ dy, T* __restrict__ dx,
                                            float* __restrict__ partials, int64_t rows,
                                            int64_t cols, DropoutArgs d,
                                            int64_t rows_per_chunk) {
  const Tile t = tile<VEC>(rows, rows_per_chunk);
  float acc[VEC] = {};
  if (t.col < cols) {
    for (int64_t r = t.r0; r < t.r1; r += kTy) {
      const int64_t off = r * cols + t.col;
      float g[VEC], m[VEC];
      load_f32<T, VEC>(dy + off, g);
      dropout_mults<VEC>(static_cast<uint64_t>(off), d, m);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        g[k] *= m[k];
        acc[k] += g[k];
      }
      store_f32<T, VEC>(dx + off, g);
    }
  }
  if (partials) write_partials<VEC>(acc, partials, cols, t.col);
}

// --------------------------------------------------------------------------- bias + SwiGLU
// Rows of y are [f, (gate, up)] interleaved: a thread owns outputs j..j+VEC of a row, that is
// the 2 * VEC inputs 2j..2j+2VEC (two packs).
template <class T, int VEC>
__global__ void swiglu_fwd_kernel(const T* __restrict__ y, const T* __restrict__ bias,
                                  T* __restrict__ out, int64_t rows, int64_t f,
                                  int64_t rows_per_chunk) {
  const Tile t = tile<VEC>(rows, rows_per_chunk);
  if (t.col >= f) return;
  float b[2 * VEC];
  load_or_zero<T, VEC>(bias ? bias + 2 * t.col : nullptr, b);
  load_or_zero<T, VEC>(bias ? bias + 2 * t.col + VEC : nullptr, b + VEC);
  for (int64_t r = t.r0; r < t.r1; r += kTy) {
    const T* yr = y + r * 2 * f + 2 * t.col;
    float in[2 * VEC], o[VEC];
    load_f32<T, VEC>(yr, in);
    load_f32<T, VEC>(yr + VEC, in + VEC);
#pragma unroll
    for (int k = 0; k < VEC; ++k)
      o[k] = silu_mul(in[2 * k] + b[2 * k], in[2 * k + 1] + b[2 * k + 1]);
    store_f32<T, VEC>(out + r * f + t.col, o);
  }
}

// dy (interleaved as y) from dout; partials of dbias over the 2f columns if given.
template <class T, int VEC>
__global__ void swiglu_bwd_kernel(const T* __restrict__ dout, const T* __restrict__ y,
                                  const T* __restrict__ bias, T* __restrict__ dy,
                                  float* __restrict__ partials, int64_t rows, int64_t f,
                                  int64_t rows_per_chunk) {
  const Tile t = tile<VEC>(rows, rows_per_chunk);
  float acc[2 * VEC] = {};
  if (t.col < f) {
    float b[2 * VEC];
    load_or_zero<T, VEC>(bias ? bias + 2 * t.col : nullptr, b);
    load_or_zero<T, VEC>(bias ? bias + 2 * t.col + VEC : nullptr, b + VEC);
    for (int64_t r = t.r0; r < t.r1; r += kTy) {
      const int64_t in_off = r * 2 * f + 2 * t.col;
      float in[2 * VEC], d[VEC], g[2 * VEC];
      load_f32<T, VEC>(y + in_off, in);
      load_f32<T, VEC>(y + in_off + VEC, in + VEC);
      load_f32<T, VEC>(dout + r * f + t.col, d);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        silu_mul_grad(in[2 * k] + b[2 * k], in[2 * k + 1] + b[2 * k + 1], d[k], &g[2 * k],
                      &g[2 * k + 1]);
      }
#pragma unroll
      for (int k = 0; k < 2 * VEC; ++k) acc[k] += g[k];
      store_f32<T, VEC>(dy + in_off, g);
      store_f32<T, VEC>(dy + in_off + VEC, g + VEC);
    }
  }
  if (partials) write_partials<2 * VEC>(acc, partials, 2 * f, 2 * t.col);
}

// ------------------------------------------------------------------------------ column sum
template <class T>
__global__ void column_sum_kernel(const float* __restrict__ partials, T* __restrict__ out,
                                  int64_t chunks, int64_t cols) {
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < cols;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s = 0.0f;
    for (int64_t k = 0; k < chunks; ++k) s += partials[k * cols + c];
    out[c] = from_f32<T>(s);
  }
}

// ------------------------------------------------------------------------------- launching
// Grid of the tiled kernels: column blocks of 32 * vec columns by `chunks` row chunks.
struct Launch {
  dim3 grid, block;
  int64_t rows_per_chunk;
};

Launch tiled(int64_t rows, int64_t cols, int vec, int64_t chunks) {
  if (chunks <= 0) chunks = row_chunks(rows);
  // exactly `chunks` row chunks (the partials have that many rows); the last ones may be
  // empty (rows 8200 in 256 chunks of 33), and then write zero partials
  const int64_t per_chunk = (rows + chunks - 1) / chunks;
  const int64_t col_blocks = (cols + kTx * vec - 1) / (kTx * vec);
  return {dim3(static_cast<unsigned>(col_blocks), static_cast<unsigned>(chunks)),
          dim3(kTx, kTy), per_chunk};
}

#define MZ_TILED(KERNEL, T, VEC, ROWS, COLS, CHUNKS, STREAM, ...)                        \
  do {                                                                                    \
    const Launch l = tiled(ROWS, COLS, VEC, CHUNKS);                                      \
    KERNEL<T, VEC><<<l.grid, l.block, 0, STREAM>>>(__VA_ARGS__, l.rows_per_chunk);        \
  } while (0)

}  // namespace

int64_t row_chunks(int64_t rows) {
  const int64_t chunks = (rows + kMinChunkRows - 1) / kMinChunkRows;
  return chunks < 1 ? 1 : (chunks > kMaxChunks ? kMaxChunks : chunks);
}

cudaError_t bias_gelu_fwd(const void* x, const void* bias, void* y, int64_t rows, int64_t cols,
                          int dt, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  MZ_DISPATCH(dt, T, {
    const T* xp = static_cast<const T*>(x);
    const T* bp = static_cast<const T*>(bias);
    T* yp = static_cast<T*>(y);
    if (packs_fit<T>(cols, x, bias, y))
      MZ_TILED(bias_gelu_fwd_kernel, T, kVec<T>, rows, cols, 0, stream, xp, bp, yp, rows, cols);
    else
      MZ_TILED(bias_gelu_fwd_kernel, T, 1, rows, cols, 0, stream, xp, bp, yp, rows, cols);
  });
  return cudaGetLastError();
}

cudaError_t bias_gelu_bwd(const void* dy, const void* x, const void* bias, void* dx,
                          float* partials, int64_t chunks, int64_t rows, int64_t cols, int dt,
                          cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  MZ_DISPATCH(dt, T, {
    const T* dyp = static_cast<const T*>(dy);
    const T* xp = static_cast<const T*>(x);
    const T* bp = static_cast<const T*>(bias);
    T* dxp = static_cast<T*>(dx);
    if (packs_fit<T>(cols, dy, x, bias, dx))
      MZ_TILED(bias_gelu_bwd_kernel, T, kVec<T>, rows, cols, chunks, stream, dyp, xp, bp, dxp,
               partials, rows, cols);
    else
      MZ_TILED(bias_gelu_bwd_kernel, T, 1, rows, cols, chunks, stream, dyp, xp, bp, dxp,
               partials, rows, cols);
  });
  return cudaGetLastError();
}

cudaError_t bias_dropout_add_fwd(const void* x, const void* bias, const void* residual, void* out,
                                 int64_t rows, int64_t cols, DropoutArgs d, int dt,
                                 cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  MZ_DISPATCH(dt, T, {
    const T* xp = static_cast<const T*>(x);
    const T* bp = static_cast<const T*>(bias);
    const T* rp = static_cast<const T*>(residual);
    T* op = static_cast<T*>(out);
    if (packs_fit<T>(cols, x, bias, residual, out))
      MZ_TILED(bias_dropout_add_fwd_kernel, T, kVec<T>, rows, cols, 0, stream, xp, bp, rp, op,
               rows, cols, d);
    else
      MZ_TILED(bias_dropout_add_fwd_kernel, T, 1, rows, cols, 0, stream, xp, bp, rp, op, rows,
               cols, d);
  });
  return cudaGetLastError();
}

cudaError_t bias_dropout_add_bwd(const void* dy, void* dx, float* partials, int64_t chunks,
                                 int64_t rows, int64_t cols, DropoutArgs d, int dt,
                                 cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  MZ_DISPATCH(dt, T, {
    const T* dyp = static_cast<const T*>(dy);
    T* dxp = static_cast<T*>(dx);
    if (packs_fit<T>(cols, dy, dx))
      MZ_TILED(bias_dropout_add_bwd_kernel, T, kVec<T>, rows, cols, chunks, stream, dyp, dxp,
               partials, rows, cols, d);
    else
      MZ_TILED(bias_dropout_add_bwd_kernel, T, 1, rows, cols, chunks, stream, dyp, dxp,
               partials, rows, cols, d);
  });
  return cudaGetLastError();
}

cudaError_t swiglu_fwd(const void* y, const void* bias, void* out, int64_t rows, int64_t f,
                       int dt, cudaStream_t stream) {
  if (rows == 0 || f == 0) return cudaSuccess;
  MZ_DISPATCH(dt, T, {
    const T* yp = static_cast<const T*>(y);
    const T* bp = static_cast<const T*>(bias);
    T* op = static_cast<T*>(out);
    if (packs_fit<T>(f, y, bias, out))
      MZ_TILED(swiglu_fwd_kernel, T, kVec<T>, rows, f, 0, stream, yp, bp, op, rows, f);
    else
      MZ_TILED(swiglu_fwd_kernel, T, 1, rows, f, 0, stream, yp, bp, op, rows, f);
  });
  return cudaGetLastError();
}

cudaError_t swiglu_bwd(const void* dout, const void* y, const void* bias, void* dy,
                       float* partials, int64_t chunks, int64_t rows, int64_t f, int dt,
                       cudaStream_t stream) {
  if (rows == 0 || f == 0) return cudaSuccess;
  MZ_DISPATCH(dt, T, {
    const T* dp = static_cast<const T*>(dout);
    const T* yp = static_cast<const T*>(y);
    const T* bp = static_cast<const T*>(bias);
    T* dyp = static_cast<T*>(dy);
    if (packs_fit<T>(f, dout, y, bias, dy))
      MZ_TILED(swiglu_bwd_kernel, T, kVec<T>, rows, f, chunks, stream, dp, yp, bp, dyp,
               partials, rows, f);
    else
      MZ_TILED(swiglu_bwd_kernel, T, 1, rows, f, chunks, stream, dp, yp, bp, dyp, partials,
               rows, f);
  });
  return cudaGetLastError();
}

cudaError_t column_sum(const float* partials, void* out, int64_t chunks, int64_t cols, int dt,
                       cudaStream_t stream) {
  if (cols == 0) return cudaSuccess;
  const unsigned grid = grid_for(cols, 256);
  MZ_DISPATCH(dt, T, (column_sum_kernel<T><<<grid, 256, 0, stream>>>(
      partials, static_cast<T*>(out), chunks, cols)));
  return cudaGetLastError();
}

}  // namespace megazero_cuda
