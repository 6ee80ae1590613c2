// LayerNorm and scaled upper-triangular masked softmax kernel bodies, part of
// fused_kernels_impl.h (included from there, inside the per-ISA namespace; no include
// guard for the same reason). Same conventions: fp32 arithmetic, deterministic reductions.

// ------------------------------------------------------------------------------ LayerNorm
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
    float* acc_w = thread_partial(scratch, grads, 2 * h);
    float* acc_b = grads ? acc_w + h : nullptr;
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
