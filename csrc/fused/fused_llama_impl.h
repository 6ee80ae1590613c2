// RMSNorm, bias + SwiGLU and RoPE kernel bodies (the Llama family's ops), part of
// fused_kernels_impl.h (included from there, inside the per-ISA namespace; no include guard for
// the same reason). Same conventions: fp32 arithmetic whatever the storage dtype, each + - * /
// rounded as the PyTorch reference rounds it, reductions over rows as per-thread fp32 partials.

// -------------------------------------------------------------------------------- RMSNorm
// y = x * rstd * w per row of h, rstd = 1 / sqrt(mean(x^2) + eps) kept (fp32) for backward.
template <class T>
static void rms_norm_fwd_t(const T* x, const T* w, T* y, float* rstd, int64_t rows, int64_t h,
                           float eps, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(team_size(rows * h, nthreads))
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * h;
    T* yr = y + r * h;
    Vf q0 = vzero(), q1 = vzero();
    int64_t c = 0;
    for (; c + 2 * W <= h; c += 2 * W) {
      Vf a = vload(xr + c), b = vload(xr + c + W);
      q0 = q0 + a * a;
      q1 = q1 + b * b;
    }
    for (; c < h; c += W) {
      Vf a = load_n(xr, c, h, 0.0f);
      q0 = q0 + a * a;
    }
    const float rs = 1.0f / std::sqrt(vsum(q0 + q1) / static_cast<float>(h) + eps);
    rstd[r] = rs;
    const Vf vrs = vset1(rs);
    for (c = 0; c < h; c += W)
      store_n(yr, c, h, load_n(xr, c, h, 0.0f) * vrs * load_n(w, c, h, 0.0f));
  }
}

// With xhat = x * rstd and g = dy * w:  dx = rstd * (g - xhat * mean(g * xhat)),
// dw = sum_rows dy * xhat (scratch [nthreads, h] fp32; dw null: not wanted).
template <class T>
static void rms_norm_bwd_t(const T* dy, const T* x, const float* rstd, const T* w, T* dx, T* dw,
                           float* scratch, int64_t rows, int64_t h, int nthreads) {
#pragma omp parallel num_threads(team_size(rows * h, nthreads))
  {
    float* acc = thread_partial(scratch, dw != nullptr, h);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = x + r * h;
      const T* dyr = dy + r * h;
      T* dxr = dx + r * h;
      const Vf vrs = vset1(rstd[r]);
      Vf sgx = vzero();
      for (int64_t c = 0; c < h; c += W) {
        Vf xh = load_n(xr, c, h, 0.0f) * vrs;
        Vf d = load_n(dyr, c, h, 0.0f);
        sgx = vfma(d * load_n(w, c, h, 0.0f), xh, sgx);
        if (acc) store_n(acc, c, h, vfma(d, xh, load_n(acc, c, h, 0.0f)));
      }
      const Vf m = vset1(vsum(sgx) / static_cast<float>(h));
      for (int64_t c = 0; c < h; c += W) {
        Vf xh = load_n(xr, c, h, 0.0f) * vrs;
        Vf g = load_n(dyr, c, h, 0.0f) * load_n(w, c, h, 0.0f);
        store_n(dxr, c, h, vfnma(xh, m, g) * vrs);
      }
    }
    if (dw) reduce_partials(scratch, omp_get_num_threads(), h, dw);
  }
}

// ------------------------------------------------------------------------- bias + SwiGLU
// Rows of 2f hold (gate, up) pairs; the W pairs from pair j are the 2W elements from 2j, read
// as two vectors (past the row's end as 0) and split into gates and ups, or written back.
template <class T>
static inline void load_block(const T* p, int64_t j, int64_t f, Vf& a, Vf& b) {
  if (j + W <= f) {
    a = vload(p + 2 * j);
    b = vload(p + 2 * j + W);
  } else {
    const int n = static_cast<int>(2 * (f - j));  // valid elements, < 2W
    a = vload_part(p + 2 * j, n < W ? n : W, 0.0f);
    b = n > W ? vload_part(p + 2 * j + W, n - W, 0.0f) : vzero();
  }
}
template <class T>
static inline void store_block(T* p, int64_t j, int64_t f, Vf a, Vf b) {
  if (j + W <= f) {
    vstore(p + 2 * j, a);
    vstore(p + 2 * j + W, b);
  } else {
    const int n = static_cast<int>(2 * (f - j));
    vstore_part(p + 2 * j, a, n < W ? n : W);
    if (n > W) vstore_part(p + 2 * j + W, b, n - W);
  }
}
template <class T>
static inline void load_pairs(const T* p, int64_t j, int64_t f, Vf& gate, Vf& up) {
  Vf a, b;
  load_block(p, j, f, a, b);
  vdeinterleave(a, b, gate, up);
}

