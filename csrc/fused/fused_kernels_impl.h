// Kernel bodies of the fused model ops, written once against the Vf interface of
// vec_{scalar,avx2,avx512}.h and compiled per ISA (see fused_common.h). No include guard:
// each fused_<isa>.cpp includes this inside its own namespace and target pragma.
//
// Layouts (row-major, contiguous): activations [rows, cols]; LayerNorm rows of h elements;
// softmax [batches, sq, sk] with causal rows (row i keeps columns 0..i). All arithmetic is
// fp32 whatever the storage dtype; reductions over rows (dbias, dgamma, dbeta) use one fp32
// partial per thread in `scratch`, summed in thread order (deterministic for a thread count).

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

// Threads worth starting for `work` elements (OpenMP start-up costs a few microseconds).
static inline int team_size(int64_t work, int nthreads) {
  int64_t useful = work / 16384 + 1;
  return static_cast<int>(useful < nthreads ? useful : nthreads);
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
    float* acc = bias ? scratch + omp_get_thread_num() * cols : nullptr;
    if (acc) std::memset(acc, 0, sizeof(float) * cols);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = x + r * cols;
      const T* dyr = dy + r * cols;
      T* dxr = dx + r * cols;
      for (int64_t c = 0; c < cols; c += W) {
        int n = static_cast<int>(cols - c < W ? cols - c : W);
        Vf v = n == W ? vload(xr + c) : vload_part(xr + c, n, 0.0f);
        if (bias) v = v + (n == W ? vload(bias + c) : vload_part(bias + c, n, 0.0f));
        Vf g = (n == W ? vload(dyr + c) : vload_part(dyr + c, n, 0.0f)) * gelu_grad(v);
        if (n == W) {
          vstore(dxr + c, g);
          if (acc) vstore(acc + c, vload(acc + c) + g);
        } else {
          vstore_part(dxr + c, g, n);
          if (acc) vstore_part(acc + c, vload_part(acc + c, n, 0.0f) + g, n);
        }
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
      int n = static_cast<int>(cols - c < W ? cols - c : W);
      Vf v = n == W ? vload(xr + c) : vload_part(xr + c, n, 0.0f);
      if (bias) v = v + (n == W ? vload(bias + c) : vload_part(bias + c, n, 0.0f));
      Vf base = n == W ? vload(rr + c) : vload_part(rr + c, n, 0.0f);
      Vf o = d.enabled ? vfma(v, dropout_mult(d.offset + r * cols + c, d, key_hi, key), base)
                       : v + base;
      if (n == W) vstore(outr + c, o); else vstore_part(outr + c, o, n);
    }
  }
}

// dx = dy * mask * scale (the mask regenerated from the seed); dbias = sum over rows of dx.
template <class T>
static void bias_dropout_add_bwd_t(const T* dy, T* dx, T* dbias, float* scratch, int64_t rows,
                                   int64_t cols, DropoutArgs d, int nthreads) {
#pragma omp parallel num_threads(team_size(rows * cols, nthreads))
  {
    float* acc = dbias ? scratch + omp_get_thread_num() * cols : nullptr;
    if (acc) std::memset(acc, 0, sizeof(float) * cols);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      uint32_t key_hi = static_cast<uint32_t>(d.offset >> 32);
    uint32_t key = dropout_key(d.seed, key_hi);
      const T* dyr = dy + r * cols;
      T* dxr = dx + r * cols;
      for (int64_t c = 0; c < cols; c += W) {
        int n = static_cast<int>(cols - c < W ? cols - c : W);
        Vf g = n == W ? vload(dyr + c) : vload_part(dyr + c, n, 0.0f);
        if (d.enabled) g = g * dropout_mult(d.offset + r * cols + c, d, key_hi, key);
        if (n == W) {
          vstore(dxr + c, g);
          if (acc) vstore(acc + c, vload(acc + c) + g);
        } else {
          vstore_part(dxr + c, g, n);
          if (acc) vstore_part(acc + c, vload_part(acc + c, n, 0.0f) + g, n);
        }
      }
    }
    if (dbias) reduce_partials(scratch, omp_get_num_threads(), cols, dbias);
  }
}

