// Kernel bodies of the fused model ops, written once against the Vf interface of
// vec_{scalar,avx2,avx512}.h and compiled once per SIMD level (fused_simd.cpp). No include
// guard: fused_simd.cpp includes it inside the level's namespace.
//
// Layouts (row-major, contiguous): activations [rows, cols]; LayerNorm rows of h elements;
// softmax [batches, sq, sk] with causal rows (row i keeps columns 0..i). All arithmetic is
// fp32 whatever the storage dtype; reductions over rows (dbias, dgamma, dbeta) use one fp32
// partial per thread in `scratch`, summed in thread order (deterministic for a thread count).

#if !defined(MZ_ISA_SCALAR)
// exp(x) of the vector levels (the scalar level's vec_scalar.h calls std::exp): Cephes
// polynomial on [-ln2/2, ln2/2], about 1 ulp, inputs clamped to [-87.34, 88.38]; vround and
// vscale2n (p * 2^n) come from vec_<level>.h.
static inline Vf vexp(Vf x) {
  Vf t = vmin(vmax(x, vset1(-87.33654f)), vset1(88.37626f));
  Vf n = vround(t * vset1(1.44269504088896341f));
  Vf r = vfnma(n, vset1(0.693359375f), t);
  r = vfnma(n, vset1(-2.12194440e-4f), r);
  Vf p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  p = vfma(p, r * r, r + vset1(1.0f));
  return vscale2n(p, n);
}
#endif

// GPT-2's tanh GELU, 0.5*y*(1+tanh(k0*y*(1+k1*y^2))), written as y*sigmoid(z) with
// z = 2*k0*y*(1+k1*y^2), which is the same function.
constexpr float kGeluC1 = 2.0f * 0.79788456f;
constexpr float kGeluC2 = 2.0f * 0.79788456f * 0.044715f;

static inline Vf gelu_fwd(Vf y) {
  Vf z = y * vfma(y * y, vset1(kGeluC2), vset1(kGeluC1));
  return y / (vset1(1.0f) + vexp(vzero() - z));
}

// d gelu / dy = s + y*s*(1-s)*dz/dy, dz/dy = C1 + 3*C2*y^2.
static inline Vf gelu_grad(Vf y) {
  Vf y2 = y * y;
  Vf z = y * vfma(y2, vset1(kGeluC2), vset1(kGeluC1));
  Vf s = vset1(1.0f) / (vset1(1.0f) + vexp(vzero() - z));
  Vf dz = vfma(y2, vset1(3.0f * kGeluC2), vset1(kGeluC1));
  return vfma(y * s * (vset1(1.0f) - s), dz, s);
}

// Elements [c, c + W) of a row of h (those past h read as `fill`, and not written).
template <class T>
static inline Vf load_n(const T* p, int64_t c, int64_t h, float fill) {
  return c + W <= h ? vload(p + c) : vload_part(p + c, static_cast<int>(h - c), fill);
}
template <class T>
static inline void store_n(T* p, int64_t c, int64_t h, Vf v) {
  if (c + W <= h) vstore(p + c, v); else vstore_part(p + c, v, static_cast<int>(h - c));
}

// Threads worth starting for `work` elements (OpenMP start-up costs a few microseconds).
static inline int team_size(int64_t work, int nthreads) {
  int64_t useful = work / 16384 + 1;
  return static_cast<int>(useful < nthreads ? useful : nthreads);
}

// This thread's fp32 partial of a sum over rows (`cols` wide, in scratch [nthreads, cols]),
// zeroed; nullptr when the sum is not wanted. Inside a parallel region.
static inline float* thread_partial(float* scratch, bool wanted, int64_t cols) {
  float* acc = wanted ? scratch + omp_get_thread_num() * cols : nullptr;
  if (acc) std::memset(acc, 0, sizeof(float) * cols);
  return acc;
}

// Sum the per-thread fp32 partials [nparts, cols] into out (dtype T); inside a parallel region.
template <class T>
static inline void reduce_partials(const float* parts, int nparts, int64_t cols, T* out) {
#pragma omp for schedule(static)
  for (int64_t c0 = 0; c0 < cols; c0 += 64 * W) {
    int64_t c1 = c0 + 64 * W < cols ? c0 + 64 * W : cols;
    for (int64_t c = c0; c < c1; c += W) {
      int n = static_cast<int>(c1 - c < W ? c1 - c : W);
      Vf acc = vzero();
      for (int t = 0; t < nparts; ++t) acc = acc + vload_part(parts + t * cols + c, n, 0.0f);
      vstore_part(out + c, acc, n);
    }
  }
}

