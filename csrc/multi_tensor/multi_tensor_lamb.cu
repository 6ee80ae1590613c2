// Multi-tensor LAMB CUDA kernels with per-tensor trust ratios (formula in multi_tensor.h).
//
// Pass 1 (params, grads, m, v): update the moments, form u, and write each chunk's sums of
// p^2 and u^2 to scratch[2 * global_chunk + {0, 1}]. Pass 2 (params, m, v): every block sums
// its tensor's chunk partials in a fixed order (so the ratio is deterministic and no extra
// launch or atomics are needed), recomputes u bit-identically from m, v, p and updates p.
#include <cmath>

#include "fused/cuda_common.cuh"
#include "multi_tensor.h"
#include "multi_tensor_apply.cuh"

namespace megazero_cuda {
namespace {

constexpr int kLambTensors = 36;
using LambChunks1 = TensorChunks<4, kLambTensors>;
using LambChunks2 = TensorChunks<3, kLambTensors>;

struct LambConsts {
  float lr, beta1, beta2, eps, weight_decay, grad_scale, max_coeff, min_coeff;
  float bc1, bc2;
};

// Sum over the block; every thread gets the result. `shared` holds 32 floats.
__device__ float block_sum(float v, float* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = threadIdx.x < (blockDim.x >> 5) ? shared[lane] : 0.f;
  if (warp == 0) v = warp_sum(v);
  if (threadIdx.x == 0) shared[0] = v;
  __syncthreads();
  v = shared[0];
  __syncthreads();
  return v;
}

__device__ __forceinline__ float lamb_update(float p, float m, float v, const LambConsts& k) {
  return (m / k.bc1) / (sqrtf(v / k.bc2) + k.eps) + k.weight_decay * p;
}

template <class T>
__global__ void __launch_bounds__(kThreads) lamb_pass1_kernel(LambChunks1 meta, LambConsts k,
                                                              float* partials) {
  __shared__ float shared[32];
  const int t = meta.block_tensor[blockIdx.x];
  const int chunk = meta.block_chunk[blockIdx.x];
  const int64_t start = static_cast<int64_t>(chunk) * kChunkSize;
  const int64_t end = min(meta.numel[t], start + kChunkSize);
  const T* p = static_cast<const T*>(meta.addr[0][t]);
  const T* g = static_cast<const T*>(meta.addr[1][t]);
  float* m = static_cast<float*>(meta.addr[2][t]);
  float* v = static_cast<float*>(meta.addr[3][t]);
  float pp = 0.f, uu = 0.f;
  for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x) {
    const float pi = to_f32(p[i]);
    const float gi = to_f32(g[i]) * k.grad_scale;
    const float mi = k.beta1 * m[i] + (1.f - k.beta1) * gi;
    const float vi = k.beta2 * v[i] + (1.f - k.beta2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    const float u = lamb_update(pi, mi, vi, k);
    pp += pi * pi;
    uu += u * u;
  }
  pp = block_sum(pp, shared);
  uu = block_sum(uu, shared);
  if (threadIdx.x == 0) {
    const int64_t slot = meta.chunk_base[t] + chunk;
    partials[2 * slot] = pp;
    partials[2 * slot + 1] = uu;
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads) lamb_pass2_kernel(LambChunks2 meta, LambConsts k,
                                                              const float* partials) {
  __shared__ float shared[32];
  const int t = meta.block_tensor[blockIdx.x];
  const int64_t numel = meta.numel[t];
  const int64_t base = meta.chunk_base[t], chunks = num_chunks(numel);
  float pp = 0.f, uu = 0.f;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    pp += partials[2 * (base + c)];
    uu += partials[2 * (base + c) + 1];
  }
  const float p_norm = sqrtf(block_sum(pp, shared));
  const float u_norm = sqrtf(block_sum(uu, shared));
  float ratio = 1.f;
  if (p_norm > 0.f && u_norm > 0.f)
    ratio = fminf(fmaxf(p_norm / u_norm, k.min_coeff), k.max_coeff);
  const int64_t start = static_cast<int64_t>(meta.block_chunk[blockIdx.x]) * kChunkSize;
  const int64_t end = min(numel, start + kChunkSize);
  T* p = static_cast<T*>(meta.addr[0][t]);
  const float* m = static_cast<const float*>(meta.addr[1][t]);
  const float* v = static_cast<const float*>(meta.addr[2][t]);
  const float step = k.lr * ratio;
  for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x) {
    const float pi = to_f32(p[i]);
    p[i] = from_f32<T>(pi - step * lamb_update(pi, m[i], v[i], k));
  }
}

}  // namespace

int64_t lamb_scratch_floats(int n, const int64_t* numels) {
  int64_t chunks = 0;
  for (int t = 0; t < n; ++t) chunks += num_chunks(numels[t]);
  return 2 * chunks;
}

cudaError_t multi_tensor_lamb(int n, void* const* params, void* const* grads,
                              float* const* exp_avgs, float* const* exp_avg_sqs,
                              const int64_t* numels, int dtype, LambArgs a, float* scratch,
                              cudaStream_t stream) {
  const double bc1 = a.bias_correction ? 1.0 - std::pow(a.beta1, a.step) : 1.0;
  const double bc2 = a.bias_correction ? 1.0 - std::pow(a.beta2, a.step) : 1.0;
  LambConsts k{a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.grad_scale, a.max_coeff,
               a.min_coeff, static_cast<float>(bc1), static_cast<float>(bc2)};
  void* const* m_list = reinterpret_cast<void* const*>(exp_avgs);
  void* const* v_list = reinterpret_cast<void* const*>(exp_avg_sqs);
  void* const* lists1[4] = {params, grads, m_list, v_list};
  void* const* lists2[3] = {params, m_list, v_list};
  cudaError_t err = cudaSuccess;
  MZ_DISPATCH(dtype, T, {
    err = for_each_chunk<4, kLambTensors>(
        n, lists1, numels, [&](const LambChunks1& meta, int blocks) {
          lamb_pass1_kernel<T><<<blocks, kThreads, 0, stream>>>(meta, k, scratch);
        });
    if (err == cudaSuccess)
      err = for_each_chunk<3, kLambTensors>(
          n, lists2, numels, [&](const LambChunks2& meta, int blocks) {
            lamb_pass2_kernel<T><<<blocks, kThreads, 0, stream>>>(meta, k, scratch);
          });
  });
  return err;
}

}  // namespace megazero_cuda