// ------------------------------------------------------------------------------ LayerNorm
template <class T>
static inline Vf load_n(const T* p, int64_t c, int64_t h, float fill) {
  return c + W <= h ? vload(p + c) : vload_part(p + c, static_cast<int>(h - c), fill);
}
template <class T>
static inline void store_n(T* p, int64_t c, int64_t h, Vf v) {
  if (c + W <= h) vstore(p + c, v); else vstore_part(p + c, v, static_cast<int>(h - c));
}

static inline float first_value(const float* p) { return *p; }
static inline float first_value(const bf16_t* p) {
  const uint32_t bits = static_cast<uint32_t>(p->bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// y = (x - mean) * rstd * w + b per row; mean and rstd (fp32) kept for backward.
template <class T, class Wt>
static void layer_norm_fwd_t(const T* x, const Wt* w, const Wt* b, T* y, float* mean,
                             float* rstd, int64_t rows, int64_t h, float eps, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(team_size(rows * h, nthreads))
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * h;
    T* yr = y + r * h;
    // mean of (x - x[0]) + x[0]: the shift keeps the fp32 sum exact-ish for rows with a
    // large common offset (|mean| >> std), where a plain fp32 sum would lose digits
    const float shift = first_value(xr);
    const Vf vshift = vset1(shift);
    Vf s0 = vzero(), s1 = vzero();
    int64_t c = 0;
    for (; c + 2 * W <= h; c += 2 * W) {
      s0 = s0 + (vload(xr + c) - vshift);
      s1 = s1 + (vload(xr + c + W) - vshift);
    }
    for (; c < h; c += W) s0 = s0 + (load_n(xr, c, h, shift) - vshift);
    const float m = shift + vsum(s0 + s1) / static_cast<float>(h);
    const Vf vm = vset1(m);
    Vf q0 = vzero(), q1 = vzero();
    for (c = 0; c + 2 * W <= h; c += 2 * W) {
      Vf d0 = vload(xr + c) - vm, d1 = vload(xr + c + W) - vm;
      q0 = vfma(d0, d0, q0);
      q1 = vfma(d1, d1, q1);
    }
    for (; c < h; c += W) {
      Vf d0 = load_n(xr, c, h, m) - vm;
      q0 = vfma(d0, d0, q0);
    }
    const float rs = 1.0f / std::sqrt(vsum(q0 + q1) / static_cast<float>(h) + eps);
    mean[r] = m;
    rstd[r] = rs;
    const Vf vrs = vset1(rs);
    for (c = 0; c < h; c += W) {
      Vf v = (load_n(xr, c, h, 0.0f) - vm) * vrs;
      if (w) v = v * load_n(w, c, h, 0.0f);
      if (b) v = v + load_n(b, c, h, 0.0f);
      store_n(yr, c, h, v);
    }
  }
}

// With xhat = (x - mean) * rstd and g = dy * w:
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),  dw = sum_rows dy * xhat,
//   db = sum_rows dy.   scratch: [nthreads, 2h] fp32.
template <class T, class Wt>
static void layer_norm_bwd_t(const T* dy, const T* x, const float* mean, const float* rstd,
                             const Wt* w, T* dx, Wt* dw, Wt* db, float* scratch, int64_t rows,
                             int64_t h, int nthreads) {
  const bool grads = dw != nullptr;
#pragma omp parallel num_threads(team_size(rows * h, nthreads))
  {
    float* acc_w = grads ? scratch + omp_get_thread_num() * 2 * h : nullptr;
    float* acc_b = grads ? acc_w + h : nullptr;
    if (grads) std::memset(acc_w, 0, sizeof(float) * 2 * h);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = x + r * h;
      const T* dyr = dy + r * h;
      T* dxr = dx + r * h;
      const Vf vm = vset1(mean[r]), vrs = vset1(rstd[r]);
      Vf sg = vzero(), sgx = vzero();
      for (int64_t c = 0; c < h; c += W) {
        Vf xh = (load_n(xr, c, h, mean[r]) - vm) * vrs;
        Vf d = load_n(dyr, c, h, 0.0f);
        Vf g = w ? d * load_n(w, c, h, 0.0f) : d;
        sg = sg + g;
        sgx = vfma(g, xh, sgx);
        if (grads) {
          store_n(acc_w, c, h, vfma(d, xh, load_n(acc_w, c, h, 0.0f)));
          store_n(acc_b, c, h, load_n(acc_b, c, h, 0.0f) + d);
        }
      }
      const Vf a = vset1(vsum(sg) / static_cast<float>(h));
      const Vf cc = vset1(vsum(sgx) / static_cast<float>(h));
      for (int64_t c = 0; c < h; c += W) {
        Vf xh = (load_n(xr, c, h, 0.0f) - vm) * vrs;
        Vf d = load_n(dyr, c, h, 0.0f);
        Vf g = w ? d * load_n(w, c, h, 0.0f) : d;
        store_n(dxr, c, h, vfnma(xh, cc, g - a) * vrs);
      }
    }
    if (grads) {
      // partials interleave [w | b] per thread: reduce both halves as one 2h-wide row set
      const int nparts = omp_get_num_threads();
#pragma omp for schedule(static)
      for (int64_t c = 0; c < h; c += W) {
        Vf aw = vzero(), ab = vzero();
        for (int t = 0; t < nparts; ++t) {
          aw = aw + load_n(scratch + t * 2 * h, c, h, 0.0f);
          ab = ab + load_n(scratch + t * 2 * h + h, c, h, 0.0f);
        }
        store_n(dw, c, h, aw);
        store_n(db, c, h, ab);
      }
    }
  }
}