// ---------------------------------------------------------------------------- bias + GELU
template <class T>
static void bias_gelu_fwd_t(const T* x, const T* bias, T* y, int64_t rows, int64_t cols,
                            int nthreads) {
#pragma omp parallel for schedule(static) num_threads(team_size(rows * cols, nthreads))
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    int64_t c = 0;
    for (; c + W <= cols; c += W) {
      Vf v = vload(xr + c);
      if (bias) v = v + vload(bias + c);
      vstore(yr + c, gelu_fwd(v));
    }
    if (c < cols) {
      int n = static_cast<int>(cols - c);
      Vf v = vload_part(xr + c, n, 0.0f);
      if (bias) v = v + vload_part(bias + c, n, 0.0f);
      vstore_part(yr + c, gelu_fwd(v), n);
    }
  }
}

// dx = dy * gelu'(x + bias); dbias = sum over rows of dx.
template <class T>
static void bias_gelu_bwd_t(const T* dy, const T* x, const T* bias, T* dx, T* dbias,
                            float* scratch, int64_t rows, int64_t cols, int nthreads) {
#pragma omp parallel num_threads(team_size(rows * cols, nthreads))
  {
    float* acc = thread_partial(scratch, bias != nullptr, cols);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = x + r * cols;
      const T* dyr = dy + r * cols;
      T* dxr = dx + r * cols;
      for (int64_t c = 0; c < cols; c += W) {
        Vf v = load_n(xr, c, cols, 0.0f);
        if (bias) v = v + load_n(bias, c, cols, 0.0f);
        Vf g = load_n(dyr, c, cols, 0.0f) * gelu_grad(v);
        store_n(dxr, c, cols, g);
        if (acc) store_n(acc, c, cols, load_n(acc, c, cols, 0.0f) + g);
      }
    }
    if (bias) reduce_partials(scratch, omp_get_num_threads(), cols, dbias);
  }
}

// ------------------------------------------------------------- bias + dropout + residual add
// Multipliers (0 or scale) of the W elements starting at flat index i0.
static inline Vf dropout_mult(uint64_t i0, const DropoutArgs& d, uint32_t& key_hi,
                              uint32_t& key) {
  uint32_t hi = static_cast<uint32_t>(i0 >> 32), lo = static_cast<uint32_t>(i0);
  if (hi != key_hi) {
    key_hi = hi;
    key = dropout_key(d.seed, hi);
  }
  if (lo <= 0xffffffffu - (W - 1)) return vdropout(lo, key, d.threshold, d.scale);
  float m[W];  // the W lanes straddle a 2^32 boundary: per lane, with its own key
  for (int k = 0; k < W; ++k) {
    uint64_t i = i0 + k;
    uint32_t kk = dropout_key(d.seed, static_cast<uint32_t>(i >> 32));
    m[k] = mix32(mix32(static_cast<uint32_t>(i) ^ kk)) >= d.threshold ? d.scale : 0.0f;
  }
  return vload(m);
}

template <class T>
static void bias_dropout_add_fwd_t(const T* x, const T* bias, const T* res, T* out,
                                   int64_t rows, int64_t cols, DropoutArgs d, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(team_size(rows * cols, nthreads))
  for (int64_t r = 0; r < rows; ++r) {
    uint32_t key_hi = static_cast<uint32_t>(d.offset >> 32);
    uint32_t key = dropout_key(d.seed, key_hi);
    const T* xr = x + r * cols;
    const T* rr = res + r * cols;
    T* outr = out + r * cols;
    for (int64_t c = 0; c < cols; c += W) {
      Vf v = load_n(xr, c, cols, 0.0f);
      if (bias) v = v + load_n(bias, c, cols, 0.0f);
      Vf base = load_n(rr, c, cols, 0.0f);
      Vf o = d.enabled ? vfma(v, dropout_mult(d.offset + r * cols + c, d, key_hi, key), base)
                       : v + base;
      store_n(outr, c, cols, o);
    }
  }
}

