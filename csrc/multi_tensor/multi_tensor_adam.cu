// Multi-tensor Adam/AdamW CUDA kernel (apex/DeepSpeed FusedAdam style): one launch per 320
// chunks of 64Ki elements across up to 36 tensors; fp32 math, params/grads fp32, bf16 or
// fp16, moments fp32. Formula in multi_tensor.h.
#include <cmath>

#include "fused/cuda_common.cuh"
#include "multi_tensor.h"
#include "multi_tensor_apply.cuh"

namespace megazero_cuda {
namespace {

constexpr int kAdamTensors = 36;
using AdamChunks = TensorChunks<4, kAdamTensors>;

struct AdamConsts {
  float lr, beta1, beta2, eps, weight_decay, grad_scale;
  float step_size;      // lr / bc1
  float bc2_sqrt;       // sqrt(bc2)
  float decay_factor;   // 1 - lr * weight_decay (AdamW)
  bool adam_w_mode;
};

template <class T>
__global__ void __launch_bounds__(kThreads) adam_kernel(AdamChunks meta, AdamConsts k) {
  const int t = meta.block_tensor[blockIdx.x];
  const int64_t start = static_cast<int64_t>(meta.block_chunk[blockIdx.x]) * kChunkSize;
  const int64_t end = min(meta.numel[t], start + kChunkSize);
  T* p = static_cast<T*>(meta.addr[0][t]);
  const T* g = static_cast<const T*>(meta.addr[1][t]);
  float* m = static_cast<float*>(meta.addr[2][t]);
  float* v = static_cast<float*>(meta.addr[3][t]);
  for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x) {
    float pi = to_f32(p[i]);
    float gi = to_f32(g[i]) * k.grad_scale;
    if (!k.adam_w_mode) gi += k.weight_decay * pi;
    const float mi = k.beta1 * m[i] + (1.f - k.beta1) * gi;
    const float vi = k.beta2 * v[i] + (1.f - k.beta2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    if (k.adam_w_mode) pi *= k.decay_factor;
    pi -= k.step_size * mi / (sqrtf(vi) / k.bc2_sqrt + k.eps);
    p[i] = from_f32<T>(pi);
  }
}

}  // namespace

cudaError_t multi_tensor_adam(int n, void* const* params, void* const* grads,
                              float* const* exp_avgs, float* const* exp_avg_sqs,
                              const int64_t* numels, int dtype, AdamArgs a,
                              cudaStream_t stream) {
  const double bc1 = a.bias_correction ? 1.0 - std::pow(a.beta1, a.step) : 1.0;
  const double bc2 = a.bias_correction ? 1.0 - std::pow(a.beta2, a.step) : 1.0;
  AdamConsts k{a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.grad_scale,
               static_cast<float>(a.lr / bc1), static_cast<float>(std::sqrt(bc2)),
               1.f - a.lr * a.weight_decay, a.adam_w_mode};
  void* const* lists[4] = {params, grads, reinterpret_cast<void* const*>(exp_avgs),
                           reinterpret_cast<void* const*>(exp_avg_sqs)};
  cudaError_t err = cudaSuccess;
  MZ_DISPATCH(dtype, T, err = (for_each_chunk<4, kAdamTensors>(
      n, lists, numels, [&](const AdamChunks& meta, int blocks) {
        adam_kernel<T><<<blocks, kThreads, 0, stream>>>(meta, k);
      })));
  return err;
}

}  // namespace megazero_cuda
