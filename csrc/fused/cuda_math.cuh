// Scalar math of the fused CUDA kernels, callable on the host too (tests/test_ops_cuda.py
// compiles it into a host program with nvcc and checks it against the PyTorch references on a
// machine without a GPU): the counter-based dropout hash, GELU (tanh) and its derivative,
// SwiGLU's gradients, and the (max, sum of exponentials) pairs of an online softmax.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define MZ_HD __host__ __device__ __forceinline__
#else
#define MZ_HD inline
#endif

namespace megazero_cuda {

// Dropout hash: the CPU kernels' (csrc/fused/fused_common.h) and the Python reference's
// (megazero/ops/fused_dropout.py, dropout_keep_mask). Flat element i under `seed` is kept when
//   key  = mix(mix(seed_hi ^ hi32(i)) ^ seed_lo)
//   keep = mix(mix(lo32(i) ^ key)) >= threshold,  threshold = p * 2^32.
constexpr uint32_t kMixMul1 = 0x7feb352du;
constexpr uint32_t kMixMul2 = 0x846ca68bu;

MZ_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= kMixMul1;
  x ^= x >> 15;
  x *= kMixMul2;
  x ^= x >> 16;
  return x;
}

MZ_HD uint32_t dropout_key(uint64_t seed, uint32_t hi) {
  return mix32(mix32(static_cast<uint32_t>(seed >> 32) ^ hi) ^ static_cast<uint32_t>(seed));
}

// Whether element i survives, given the key of i's upper 32 bits.
MZ_HD bool dropout_keep(uint64_t i, uint32_t key, uint32_t threshold) {
  return mix32(mix32(static_cast<uint32_t>(i) ^ key)) >= threshold;
}

// GPT-2's tanh GELU, 0.5*y*(1+tanh(k0*y*(1+k1*y^2))), as y*sigmoid(z) with
// z = 2*k0*y*(1+k1*y^2): the same function, the CPU kernels' form.
constexpr float kGeluC1 = 2.0f * 0.79788456f;
constexpr float kGeluC2 = 2.0f * 0.79788456f * 0.044715f;

MZ_HD float sigmoid(float z) { return 1.0f / (1.0f + expf(-z)); }

MZ_HD float gelu_fwd(float y) { return y * sigmoid(y * (kGeluC1 + kGeluC2 * y * y)); }

// d gelu / dy = s + y*s*(1-s)*dz/dy with s = sigmoid(z), dz/dy = C1 + 3*C2*y^2.
MZ_HD float gelu_grad(float y) {
  const float y2 = y * y;
  const float s = sigmoid(y * (kGeluC1 + kGeluC2 * y2));
  return s + y * s * (1.0f - s) * (kGeluC1 + 3.0f * kGeluC2 * y2);
}

// out = silu(g) * u; its gradients dg = d*u*s*(1 + g*(1-s)), du = d*g*s with s = sigmoid(g).
MZ_HD float silu_mul(float g, float u) { return g * sigmoid(g) * u; }

MZ_HD void silu_mul_grad(float g, float u, float d, float* dg, float* du) {
  const float s = sigmoid(g);
  *dg = d * u * (s * (1.0f + g * (1.0f - s)));
  *du = d * (g * s);
}

// Online softmax statistics of a set of values: its max m and sum of exp(x - m). Empty: m = -inf,
// s = 0. A NaN value makes s NaN; -inf values add nothing.
struct MaxSum {
  float m, s;
};

MZ_HD void online_add(MaxSum& a, float x) {
  if (x > a.m) {
    a.s = a.s * expf(a.m - x) + 1.0f;  // a.m = -inf: 0 * 0 + 1
    a.m = x;
  } else if (x != -INFINITY) {
    a.s += expf(x - a.m);
  }
}

MZ_HD MaxSum online_merge(MaxSum a, MaxSum b) {
  if (b.m > a.m) {
    const MaxSum t = a;
    a = b;
    b = t;
  }
  if (b.m == -INFINITY) return a;  // b empty (or both)
  return {a.m, a.s + b.s * expf(b.m - a.m)};
}

}  // namespace megazero_cuda