// dx = dy * mask * scale (the mask regenerated from the seed); dbias = sum over rows of dx.
template <class T>
static void bias_dropout_add_bwd_t(const T* dy, T* dx, T* dbias, float* scratch, int64_t rows,
                                   int64_t cols, DropoutArgs d, int nthreads) {
#pragma omp parallel num_threads(team_size(rows * cols, nthreads))
  {
    float* acc = thread_partial(scratch, dbias != nullptr, cols);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      uint32_t key_hi = static_cast<uint32_t>(d.offset >> 32);
      uint32_t key = dropout_key(d.seed, key_hi);
      const T* dyr = dy + r * cols;
      T* dxr = dx + r * cols;
      for (int64_t c = 0; c < cols; c += W) {
        Vf g = load_n(dyr, c, cols, 0.0f);
        if (d.enabled) g = g * dropout_mult(d.offset + r * cols + c, d, key_hi, key);
        store_n(dxr, c, cols, g);
        if (acc) store_n(acc, c, cols, load_n(acc, c, cols, 0.0f) + g);
      }
    }
    if (dbias) reduce_partials(scratch, omp_get_num_threads(), cols, dbias);
  }
}

// LayerNorm and the causal softmax: their bodies are in their own file.
#include "fused_norm_softmax_impl.h"
// RMSNorm, SwiGLU and RoPE, with their dtype-dispatching entries.
#include "fused_llama_impl.h"

// ------------------------------------------------------------------ dtype-dispatching entries
#define MZ_AS(T, p) static_cast<T>(p)

static void bias_gelu_fwd(const void* x, const void* b, void* y, int64_t rows, int64_t cols,
                          int dt, int nt) {
  if (dt == kBFloat16)
    bias_gelu_fwd_t(MZ_AS(const bf16_t*, x), MZ_AS(const bf16_t*, b), MZ_AS(bf16_t*, y), rows,
                    cols, nt);
  else
    bias_gelu_fwd_t(MZ_AS(const float*, x), MZ_AS(const float*, b), MZ_AS(float*, y), rows,
                    cols, nt);
}

static void bias_gelu_bwd(const void* dy, const void* x, const void* b, void* dx, void* db,
                          float* scratch, int64_t rows, int64_t cols, int dt, int nt) {
  if (dt == kBFloat16)
    bias_gelu_bwd_t(MZ_AS(const bf16_t*, dy), MZ_AS(const bf16_t*, x), MZ_AS(const bf16_t*, b),
                    MZ_AS(bf16_t*, dx), MZ_AS(bf16_t*, db), scratch, rows, cols, nt);
  else
    bias_gelu_bwd_t(MZ_AS(const float*, dy), MZ_AS(const float*, x), MZ_AS(const float*, b),
                    MZ_AS(float*, dx), MZ_AS(float*, db), scratch, rows, cols, nt);
}

static void bias_dropout_add_fwd(const void* x, const void* b, const void* res, void* out,
                                 int64_t rows, int64_t cols, DropoutArgs d, int dt, int nt) {
  if (dt == kBFloat16)
    bias_dropout_add_fwd_t(MZ_AS(const bf16_t*, x), MZ_AS(const bf16_t*, b),
                           MZ_AS(const bf16_t*, res), MZ_AS(bf16_t*, out), rows, cols, d, nt);
  else
    bias_dropout_add_fwd_t(MZ_AS(const float*, x), MZ_AS(const float*, b),
                           MZ_AS(const float*, res), MZ_AS(float*, out), rows, cols, d, nt);
}

static void bias_dropout_add_bwd(const void* dy, void* dx, void* db, float* scratch,
                                 int64_t rows, int64_t cols, DropoutArgs d, int dt, int nt) {
  if (dt == kBFloat16)
    bias_dropout_add_bwd_t(MZ_AS(const bf16_t*, dy), MZ_AS(bf16_t*, dx), MZ_AS(bf16_t*, db),
                           scratch, rows, cols, d, nt);
  else
    bias_dropout_add_bwd_t(MZ_AS(const float*, dy), MZ_AS(float*, dx), MZ_AS(float*, db),
                           scratch, rows, cols, d, nt);
}

