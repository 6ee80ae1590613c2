// Scaled upper-triangular masked (causal) softmax forward/backward CUDA kernels.
//
// One warp per row of [batches, sq, sk]; row i of each matrix keeps columns 0..i. For
// sk <= 1024 the forward holds the row in registers (ITEMS = ceil(sk / 32) per lane, a
// template parameter, as Megatron's kernel does); longer rows take three passes over global
// memory. Masked columns are never exponentiated and are written as exact zeros.
#include <math_constants.h>

#include "cuda_common.cuh"
#include "fused_cuda.h"

namespace megazero_cuda {
namespace {

constexpr int kRowsPerBlock = 4;

// This warp's row of [rows = batches * sq, sk] and its unmasked column count n (row % sq + 1,
// at most sk); false for a warp past the last row.
__device__ __forceinline__ bool causal_row(int64_t rows, int sq, int sk, int64_t* row, int* n) {
  *row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (*row >= rows) return false;
  *n = min(static_cast<int>(*row % sq) + 1, sk);
  return true;
}

template <class T, int ITEMS>
__global__ void softmax_fwd_reg_kernel(const T* __restrict__ x, T* __restrict__ y,
                                       int64_t rows, int sq, int sk, float scale) {
  int64_t row;
  int n;
  if (!causal_row(rows, sq, sk, &row, &n)) return;
  const int lane = threadIdx.x;
  const T* xr = x + row * sk;
  float v[ITEMS];
  float mx = -CUDART_INF_F;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int c = lane + 32 * i;
    v[i] = c < n ? to_f32(xr[c]) * scale : -CUDART_INF_F;
    mx = fmaxf(mx, v[i]);
  }
  mx = warp_max(mx);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int c = lane + 32 * i;
    v[i] = c < n ? expf(v[i] - mx) : 0.f;
    s += v[i];
  }
  const float inv = 1.f / warp_sum(s);
  T* yr = y + row * sk;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int c = lane + 32 * i;
    if (c < sk) yr[c] = from_f32<T>(v[i] * inv);
  }
}

template <class T>
__global__ void softmax_fwd_loop_kernel(const T* __restrict__ x, T* __restrict__ y,
                                        int64_t rows, int sq, int sk, float scale) {
  int64_t row;
  int n;
  if (!causal_row(rows, sq, sk, &row, &n)) return;
  const int lane = threadIdx.x;
  const T* xr = x + row * sk;
  float mx = -CUDART_INF_F;
  for (int c = lane; c < n; c += 32) mx = fmaxf(mx, to_f32(xr[c]) * scale);
  mx = warp_max(mx);
  float s = 0.f;
  for (int c = lane; c < n; c += 32) s += expf(to_f32(xr[c]) * scale - mx);
  const float inv = 1.f / warp_sum(s);
  T* yr = y + row * sk;
  for (int c = lane; c < sk; c += 32)
    yr[c] = from_f32<T>(c < n ? expf(to_f32(xr[c]) * scale - mx) * inv : 0.f);
}

template <class T>
__global__ void softmax_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ y,
                                   T* __restrict__ dx, int64_t rows, int sq, int sk,
                                   float scale) {
  int64_t row;
  int n;
  if (!causal_row(rows, sq, sk, &row, &n)) return;
  const int lane = threadIdx.x;
  const T* dyr = dy + row * sk;
  const T* yr = y + row * sk;
  float dot = 0.f;
  for (int c = lane; c < n; c += 32) dot += to_f32(dyr[c]) * to_f32(yr[c]);
  dot = warp_sum(dot);
  T* dxr = dx + row * sk;
  for (int c = lane; c < sk; c += 32)
    dxr[c] = from_f32<T>(c < n ? scale * to_f32(yr[c]) * (to_f32(dyr[c]) - dot) : 0.f);
}

template <class T>
void launch_fwd(const T* x, T* y, int64_t rows, int sq, int sk, float scale, dim3 grid,
                dim3 block, cudaStream_t stream) {
#define MZ_REG(ITEMS) \
  softmax_fwd_reg_kernel<T, ITEMS><<<grid, block, 0, stream>>>(x, y, rows, sq, sk, scale)
  if (sk <= 32) MZ_REG(1);
  else if (sk <= 64) MZ_REG(2);
  else if (sk <= 128) MZ_REG(4);
  else if (sk <= 256) MZ_REG(8);
  else if (sk <= 512) MZ_REG(16);
  else if (sk <= 1024) MZ_REG(32);
  else softmax_fwd_loop_kernel<T><<<grid, block, 0, stream>>>(x, y, rows, sq, sk, scale);
#undef MZ_REG
}

}  // namespace

cudaError_t causal_softmax_fwd(const void* x, void* y, int64_t batches, int64_t sq, int64_t sk,
                               float scale, int dt, cudaStream_t stream) {
  const int64_t rows = batches * sq;
  if (rows == 0 || sk == 0) return cudaSuccess;
  const dim3 block(32, kRowsPerBlock);
  const dim3 grid(static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock));
  MZ_DISPATCH(dt, T, launch_fwd<T>(static_cast<const T*>(x), static_cast<T*>(y), rows,
                                   static_cast<int>(sq), static_cast<int>(sk), scale, grid,
                                   block, stream));
  return cudaGetLastError();
}

cudaError_t causal_softmax_bwd(const void* dy, const void* y, void* dx, int64_t batches,
                               int64_t sq, int64_t sk, float scale, int dt,
                               cudaStream_t stream) {
  const int64_t rows = batches * sq;
  if (rows == 0 || sk == 0) return cudaSuccess;
  const dim3 block(32, kRowsPerBlock);
  const dim3 grid(static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock));
  MZ_DISPATCH(dt, T, (softmax_bwd_kernel<T><<<grid, block, 0, stream>>>(
      static_cast<const T*>(dy), static_cast<const T*>(y), static_cast<T*>(dx), rows,
      static_cast<int>(sq), static_cast<int>(sk), scale)));
  return cudaGetLastError();
}

}  // namespace megazero_cuda