// out[r, j] = silu(g) * u with (g, u) = y[r, 2j:2j+2] + bias[2j:2j+2]; silu(g) = g / (1 + e^-g).
template <class T>
static void swiglu_fwd_t(const T* y, const T* bias, T* out, int64_t rows, int64_t f,
                         int nthreads) {
#pragma omp parallel for schedule(static) num_threads(team_size(rows * 2 * f, nthreads))
  for (int64_t r = 0; r < rows; ++r) {
    const T* yr = y + r * 2 * f;
    T* outr = out + r * f;
    for (int64_t j = 0; j < f; j += W) {
      Vf g, u;
      load_pairs(yr, j, f, g, u);
      if (bias) {
        Vf bg, bu;
        load_pairs(bias, j, f, bg, bu);
        g = g + bg;
        u = u + bu;
      }
      store_n(outr, j, f, g / (vset1(1.0f) + vexp(vzero() - g)) * u);
    }
  }
}

// With s = sigmoid(g): dg = dout * u * s * (1 + g * (1 - s)), du = dout * g * s, written
// interleaved into dy; dbias = sum over rows of dy (scratch [nthreads, 2f] fp32).
template <class T>
static void swiglu_bwd_t(const T* dout, const T* y, const T* bias, T* dy, T* dbias,
                         float* scratch, int64_t rows, int64_t f, int nthreads) {
  const Vf one = vset1(1.0f);
#pragma omp parallel num_threads(team_size(rows * 2 * f, nthreads))
  {
    float* acc = thread_partial(scratch, dbias != nullptr, 2 * f);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* yr = y + r * 2 * f;
      const T* dor = dout + r * f;
      T* dyr = dy + r * 2 * f;
      for (int64_t j = 0; j < f; j += W) {
        Vf g, u;
        load_pairs(yr, j, f, g, u);
        if (bias) {
          Vf bg, bu;
          load_pairs(bias, j, f, bg, bu);
          g = g + bg;
          u = u + bu;
        }
        const Vf s = one / (one + vexp(vzero() - g));
        const Vf d = load_n(dor, j, f, 0.0f);
        const Vf dg = d * u * (s * vfma(g, one - s, one));
        const Vf du = d * (g * s);
        Vf a, b;  // (dg, du) interleaved as y is
        vinterleave(dg, du, a, b);
        store_block(dyr, j, f, a, b);
        if (acc) {
          Vf pa, pb;
          load_block(acc, j, f, pa, pb);
          store_block(acc, j, f, pa + a, pb + b);
        }
      }
    }
    if (dbias) reduce_partials(scratch, omp_get_num_threads(), 2 * f, dbias);
  }
}

// ---------------------------------------------------------------------------------- RoPE
// Rows of t [b, heads, s, hn] (element strides below, unit stride within a row) rotated on
// their first rot dims, half = rot / 2, with the cos/sin rows of [b, s, rot] (stride 0 on a
// broadcast batch):
//   forward   o1 = x1 * c1 - x2 * s1,  o2 = x2 * c2 + x1 * s2
//   backward  o1 = x1 * c1 + x2 * s2,  o2 = x2 * c2 - x1 * s1   (x = the output's gradient)
// and dims rot..hn copied.
template <class T>
static void rope_t(const T* t, const T* cs, const T* sn, T* out, const RopeDims& d,
                   bool backward, int nthreads) {
  const int64_t half = d.rot / 2;
#pragma omp parallel for collapse(3) schedule(static) \
    num_threads(team_size(d.b * d.heads * d.s * d.hn, nthreads))
  for (int64_t ib = 0; ib < d.b; ++ib) {
    for (int64_t ih = 0; ih < d.heads; ++ih) {
      for (int64_t is = 0; is < d.s; ++is) {
        const T* tr = t + ib * d.t_sb + ih * d.t_sh + is * d.t_ss;
        T* outr = out + ib * d.o_sb + ih * d.o_sh + is * d.o_ss;
        const T* cr = cs + ib * d.c_sb + is * d.c_ss;
        const T* sr = sn + ib * d.s_sb + is * d.s_ss;
        for (int64_t c = 0; c < half; c += W) {
          const Vf x1 = load_n(tr, c, half, 0.0f), x2 = load_n(tr + half, c, half, 0.0f);
          const Vf c1 = load_n(cr, c, half, 0.0f), c2 = load_n(cr + half, c, half, 0.0f);
          const Vf s1 = load_n(sr, c, half, 0.0f), s2 = load_n(sr + half, c, half, 0.0f);
          Vf o1, o2;
          if (backward) {
            o1 = x1 * c1 + x2 * s2;
            o2 = x2 * c2 - x1 * s1;
          } else {
            o1 = x1 * c1 - x2 * s1;
            o2 = x2 * c2 + x1 * s2;
          }
          store_n(outr, c, half, o1);
          store_n(outr + half, c, half, o2);
        }
        if (d.rot < d.hn) std::memcpy(outr + d.rot, tr + d.rot, sizeof(T) * (d.hn - d.rot));
      }
    }
  }
}

