// LayerNorm forward/backward CUDA kernels over the last dim, fp32 statistics.
//
// Forward: one warp per row (4 rows per block), two passes over the row for mean and
// variance (the row stays in L1/L2), one to write y; mean and rstd [rows] kept in fp32.
// Backward: one warp per row for dx; dw/db by columns: blocks of 32 columns x a chunk of rows
// write fp32 partials [nchunks, 2, h], and a last kernel sums the chunks in order
// (deterministic, no atomics). Raw pointers only; the torch binding is fused_cuda.cc.
#include "cuda_common.cuh"
#include "fused_cuda.h"

namespace megazero_cuda {
namespace {

constexpr int kRowsPerBlock = 4;  // warps per block, one row each
constexpr int kPartialRows = 8;   // threadIdx.y extent of the dw/db partial kernel

template <class T, class Wt>
__global__ void ln_fwd_kernel(const T* __restrict__ x, const Wt* __restrict__ w,
                              const Wt* __restrict__ b, T* __restrict__ y,
                              float* __restrict__ mean, float* __restrict__ rstd, int64_t rows,
                              int h, float eps) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= rows) return;  // the whole warp shares the row
  const int lane = threadIdx.x;
  const T* xr = x + row * h;
  float s = 0.f;
  for (int c = lane; c < h; c += 32) s += to_f32(xr[c]);
  const float m = warp_sum(s) / h;
  float q = 0.f;
  for (int c = lane; c < h; c += 32) {
    const float d = to_f32(xr[c]) - m;
    q += d * d;
  }
  const float rs = rsqrtf(warp_sum(q) / h + eps);
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = rs;
  }
  T* yr = y + row * h;
  for (int c = lane; c < h; c += 32) {
    float v = (to_f32(xr[c]) - m) * rs;
    if (w) v *= to_f32(w[c]);
    if (b) v += to_f32(b[c]);
    yr[c] = from_f32<T>(v);
  }
}

template <class T, class Wt>
__global__ void ln_bwd_dx_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                 const float* __restrict__ mean,
                                 const float* __restrict__ rstd, const Wt* __restrict__ w,
                                 T* __restrict__ dx, int64_t rows, int h) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= rows) return;
  const int lane = threadIdx.x;
  const T* xr = x + row * h;
  const T* dyr = dy + row * h;
  const float m = mean[row], rs = rstd[row];
  float sg = 0.f, sgx = 0.f;
  for (int c = lane; c < h; c += 32) {
    const float xh = (to_f32(xr[c]) - m) * rs;
    const float g = w ? to_f32(dyr[c]) * to_f32(w[c]) : to_f32(dyr[c]);
    sg += g;
    sgx += g * xh;
  }
  const float a = warp_sum(sg) / h, cc = warp_sum(sgx) / h;
  T* dxr = dx + row * h;
  for (int c = lane; c < h; c += 32) {
    const float xh = (to_f32(xr[c]) - m) * rs;
    const float g = w ? to_f32(dyr[c]) * to_f32(w[c]) : to_f32(dyr[c]);
    dxr[c] = from_f32<T>((g - a - xh * cc) * rs);
  }
}

// part[(2k) * h + c] = sum over chunk k of dy * xhat, part[(2k + 1) * h + c] = sum of dy.
template <class T>
__global__ void ln_bwd_partial_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                      const float* __restrict__ mean,
                                      const float* __restrict__ rstd, float* __restrict__ part,
                                      int64_t rows, int h, int64_t rows_per_chunk) {
  __shared__ float sw[kPartialRows][33];
  __shared__ float sb[kPartialRows][33];
  const int c = blockIdx.x * 32 + threadIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
  float aw = 0.f, ab = 0.f;
  if (c < h) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kPartialRows) {
      const float d = to_f32(dy[r * h + c]);
      aw += d * (to_f32(x[r * h + c]) - mean[r]) * rstd[r];
      ab += d;
    }
  }
  sw[threadIdx.y][threadIdx.x] = aw;
  sb[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  if (threadIdx.y == 0 && c < h) {
    float tw = 0.f, tb = 0.f;
#pragma unroll
    for (int k = 0; k < kPartialRows; ++k) {
      tw += sw[k][threadIdx.x];
      tb += sb[k][threadIdx.x];
    }
    part[(2 * static_cast<int64_t>(blockIdx.y)) * h + c] = tw;
    part[(2 * static_cast<int64_t>(blockIdx.y) + 1) * h + c] = tb;
  }
}

