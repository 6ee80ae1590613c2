// The two LAMB stages of a run of work units, with every dtype combination: compiled once per
// SIMD level (setup.py passes -DMZ_ISA=<level> and the level's flags; see megazero/simd.h),
// each object defining that level's megazero::lamb::<level>::kKernels.
//
// Per element, in fp32, each operation rounded (no FMA), in this order:
//   stage 1:  g  = grad * grad_scale
//             ok = isfinite(g)                         (only with mask_nonfinite)
//             m' = m * beta1 + g * (1 - beta1)
//             v' = v * beta2 + (g * g) * (1 - beta2)
//             where !ok: m', v' = m, v
//             u  = (m' / bc1) / (sqrt(v' / bc2) + eps)   bc = 1 - beta^t (1: no correction)
//             u  = u + p * weight_decay                  (weight_decay != 0)
//             w_sq += p^2, u_sq += u^2                   (float64, Acc16 lane order)
//   stage 2:  u as above from the stored m', v' and p
//             p' = p - scale * u                          scale = (float)(lr * trust_ratio)
//             store p' (rounded to the param dtype) and copy = p' rounded to the copy dtype.
#include "lamb_api.h"
#include "megazero/vec.h"

namespace {

using megazero::lamb::LambConsts;
using megazero::lamb::LambSpan;

struct LambVecConsts {
  typename Vec::F beta1, omb1, beta2, omb2, eps, bc1, bc2, gscale, wd;
  LambVecConsts(const LambConsts& c, const LambSpan& s)
      : beta1(Vec::set1(c.beta1)), omb1(Vec::set1(c.one_minus_beta1)),
        beta2(Vec::set1(c.beta2)), omb2(Vec::set1(c.one_minus_beta2)), eps(Vec::set1(c.eps)),
        bc1(Vec::set1(c.bc1)), bc2(Vec::set1(c.bc2)), gscale(Vec::set1(c.grad_scale)),
        wd(Vec::set1(s.weight_decay)) {}
};

inline typename Vec::F lamb_update(const LambVecConsts& k, bool decay, typename Vec::F p,
                                   typename Vec::F m, typename Vec::F v) {
  typename Vec::F u = (m / k.bc1) / (Vec::sqrt(v / k.bc2) + k.eps);
  if (decay) u = u + p * k.wd;
  return u;
}

template <int PD, int GD>
bool stage1_range(const LambConsts& c, const LambSpan& s, int64_t b, int64_t e, double* w_sq,
                  double* u_sq) {
  using F = typename Vec::F;
  const LambVecConsts k(c, s);
  const bool decay = s.weight_decay != 0.0f, mask = c.mask_nonfinite;
  typename Vec::Acc16 wacc, uacc;
  bool bad = false;
  auto group = [&](const void* p, const void* g, float* m, float* v, int64_t i) {
    for (int part = 0; part < kParts; ++part) {
      const int64_t j = i + part * Vec::W;
      const F p0 = Vec::template load<PD>(p, j);
      const F grad = Vec::template load<GD>(g, j) * k.gscale;
      const F m0 = Vec::template load<kF32>(m, j), v0 = Vec::template load<kF32>(v, j);
      F m1 = m0 * k.beta1 + grad * k.omb1;
      F v1 = v0 * k.beta2 + (grad * grad) * k.omb2;
      if (mask) {
        const typename Vec::M ok = Vec::finite(grad);
        bad |= !Vec::all(ok);
        m1 = Vec::select(ok, m1, m0);
        v1 = Vec::select(ok, v1, v0);
      }
      Vec::template store<kF32>(m, j, m1);
      Vec::template store<kF32>(v, j, v1);
      wacc.add_sq(p0, part);
      uacc.add_sq(lamb_update(k, decay, p0, m1, v1), part);
    }
  };
  int64_t i = b;
  for (; i + kGroup <= e; i += kGroup) group(s.param, s.grad, s.exp_avg, s.exp_avg_sq, i);
  if (i < e) {  // zero padding adds exactly 0 to both sums
    const int64_t n = e - i;
    alignas(64) unsigned char pb[kGroup * 4], gb[kGroup * 4], mb[kGroup * 4], vb[kGroup * 4];
    tail_in(pb, s.param, i, n, PD);
    tail_in(gb, s.grad, i, n, GD);
    tail_in(mb, s.exp_avg, i, n, kF32);
    tail_in(vb, s.exp_avg_sq, i, n, kF32);
    group(pb, gb, reinterpret_cast<float*>(mb), reinterpret_cast<float*>(vb), 0);
    tail_out(s.exp_avg, mb, i, n, kF32);
    tail_out(s.exp_avg_sq, vb, i, n, kF32);
  }
  *w_sq = wacc.reduce();
  *u_sq = uacc.reduce();
  return bad;
}

template <int PD, int CD>
void stage2_range(const LambConsts& c, const LambSpan& s, int64_t b, int64_t e) {
  using F = typename Vec::F;
  const LambVecConsts k(c, s);
  const F scale = Vec::set1(s.scale);
  const bool decay = s.weight_decay != 0.0f;
  auto group = [&](void* p, const float* m, const float* v, void* cp, int64_t i) {
    for (int part = 0; part < kParts; ++part) {
      const int64_t j = i + part * Vec::W;
      const F p0 = Vec::template load<PD>(p, j);
      const F u = lamb_update(k, decay, p0, Vec::template load<kF32>(m, j),
                              Vec::template load<kF32>(v, j));
      const F p1 = p0 - scale * u;
      Vec::template store<PD>(p, j, p1);
      if constexpr (CD != kNone) Vec::template store<CD>(cp, j, p1);
    }
  };
  int64_t i = b;
  for (; i + kGroup <= e; i += kGroup) group(s.param, s.exp_avg, s.exp_avg_sq, s.copy, i);
  if (i < e) {
    const int64_t n = e - i;
    alignas(64) unsigned char pb[kGroup * 4], mb[kGroup * 4], vb[kGroup * 4], cb[kGroup * 4];
    tail_in(pb, s.param, i, n, PD);
    tail_in(mb, s.exp_avg, i, n, kF32);
    tail_in(vb, s.exp_avg_sq, i, n, kF32);
    group(pb, reinterpret_cast<float*>(mb), reinterpret_cast<float*>(vb), cb, 0);
    tail_out(s.param, pb, i, n, PD);
    if constexpr (CD != kNone) tail_out(s.copy, cb, i, n, CD);
  }
}

template <int PD, int GD>
bool stage1_units_t(const LambConsts& c, const LambSpan* spans, const megazero::WorkUnit* units,
                    int64_t lo, int64_t hi, double* w_sq, double* u_sq) {
  bool bad = false;
  for (int64_t u = lo; u < hi; ++u) {
    bad |= stage1_range<PD, GD>(c, spans[units[u].span], units[u].begin, units[u].end,
                                w_sq + u, u_sq + u);
  }
  return bad;
}

template <int PD>
bool stage1_by_grad(const LambConsts& c, const LambSpan* s, const megazero::WorkUnit* u,
                    int64_t lo, int64_t hi, double* w, double* q) {
  switch (c.grad_dtype) {
    case kF32: return stage1_units_t<PD, kF32>(c, s, u, lo, hi, w, q);
    case kBF16: return stage1_units_t<PD, kBF16>(c, s, u, lo, hi, w, q);
    default: return stage1_units_t<PD, kF16>(c, s, u, lo, hi, w, q);
  }
}

inline bool stage1_units(const LambConsts& c, const LambSpan* s, const megazero::WorkUnit* u,
                         int64_t lo, int64_t hi, double* w, double* q) {
  switch (c.param_dtype) {
    case kF32: return stage1_by_grad<kF32>(c, s, u, lo, hi, w, q);
    case kBF16: return stage1_by_grad<kBF16>(c, s, u, lo, hi, w, q);
    default: return stage1_by_grad<kF16>(c, s, u, lo, hi, w, q);
  }
}

template <int PD, int CD>
void stage2_units_t(const LambConsts& c, const LambSpan* spans, const megazero::WorkUnit* units,
                    int64_t lo, int64_t hi) {
  for (int64_t u = lo; u < hi; ++u) {
    stage2_range<PD, CD>(c, spans[units[u].span], units[u].begin, units[u].end);
  }
}

// The copy exists only for fp32 params (the fused step's main partition).
inline void stage2_units(const LambConsts& c, const LambSpan* s, const megazero::WorkUnit* u,
                         int64_t lo, int64_t hi) {
  if (c.param_dtype == kBF16) return stage2_units_t<kBF16, kNone>(c, s, u, lo, hi);
  if (c.param_dtype == kF16) return stage2_units_t<kF16, kNone>(c, s, u, lo, hi);
  switch (c.copy_dtype) {
    case kF32: return stage2_units_t<kF32, kF32>(c, s, u, lo, hi);
    case kBF16: return stage2_units_t<kF32, kBF16>(c, s, u, lo, hi);
    case kF16: return stage2_units_t<kF32, kF16>(c, s, u, lo, hi);
    default: return stage2_units_t<kF32, kNone>(c, s, u, lo, hi);
  }
}

}  // namespace

namespace megazero::lamb::MZ_ISA {

extern const LambKernels kKernels = {stage1_units, stage2_units};

}  // namespace megazero::lamb::MZ_ISA
