// Vocabulary-parallel softmax cross entropy, CUDA: the logits [rows, v] (this rank's vocabulary
// shard, any float dtype) are read as they are, with fp32 math in registers; no fp32 copy of
// them is made.
//
// Forward, one block per row (grid-stride over rows): each thread keeps an online (max, sum of
// exp) pair over its columns (16-byte packs when rows are aligned), merged over the warp and the
// block. Columns from `valid` on (the padded vocabulary) are left out. With one tp rank,
// ce_fwd writes the loss, max and sum at once; with several, ce_stats writes this shard's
// (max, target logit, sum relative to its max, target-is-here flag), the caller all-reduces
// the max, ce_rescale puts the target logit and the sum on the global max, the caller
// all-reduces both, and ce_loss finishes: loss = log(sum) - (target logit - max).
// Backward, one block per row: grad = (exp(x - max) / sum - [c == target]) * grad_loss,
// written in the logits' dtype.
#include "cuda_common.cuh"
#include "cuda_math.cuh"
#include "fused_cuda.h"

namespace megazero_cuda {
namespace {

constexpr int kThreads = 512;

__device__ __forceinline__ int64_t row_offset(const RowIndex& ix, int64_t row) {
  return (row / ix.inner) * ix.s0 + (row % ix.inner) * ix.s1;
}

__device__ __forceinline__ MaxSum warp_merge(MaxSum a) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const MaxSum b{__shfl_xor_sync(0xffffffffu, a.m, o), __shfl_xor_sync(0xffffffffu, a.s, o)};
    a = online_merge(a, b);
  }
  return a;
}

// The (max, sum) of the whole block, returned to every thread (barriers inside).
__device__ MaxSum block_merge(MaxSum a) {
  __shared__ float sm[32], ss[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  a = warp_merge(a);
  if (lane == 0) {
    sm[warp] = a.m;
    ss[warp] = a.s;
  }
  __syncthreads();
  if (warp == 0) {
    MaxSum b{-INFINITY, 0.0f};
    if (lane < static_cast<int>(blockDim.x / 32)) b = {sm[lane], ss[lane]};
    b = warp_merge(b);
    if (lane == 0) {
      sm[0] = b.m;
      ss[0] = b.s;
    }
  }
  __syncthreads();
  const MaxSum r{sm[0], ss[0]};
  __syncthreads();  // every thread has read before the next row writes
  return r;
}

// This thread's (max, sum) over columns [0, valid) of row xr.
template <class T, int VEC>
__device__ __forceinline__ MaxSum row_stats(const T* xr, int64_t valid) {
  MaxSum a{-INFINITY, 0.0f};
  const int64_t packs = valid / VEC;
  for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
    float v[VEC];
    load_f32<T, VEC>(xr + p * VEC, v);
#pragma unroll
    for (int k = 0; k < VEC; ++k) online_add(a, v[k]);
  }
  for (int64_t c = packs * VEC + threadIdx.x; c < valid; c += blockDim.x)
    online_add(a, to_f32(xr[c]));
  return a;
}

// The target's column in this shard, or -1 when another shard holds it.
__device__ __forceinline__ int64_t local_target(const int64_t* target, const RowIndex& tix,
                                                int64_t row, int64_t start, int64_t v) {
  const int64_t t = target[row_offset(tix, row)];
  return t >= start && t < start + v ? t - start : -1;
}

// The target's logit (-inf in a padded column), 0 when not in this shard.
template <class T>
__device__ __forceinline__ float target_logit(const T* xr, int64_t tl, int64_t valid) {
  return tl < 0 ? 0.0f : (tl < valid ? to_f32(xr[tl]) : -INFINITY);
}

template <class T, int VEC, bool FINAL>
__global__ void __launch_bounds__(kThreads) ce_fwd_kernel(
    const T* __restrict__ x, const int64_t* __restrict__ target, RowIndex tix, int64_t rows,
    int64_t v, int64_t valid, int64_t start, float* __restrict__ out0, float* __restrict__ out1,
    float* __restrict__ out2) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * v;
    const MaxSum a = block_merge(row_stats<T, VEC>(xr, valid));
    if (threadIdx.x != 0) continue;
    const int64_t tl = local_target(target, tix, row, start, v);
    const float traw = target_logit(xr, tl, valid);
    if (FINAL) {  // out0 = loss, out1 = max, out2 = sum
      const float lse = logf(a.s);
      out0[row] = tl >= 0 ? lse + a.m - traw : lse;
      out1[row] = a.m;
      out2[row] = a.s;
    } else {  // out0 = local max, out1 = max (to all-reduce), out2 = stats [3, rows]
      out0[row] = a.m;
      out1[row] = a.m;
      out2[row] = traw;
      out2[rows + row] = a.s;
      out2[2 * rows + row] = tl >= 0 ? 1.0f : 0.0f;
    }
  }
}

// out [2, rows] = (target logit - max or 0, sum * exp(local max - max)).
__global__ void ce_rescale_kernel(const float* __restrict__ mloc, const float* __restrict__ gmax,
                                  const float* __restrict__ stats, float* __restrict__ out,
                                  int64_t rows) {
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < rows;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float m = mloc[r], g = gmax[r];
    out[r] = stats[2 * rows + r] != 0.0f ? stats[r] - g : 0.0f;
    out[rows + r] = m == -INFINITY ? 0.0f : stats[rows + r] * expf(m - g);
  }
}