// -------------------------------------------------- scaled upper-triangular masked softmax
// Row i of each [sq, sk] matrix: y[j] = softmax(scale * x[0..i])[j] for j <= i, else 0.
// scratch: [nthreads, sk] fp32 (used for non-fp32 storage).
template <class T>
static void softmax_fwd_t(const T* x, T* y, float* scratch, int64_t batches, int64_t sq,
                          int64_t sk, float scale, int nthreads) {
  const int64_t rows = batches * sq;
  const Vf vs = vset1(scale);
  const Vf ninf = vset1(-INFINITY);
#pragma omp parallel num_threads(team_size(rows * sk / 2, nthreads))
  {
    float* buf = scratch ? scratch + omp_get_thread_num() * sk : nullptr;
#pragma omp for schedule(static, 8)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t n = r % sq + 1 < sk ? r % sq + 1 : sk;  // unmasked columns
      const T* xr = x + r * sk;
      T* yr = y + r * sk;
      float* e = buf ? buf : reinterpret_cast<float*>(yr);
      Vf mx = ninf;
      for (int64_t c = 0; c < n; c += W) {
        Vf v = load_n(xr, c, n, 0.0f) * vs;
        mx = vmax(mx, c + W <= n ? v : vfirst(v, static_cast<int>(n - c), ninf));
      }
      const Vf m = vset1(vhmax(mx));
      Vf sum = vzero();
      for (int64_t c = 0; c < n; c += W) {
        Vf v = vexp(vfma(load_n(xr, c, n, 0.0f), vs, vzero() - m));
        if (c + W > n) v = vfirst(v, static_cast<int>(n - c), vzero());
        store_n(e, c, n, v);
        sum = sum + v;
      }
      const Vf inv = vset1(1.0f / vsum(sum));
      for (int64_t c = 0; c < n; c += W) store_n(yr, c, n, load_n(e, c, n, 0.0f) * inv);
      if (n < sk) std::memset(static_cast<void*>(yr + n), 0, sizeof(T) * (sk - n));
    }
  }
}

// dx[j] = scale * y[j] * (dy[j] - sum_k dy[k] * y[k]) for j <= i, else 0.
template <class T>
static void softmax_bwd_t(const T* dy, const T* y, T* dx, int64_t batches, int64_t sq,
                          int64_t sk, float scale, int nthreads) {
  const int64_t rows = batches * sq;
#pragma omp parallel for schedule(static, 8) num_threads(team_size(rows * sk / 2, nthreads))
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = r % sq + 1 < sk ? r % sq + 1 : sk;
    const T* dyr = dy + r * sk;
    const T* yr = y + r * sk;
    T* dxr = dx + r * sk;
    Vf dot = vzero();
    for (int64_t c = 0; c < n; c += W)
      dot = vfma(load_n(dyr, c, n, 0.0f), load_n(yr, c, n, 0.0f), dot);
    const Vf vd = vset1(vsum(dot)), vs = vset1(scale);
    for (int64_t c = 0; c < n; c += W)
      store_n(dxr, c, n, (load_n(dyr, c, n, 0.0f) - vd) * load_n(yr, c, n, 0.0f) * vs);
    if (n < sk) std::memset(static_cast<void*>(dxr + n), 0, sizeof(T) * (sk - n));
  }
}

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
};
