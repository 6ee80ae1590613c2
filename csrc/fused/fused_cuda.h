// Host API of the fused model-op CUDA kernels (layer_norm_cuda.cu, softmax_cuda.cu).
//
// Raw device pointers, sizes and a stream; no torch types, so the .cu files compile with plain
// nvcc (the nvcc test compiles them alone) and fused_cuda.cc is the only torch-aware file.
// dtype codes: 0 fp32, 1 bf16, 2 fp16. Each function returns the launch's cudaError_t.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace megazero_cuda {

enum DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// y = (x - mean) * rstd * w + b over rows of h; writes fp32 mean/rstd [rows]. w, b may be
// null (b only when w is); `dt` is x/y's dtype, `wdt` w/b's.
cudaError_t layer_norm_fwd(const void* x, const void* w, const void* b, void* y, float* mean,
                           float* rstd, int64_t rows, int64_t h, float eps, int dt, int wdt,
                           cudaStream_t stream);

// fp32 scratch floats layer_norm_bwd needs for dw/db partials.
int64_t layer_norm_bwd_scratch(int64_t rows, int64_t h);

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * w; dw = sum dy * xhat,
// db = sum dy (skipped when dw is null).
cudaError_t layer_norm_bwd(const void* dy, const void* x, const float* mean, const float* rstd,
                           const void* w, void* dx, void* dw, void* db, float* scratch,
                           int64_t rows, int64_t h, int dt, int wdt, cudaStream_t stream);

// Causal softmax(scale * x) over [batches, sq, sk]: row i keeps columns 0..i, zeros after.
cudaError_t causal_softmax_fwd(const void* x, void* y, int64_t batches, int64_t sq, int64_t sk,
                               float scale, int dt, cudaStream_t stream);

// dx = scale * y * (dy - sum(dy * y)) on the kept part of each row, 0 elsewhere.
cudaError_t causal_softmax_bwd(const void* dy, const void* y, void* dx, int64_t batches,
                               int64_t sq, int64_t sk, float scale, int dt,
                               cudaStream_t stream);

}  // namespace megazero_cuda