// ------------------------------------------------------------------ dtype-dispatching entries
static void rms_norm_fwd(const void* x, const void* w, void* y, float* rstd, int64_t rows,
                         int64_t h, float eps, int dt, int nt) {
  if (dt == kBFloat16)
    rms_norm_fwd_t(static_cast<const bf16_t*>(x), static_cast<const bf16_t*>(w),
                   static_cast<bf16_t*>(y), rstd, rows, h, eps, nt);
  else
    rms_norm_fwd_t(static_cast<const float*>(x), static_cast<const float*>(w),
                   static_cast<float*>(y), rstd, rows, h, eps, nt);
}

static void rms_norm_bwd(const void* dy, const void* x, const float* rstd, const void* w,
                         void* dx, void* dw, float* scratch, int64_t rows, int64_t h, int dt,
                         int nt) {
  if (dt == kBFloat16)
    rms_norm_bwd_t(static_cast<const bf16_t*>(dy), static_cast<const bf16_t*>(x), rstd,
                   static_cast<const bf16_t*>(w), static_cast<bf16_t*>(dx),
                   static_cast<bf16_t*>(dw), scratch, rows, h, nt);
  else
    rms_norm_bwd_t(static_cast<const float*>(dy), static_cast<const float*>(x), rstd,
                   static_cast<const float*>(w), static_cast<float*>(dx),
                   static_cast<float*>(dw), scratch, rows, h, nt);
}

static void swiglu_fwd(const void* y, const void* bias, void* out, int64_t rows, int64_t f,
                       int dt, int nt) {
  if (dt == kBFloat16)
    swiglu_fwd_t(static_cast<const bf16_t*>(y), static_cast<const bf16_t*>(bias),
                 static_cast<bf16_t*>(out), rows, f, nt);
  else
    swiglu_fwd_t(static_cast<const float*>(y), static_cast<const float*>(bias),
                 static_cast<float*>(out), rows, f, nt);
}

static void swiglu_bwd(const void* dout, const void* y, const void* bias, void* dy, void* dbias,
                       float* scratch, int64_t rows, int64_t f, int dt, int nt) {
  if (dt == kBFloat16)
    swiglu_bwd_t(static_cast<const bf16_t*>(dout), static_cast<const bf16_t*>(y),
                 static_cast<const bf16_t*>(bias), static_cast<bf16_t*>(dy),
                 static_cast<bf16_t*>(dbias), scratch, rows, f, nt);
  else
    swiglu_bwd_t(static_cast<const float*>(dout), static_cast<const float*>(y),
                 static_cast<const float*>(bias), static_cast<float*>(dy),
                 static_cast<float*>(dbias), scratch, rows, f, nt);
}

static void rope(const void* t, const void* cs, const void* sn, void* out, RopeDims d,
                 bool backward, int dt, int nt) {
  if (dt == kBFloat16)
    rope_t(static_cast<const bf16_t*>(t), static_cast<const bf16_t*>(cs),
           static_cast<const bf16_t*>(sn), static_cast<bf16_t*>(out), d, backward, nt);
  else
    rope_t(static_cast<const float*>(t), static_cast<const float*>(cs),
           static_cast<const float*>(sn), static_cast<float*>(out), d, backward, nt);
}
