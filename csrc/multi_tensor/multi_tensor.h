// Host API of the multi-tensor optimizer CUDA kernels (apex/DeepSpeed-style FusedAdam and
// FusedLamb): one launch updates many tensors, each split into chunks, with the tensor
// addresses passed as a kernel argument (multi_tensor_apply.cuh).
//
// Raw device pointers, sizes and a stream; no torch types (multi_tensor_cuda.cc binds them).
// Parameters and gradients share one dtype (0 fp32, 1 bf16, 2 fp16); Adam moments are fp32.
// Every function returns the last launch's cudaError_t.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace megazero_cuda {

struct AdamArgs {
  float lr, beta1, beta2, eps, weight_decay;
  float grad_scale;      // gradients are multiplied by this (1/loss_scale, times a clip factor)
  int step;              // 1-based step for bias correction
  bool adam_w_mode;      // true: decoupled weight decay (AdamW); false: L2 added to the grad
  bool bias_correction;
};

// Adam/AdamW per element in fp32, in torch.optim.Adam(W)'s order of operations:
//   g = grad * grad_scale (+ weight_decay * p when !adam_w_mode, L2)
//   m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g * g
//   p = p * (1 - lr * weight_decay)   (adam_w_mode only, decoupled)
//   p = p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps),  bc_i = 1 - beta_i^step (or 1)
cudaError_t multi_tensor_adam(int n, void* const* params, void* const* grads,
                              float* const* exp_avgs, float* const* exp_avg_sqs,
                              const int64_t* numels, int dtype, AdamArgs args,
                              cudaStream_t stream);

struct LambArgs {
  float lr, beta1, beta2, eps, weight_decay, grad_scale;
  float max_coeff, min_coeff;  // trust ratio clamp, DeepSpeed FusedLamb's 10 and 0.01
  int step;
  bool bias_correction;
};

// fp32 scratch floats multi_tensor_lamb needs (two per chunk of every tensor).
int64_t lamb_scratch_floats(int n, const int64_t* numels);

// LAMB with a per-tensor trust ratio:
//   m, v as Adam (decoupled);  u = (m / bc1) / (sqrt(v / bc2) + eps) + weight_decay * p
//   ratio = clamp(|p| / |u|, min_coeff, max_coeff) when both norms > 0, else 1
//   p = p - lr * ratio * u
// Pass 1 updates m, v and writes per-chunk sums of p^2 and u^2 to `scratch`; pass 2 sums each
// tensor's chunks in a fixed order (deterministic) and recomputes u from m, v, p to update p,
// so no update buffer is stored and gradients are left untouched.
cudaError_t multi_tensor_lamb(int n, void* const* params, void* const* grads,
                              float* const* exp_avgs, float* const* exp_avg_sqs,
                              const int64_t* numels, int dtype, LambArgs args, float* scratch,
                              cudaStream_t stream);

}  // namespace megazero_cuda
