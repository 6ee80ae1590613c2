// Shared declarations of the fused model ops (CPU): dtype codes, the bf16 storage type, the
// per-level kernel table, and the counter-based dropout hash that the Python reference mirrors.
//
// Every SIMD level (scalar, AVX2+FMA, AVX-512, AVX-512 with BF16 instructions) compiles the
// same kernel bodies (fused_kernels_impl.h) from fused_simd.cpp in its own object and
// namespace, and fills one KernelTable; fused_bindings.cpp picks the table at run time from
// the CPU's features (megazero/cpu_dispatch.h). Kernels take raw pointers and sizes only (no
// libtorch).
#pragma once

#include <cstdint>

#include "megazero/simd.h"

namespace megazero_fused {

// Element dtype of a buffer, as passed from Python.
enum DType : int { kFloat32 = 0, kBFloat16 = 1 };

// bf16 is stored as its upper 16 bits of an IEEE float; kernels compute in fp32.
struct bf16_t {
  uint16_t bits;
};

// Dropout hash (lowbias32 by C. Wellons): a bijection on 32-bit words with good avalanche.
// The mask bit of flat element i under `seed` is
//   key  = mix(mix(seed_hi ^ hi32(i)) ^ seed_lo)
//   keep = mix(mix(lo32(i) ^ key)) >= threshold,  threshold = p * 2^32
// megazero/ops/fused_dropout.py computes the same function with torch int64 ops.
constexpr uint32_t kMixMul1 = 0x7feb352du;
constexpr uint32_t kMixMul2 = 0x846ca68bu;

// static: each SIMD level's object keeps its own copy (see megazero/simd.h).
static inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= kMixMul1;
  x ^= x >> 15;
  x *= kMixMul2;
  x ^= x >> 16;
  return x;
}

static inline uint32_t dropout_key(uint64_t seed, uint32_t hi) {
  return mix32(mix32(static_cast<uint32_t>(seed >> 32) ^ hi) ^ static_cast<uint32_t>(seed));
}

// Arguments of the dropout part of bias_dropout_add.
struct DropoutArgs {
  uint64_t seed;
  uint64_t offset;     // flat index of element [0, 0] (0 from Python; tests cross 2^32)
  uint32_t threshold;  // drop element when hash < threshold
  float scale;         // 1 / (1 - p)
  bool enabled;        // false: out = residual + x + bias
};

// Sizes and element strides of RoPE's operands: t and out [b, heads, s, hn] (strides of b,
// heads, s; unit stride along hn), cos and sin [b, s, rot] (strides of b (0 when broadcast)
// and s; unit stride along rot).
struct RopeDims {
  int64_t b, heads, s, hn, rot;
  int64_t t_sb, t_sh, t_ss;
  int64_t o_sb, o_sh, o_ss;
  int64_t c_sb, c_ss;
  int64_t s_sb, s_ss;
};

// One ISA's kernels. `dt`: DType of the activation buffers; `wdt`: DType of LayerNorm's
// weight/bias (and their gradients). Null bias/weight pointers mean "absent".
// `scratch` buffers are fp32, sized by the caller as documented in fused_bindings.cpp.
struct KernelTable {
  void (*bias_gelu_fwd)(const void* x, const void* bias, void* y, int64_t rows, int64_t cols,
                        int dt, int nthreads);
  void (*bias_gelu_bwd)(const void* dy, const void* x, const void* bias, void* dx, void* dbias,
                        float* scratch, int64_t rows, int64_t cols, int dt, int nthreads);
  void (*bias_dropout_add_fwd)(const void* x, const void* bias, const void* residual, void* out,
                               int64_t rows, int64_t cols, DropoutArgs drop, int dt,
                               int nthreads);
  void (*bias_dropout_add_bwd)(const void* dy, void* dx, void* dbias, float* scratch,
                               int64_t rows, int64_t cols, DropoutArgs drop, int dt,
                               int nthreads);
  void (*layer_norm_fwd)(const void* x, const void* w, const void* b, void* y, float* mean,
                         float* rstd, int64_t rows, int64_t h, float eps, int dt, int wdt,
                         int nthreads);
  void (*layer_norm_bwd)(const void* dy, const void* x, const float* mean, const float* rstd,
                         const void* w, void* dx, void* dw, void* db, float* scratch,
                         int64_t rows, int64_t h, int dt, int wdt, int nthreads);
  void (*softmax_fwd)(const void* x, void* y, float* scratch, int64_t batches, int64_t sq,
                      int64_t sk, float scale, int dt, int nthreads);
  void (*softmax_bwd)(const void* dy, const void* y, void* dx, int64_t batches, int64_t sq,
                      int64_t sk, float scale, int dt, int nthreads);
  // The Llama family (fused_llama_impl.h): RMSNorm's weight has x's dtype; SwiGLU's rows
  // are [rows, 2f] in, [rows, f] out; RoPE writes out (backward: the gradient of t) from t.
  void (*rms_norm_fwd)(const void* x, const void* w, void* y, float* rstd, int64_t rows,
                       int64_t h, float eps, int dt, int nthreads);
  void (*rms_norm_bwd)(const void* dy, const void* x, const float* rstd, const void* w, void* dx,
                       void* dw, float* scratch, int64_t rows, int64_t h, int dt, int nthreads);
  void (*swiglu_fwd)(const void* y, const void* bias, void* out, int64_t rows, int64_t f,
                     int dt, int nthreads);
  void (*swiglu_bwd)(const void* dout, const void* y, const void* bias, void* dy, void* dbias,
                     float* scratch, int64_t rows, int64_t f, int dt, int nthreads);
  void (*rope)(const void* t, const void* cos, const void* sin, void* out, RopeDims dims,
               bool backward, int dt, int nthreads);
};

MZ_DECLARE_SIMD_TABLES(KernelTable, kTable)

}  // namespace megazero_fused