template <class T>
static void layer_norm_fwd_w(const T* x, const void* w, const void* b, T* y, float* mean,
                             float* rstd, int64_t rows, int64_t h, float eps, int wdt, int nt) {
  if (wdt == kBFloat16)
    layer_norm_fwd_t(x, MZ_AS(const bf16_t*, w), MZ_AS(const bf16_t*, b), y, mean, rstd, rows,
                     h, eps, nt);
  else
    layer_norm_fwd_t(x, MZ_AS(const float*, w), MZ_AS(const float*, b), y, mean, rstd, rows, h,
                     eps, nt);
}

static void layer_norm_fwd(const void* x, const void* w, const void* b, void* y, float* mean,
                           float* rstd, int64_t rows, int64_t h, float eps, int dt, int wdt,
                           int nt) {
  if (dt == kBFloat16)
    layer_norm_fwd_w(MZ_AS(const bf16_t*, x), w, b, MZ_AS(bf16_t*, y), mean, rstd, rows, h,
                     eps, wdt, nt);
  else
    layer_norm_fwd_w(MZ_AS(const float*, x), w, b, MZ_AS(float*, y), mean, rstd, rows, h, eps,
                     wdt, nt);
}

template <class T>
static void layer_norm_bwd_w(const T* dy, const T* x, const float* mean, const float* rstd,
                             const void* w, T* dx, void* dw, void* db, float* scratch,
                             int64_t rows, int64_t h, int wdt, int nt) {
  if (wdt == kBFloat16)
    layer_norm_bwd_t(dy, x, mean, rstd, MZ_AS(const bf16_t*, w), dx, MZ_AS(bf16_t*, dw),
                     MZ_AS(bf16_t*, db), scratch, rows, h, nt);
  else
    layer_norm_bwd_t(dy, x, mean, rstd, MZ_AS(const float*, w), dx, MZ_AS(float*, dw),
                     MZ_AS(float*, db), scratch, rows, h, nt);
}

static void layer_norm_bwd(const void* dy, const void* x, const float* mean, const float* rstd,
                           const void* w, void* dx, void* dw, void* db, float* scratch,
                           int64_t rows, int64_t h, int dt, int wdt, int nt) {
  if (dt == kBFloat16)
    layer_norm_bwd_w(MZ_AS(const bf16_t*, dy), MZ_AS(const bf16_t*, x), mean, rstd, w,
                     MZ_AS(bf16_t*, dx), dw, db, scratch, rows, h, wdt, nt);
  else
    layer_norm_bwd_w(MZ_AS(const float*, dy), MZ_AS(const float*, x), mean, rstd, w,
                     MZ_AS(float*, dx), dw, db, scratch, rows, h, wdt, nt);
}

static void softmax_fwd(const void* x, void* y, float* scratch, int64_t batches, int64_t sq,
                        int64_t sk, float scale, int dt, int nt) {
  if (dt == kBFloat16)
    softmax_fwd_t(MZ_AS(const bf16_t*, x), MZ_AS(bf16_t*, y), scratch, batches, sq, sk, scale,
                  nt);
  else
    softmax_fwd_t(MZ_AS(const float*, x), MZ_AS(float*, y), nullptr, batches, sq, sk, scale,
                  nt);
}

static void softmax_bwd(const void* dy, const void* y, void* dx, int64_t batches, int64_t sq,
                        int64_t sk, float scale, int dt, int nt) {
  if (dt == kBFloat16)
    softmax_bwd_t(MZ_AS(const bf16_t*, dy), MZ_AS(const bf16_t*, y), MZ_AS(bf16_t*, dx),
                  batches, sq, sk, scale, nt);
  else
    softmax_bwd_t(MZ_AS(const float*, dy), MZ_AS(const float*, y), MZ_AS(float*, dx), batches,
                  sq, sk, scale, nt);
}

#undef MZ_AS

extern const KernelTable kTable = {
    bias_gelu_fwd, bias_gelu_bwd, bias_dropout_add_fwd, bias_dropout_add_bwd,
    layer_norm_fwd, layer_norm_bwd, softmax_fwd, softmax_bwd,
    rms_norm_fwd, rms_norm_bwd, swiglu_fwd, swiglu_bwd, rope,
};