template <class Wt>
__global__ void ln_bwd_final_kernel(const float* __restrict__ part, Wt* __restrict__ dw,
                                    Wt* __restrict__ db, int nchunks, int h) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= h) return;
  float tw = 0.f, tb = 0.f;
  for (int k = 0; k < nchunks; ++k) {
    tw += part[(2 * static_cast<int64_t>(k)) * h + c];
    tb += part[(2 * static_cast<int64_t>(k) + 1) * h + c];
  }
  dw[c] = from_f32<Wt>(tw);
  db[c] = from_f32<Wt>(tb);
}

int num_chunks(int64_t rows) {
  int64_t n = (rows + 63) / 64;
  return static_cast<int>(n < 1 ? 1 : (n > 256 ? 256 : n));
}

}  // namespace

cudaError_t layer_norm_fwd(const void* x, const void* w, const void* b, void* y, float* mean,
                           float* rstd, int64_t rows, int64_t h, float eps, int dt, int wdt,
                           cudaStream_t stream) {
  if (rows == 0 || h == 0) return cudaSuccess;
  const dim3 block(32, kRowsPerBlock);
  const dim3 grid(static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock));
  MZ_DISPATCH(dt, T, MZ_DISPATCH(wdt, Wt, (ln_fwd_kernel<T, Wt><<<grid, block, 0, stream>>>(
      static_cast<const T*>(x), static_cast<const Wt*>(w), static_cast<const Wt*>(b),
      static_cast<T*>(y), mean, rstd, rows, static_cast<int>(h), eps))));
  return cudaGetLastError();
}

int64_t layer_norm_bwd_scratch(int64_t rows, int64_t h) { return 2 * num_chunks(rows) * h; }

cudaError_t layer_norm_bwd(const void* dy, const void* x, const float* mean, const float* rstd,
                           const void* w, void* dx, void* dw, void* db, float* scratch,
                           int64_t rows, int64_t h, int dt, int wdt, cudaStream_t stream) {
  if (h == 0) return cudaSuccess;
  if (rows == 0) {
    if (dw) {
      const size_t bytes = static_cast<size_t>(h) * (wdt == kFloat32 ? 4 : 2);
      cudaMemsetAsync(dw, 0, bytes, stream);
      cudaMemsetAsync(db, 0, bytes, stream);
    }
    return cudaGetLastError();
  }
  const dim3 block(32, kRowsPerBlock);
  const dim3 grid(static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock));
  const int hi = static_cast<int>(h);
  MZ_DISPATCH(dt, T, MZ_DISPATCH(wdt, Wt, (ln_bwd_dx_kernel<T, Wt><<<grid, block, 0, stream>>>(
      static_cast<const T*>(dy), static_cast<const T*>(x), mean, rstd,
      static_cast<const Wt*>(w), static_cast<T*>(dx), rows, hi))));
  if (!dw) return cudaGetLastError();
  const int nchunks = num_chunks(rows);
  const int64_t rows_per_chunk = (rows + nchunks - 1) / nchunks;
  const dim3 pgrid(static_cast<unsigned>((h + 31) / 32), static_cast<unsigned>(nchunks));
  MZ_DISPATCH(dt, T, (ln_bwd_partial_kernel<T><<<pgrid, dim3(32, kPartialRows), 0, stream>>>(
      static_cast<const T*>(dy), static_cast<const T*>(x), mean, rstd, scratch, rows, hi,
      rows_per_chunk)));
  MZ_DISPATCH(wdt, Wt, (ln_bwd_final_kernel<Wt><<<(hi + 255) / 256, 256, 0, stream>>>(
      scratch, static_cast<Wt*>(dw), static_cast<Wt*>(db), nchunks, hi)));
  return cudaGetLastError();
}

}  // namespace megazero_cuda
