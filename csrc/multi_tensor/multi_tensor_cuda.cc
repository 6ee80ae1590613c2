// torch binding of the multi-tensor optimizer CUDA kernels: megazero.ops._multi_tensor_cuda
// (fused Adam/AdamW and LAMB over lists of tensors, updated in place on the current stream).
// Lean torch headers (not torch/extension.h): the binding compiles in a third of the time.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/utils/pybind.h>

#include <vector>

#include "multi_tensor.h"

namespace {

struct Lists {
  std::vector<void*> params, grads;
  std::vector<float*> m, v;
  std::vector<int64_t> numels;
  int dtype = 0;
};

// All lists the same length; params/grads CUDA, contiguous, one dtype; moments fp32.
Lists collect(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
              const std::vector<at::Tensor>& exp_avgs,
              const std::vector<at::Tensor>& exp_avg_sqs) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n,
              "params, grads, exp_avgs and exp_avg_sqs must have the same length");
  Lists l;
  if (n == 0) return l;
  const auto dtype = params[0].scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "params must be fp32, bf16 or fp16");
  l.dtype = dtype == at::kFloat ? 0 : (dtype == at::kBFloat16 ? 1 : 2);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor* ts[4] = {&params[i], &grads[i], &exp_avgs[i], &exp_avg_sqs[i]};
    for (const at::Tensor* t : ts) {
      TORCH_CHECK(t->is_cuda() && t->is_contiguous(), "tensors must be contiguous CUDA tensors");
      TORCH_CHECK(t->device() == params[0].device(), "tensors must be on one device");
      TORCH_CHECK(t->numel() == params[i].numel(), "tensor ", i, ": sizes differ");
    }
    TORCH_CHECK(params[i].scalar_type() == dtype && grads[i].scalar_type() == dtype,
                "params and grads must share one dtype");
    TORCH_CHECK(exp_avgs[i].scalar_type() == at::kFloat &&
                exp_avg_sqs[i].scalar_type() == at::kFloat, "exp_avg(_sq) must be fp32");
    l.params.push_back(params[i].data_ptr());
    l.grads.push_back(grads[i].data_ptr());
    l.m.push_back(exp_avgs[i].data_ptr<float>());
    l.v.push_back(exp_avg_sqs[i].data_ptr<float>());
    l.numels.push_back(params[i].numel());
  }
  return l;
}

void check(cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, "megazero CUDA kernel failed: ", cudaGetErrorString(err));
}

void adam(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
          const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
          double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
          bool adam_w_mode, bool bias_correction, double grad_scale) {
  Lists l = collect(params, grads, exp_avgs, exp_avg_sqs);
  if (l.params.empty()) return;
  const c10::cuda::CUDAGuard guard(params[0].device());
  megazero_cuda::AdamArgs args{static_cast<float>(lr), static_cast<float>(beta1),
                               static_cast<float>(beta2), static_cast<float>(eps),
                               static_cast<float>(weight_decay),
                               static_cast<float>(grad_scale), static_cast<int>(step),
                               adam_w_mode, bias_correction};
  check(megazero_cuda::multi_tensor_adam(
      static_cast<int>(l.params.size()), l.params.data(), l.grads.data(), l.m.data(),
      l.v.data(), l.numels.data(), l.dtype, args, c10::cuda::getCurrentCUDAStream().stream()));
}

void lamb(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
          const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
          double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
          bool bias_correction, double grad_scale, double max_coeff, double min_coeff) {
  Lists l = collect(params, grads, exp_avgs, exp_avg_sqs);
  if (l.params.empty()) return;
  const c10::cuda::CUDAGuard guard(params[0].device());
  const int n = static_cast<int>(l.params.size());
  const int64_t floats = megazero_cuda::lamb_scratch_floats(n, l.numels.data());
  auto scratch = at::empty({floats > 0 ? floats : 1},
                           params[0].options().dtype(at::kFloat));
  megazero_cuda::LambArgs args{static_cast<float>(lr), static_cast<float>(beta1),
                               static_cast<float>(beta2), static_cast<float>(eps),
                               static_cast<float>(weight_decay),
                               static_cast<float>(grad_scale), static_cast<float>(max_coeff),
                               static_cast<float>(min_coeff), static_cast<int>(step),
                               bias_correction};
  check(megazero_cuda::multi_tensor_lamb(n, l.params.data(), l.grads.data(), l.m.data(),
                                         l.v.data(), l.numels.data(), l.dtype, args,
                                         scratch.data_ptr<float>(),
                                         c10::cuda::getCurrentCUDAStream().stream()));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megazero multi-tensor optimizers (CUDA): fused Adam/AdamW and LAMB";
  m.def("adam", &adam, "multi-tensor Adam/AdamW step, in place");
  m.def("lamb", &lamb, "multi-tensor LAMB step with per-tensor trust ratio, in place");
}
