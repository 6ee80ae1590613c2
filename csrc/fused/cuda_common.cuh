// Device helpers shared by the fused-op CUDA kernels: fp32 load/store of fp32, bf16 and fp16
// storage (explicit conversions, so torch's -D__CUDA_NO_*_CONVERSIONS__ flags are fine), 16-byte
// packs for vectorised loads and stores, warp reductions, and a dtype dispatch macro.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace megazero_cuda {

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }

template <class T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }

// N consecutive elements moved by one load or store (16 bytes when N = kVec<T>).
template <class T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// Elements of T per 16-byte pack: 4 fp32, 8 bf16/fp16.
template <class T>
constexpr int kVec = 16 / static_cast<int>(sizeof(T));

// out[k] = p[k] as fp32, k < N; p must be aligned to sizeof(T) * N.
template <class T, int N>
__device__ __forceinline__ void load_f32(const T* p, float* out) {
  const Pack<T, N> pk = *reinterpret_cast<const Pack<T, N>*>(p);
#pragma unroll
  for (int k = 0; k < N; ++k) out[k] = to_f32(pk.v[k]);
}

// p[k] = in[k] rounded to T, k < N; p aligned as for load_f32.
template <class T, int N>
__device__ __forceinline__ void store_f32(T* p, const float* in) {
  Pack<T, N> pk;
#pragma unroll
  for (int k = 0; k < N; ++k) pk.v[k] = from_f32<T>(in[k]);
  *reinterpret_cast<Pack<T, N>*>(p) = pk;
}

// Whether the 16-byte packs of T can be used on these (possibly null) buffers of rows `cols`
// wide: every row starts at a multiple of 16 bytes.
template <class T>
inline bool packs_fit(int64_t cols, const void* a, const void* b = nullptr,
                      const void* c = nullptr, const void* d = nullptr) {
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return cols % kVec<T> == 0 && aligned(a) && aligned(b) && aligned(c) && aligned(d);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Blocks for a grid-stride loop over `n` items, `per_block` a block: all that are useful, at
// most `cap` (the loop covers the rest).
inline unsigned grid_for(int64_t n, int64_t per_block, int64_t cap = 65535) {
  const int64_t blocks = (n + per_block - 1) / per_block;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > cap ? cap : blocks));
}

}  // namespace megazero_cuda

// Run `...` with `T` bound to the storage type of dtype code `code` (0 fp32, 1 bf16, 2 fp16).
#define MZ_DISPATCH(code, T, ...)                      \
  switch (code) {                                      \
    case 1: { using T = __nv_bfloat16; __VA_ARGS__; break; } \
    case 2: { using T = __half; __VA_ARGS__; break; }        \
    default: { using T = float; __VA_ARGS__; break; }        \
  }