__global__ void ce_loss_kernel(const float* __restrict__ reduced, float* __restrict__ loss,
                               int64_t rows) {
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < rows;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x)
    loss[r] = logf(reduced[rows + r]) - reduced[r];
}

template <class T, int VEC>
__global__ void __launch_bounds__(kThreads) ce_bwd_kernel(
    const float* __restrict__ grad, RowIndex gix, const T* __restrict__ x,
    const int64_t* __restrict__ target, RowIndex tix, const float* __restrict__ gmax,
    const float* __restrict__ gsum, T* __restrict__ dx, int64_t rows, int64_t v, int64_t valid,
    int64_t start) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float g = grad[row_offset(gix, row)], m = gmax[row], inv = 1.0f / gsum[row];
    const int64_t tl = local_target(target, tix, row, start, v);
    const T* xr = x + row * v;
    T* dr = dx + row * v;
    const int64_t packs = v / VEC;
    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
      float e[VEC];
      load_f32<T, VEC>(xr + p * VEC, e);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const int64_t c = p * VEC + k;
        const float prob = c < valid ? expf(e[k] - m) * inv : 0.0f;
        e[k] = (prob - (c == tl ? 1.0f : 0.0f)) * g;
      }
      store_f32<T, VEC>(dr + p * VEC, e);
    }
    for (int64_t c = packs * VEC + threadIdx.x; c < v; c += blockDim.x) {
      const float prob = c < valid ? expf(to_f32(xr[c]) - m) * inv : 0.0f;
      dr[c] = from_f32<T>((prob - (c == tl ? 1.0f : 0.0f)) * g);
    }
  }
}

template <class T, bool FINAL>
void launch_fwd(const void* x, const int64_t* target, RowIndex tix, int64_t rows, int64_t v,
                int64_t valid, int64_t start, float* o0, float* o1, float* o2,
                cudaStream_t stream) {
  const unsigned grid = grid_for(rows, 1, 1 << 20);
  const T* xp = static_cast<const T*>(x);
  if (packs_fit<T>(v, x))
    ce_fwd_kernel<T, kVec<T>, FINAL><<<grid, kThreads, 0, stream>>>(
        xp, target, tix, rows, v, valid, start, o0, o1, o2);
  else
    ce_fwd_kernel<T, 1, FINAL><<<grid, kThreads, 0, stream>>>(xp, target, tix, rows, v, valid,
                                                             start, o0, o1, o2);
}

}  // namespace

cudaError_t ce_fwd(const void* logits, const int64_t* target, RowIndex tix, int64_t rows,
                   int64_t v, int64_t valid, int64_t start, float* loss, float* max,
                   float* sum, int dt, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  MZ_DISPATCH(dt, T, (launch_fwd<T, true>(logits, target, tix, rows, v, valid, start, loss,
                                          max, sum, stream)));
  return cudaGetLastError();
}

cudaError_t ce_stats(const void* logits, const int64_t* target, RowIndex tix, int64_t rows,
                     int64_t v, int64_t valid, int64_t start, float* mloc, float* mred,
                     float* stats, int dt, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  MZ_DISPATCH(dt, T, (launch_fwd<T, false>(logits, target, tix, rows, v, valid, start, mloc,
                                           mred, stats, stream)));
  return cudaGetLastError();
}

cudaError_t ce_rescale(const float* mloc, const float* gmax, const float* stats, float* out,
                       int64_t rows, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  ce_rescale_kernel<<<grid_for(rows, 256), 256, 0, stream>>>(mloc, gmax, stats, out, rows);
  return cudaGetLastError();
}

cudaError_t ce_loss(const float* reduced, float* loss, int64_t rows, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  ce_loss_kernel<<<grid_for(rows, 256), 256, 0, stream>>>(reduced, loss, rows);
  return cudaGetLastError();
}

cudaError_t ce_bwd(const float* grad, RowIndex gix, const void* logits, const int64_t* target,
                   RowIndex tix, const float* gmax, const float* gsum, void* dx, int64_t rows,
                   int64_t v, int64_t valid, int64_t start, int dt, cudaStream_t stream) {
  if (rows == 0 || v == 0) return cudaSuccess;
  const unsigned grid = grid_for(rows, 1, 1 << 20);
  MZ_DISPATCH(dt, T, {
    const T* xp = static_cast<const T*>(logits);
    T* dp = static_cast<T*>(dx);
    if (packs_fit<T>(v, logits, dx))
      ce_bwd_kernel<T, kVec<T>><<<grid, kThreads, 0, stream>>>(
          grad, gix, xp, target, tix, gmax, gsum, dp, rows, v, valid, start);
    else
      ce_bwd_kernel<T, 1><<<grid, kThreads, 0, stream>>>(grad, gix, xp, target, tix, gmax,
                                                        gsum, dp, rows, v, valid, start);
  });
  return cudaGetLastError();
}

}  // namespace megazero_cuda
