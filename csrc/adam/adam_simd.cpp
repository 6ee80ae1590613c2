// The Adam/AdamW update of a run of work units, with every dtype combination, and the float64
// sum of squares behind the global gradient norm: compiled once per SIMD level (setup.py passes
// -DMZ_ISA=<level> and the level's flags; see megazero/simd.h), each object defining that
// level's megazero::adam::<level>::kKernels.
//
// Per element, in fp32, each operation rounded (no FMA), in this order:
//   g  = grad * grad_scale
//   ok = isfinite(g)                                  (only with mask_nonfinite)
//   g  = g + p * weight_decay                         (L2 mode, weight_decay != 0)
//   m' = m * beta1 + g * (1 - beta1)
//   v' = v * beta2 + (g * g) * (1 - beta2)
//   d  = sqrt(v') / sqrt(1 - beta2^t) + eps
//   p' = p * (1 - lr * weight_decay)                  (AdamW mode, weight_decay != 0)
//   p' = p' - (step_size * m') / d                    step_size = lr / (1 - beta1^t)
//   where !ok: p', m', v' = p, m, v
//   store p' (rounded to the param dtype), m', v', and copy = p' rounded to the copy dtype.
#include "adam_api.h"
#include "megazero/sumsq_kernel.h"
#include "megazero/vec.h"

namespace {

using megazero::adam::AdamConsts;
using megazero::adam::AdamSpan;

template <int PD, int GD, int CD>
bool adam_range(const AdamConsts& c, const AdamSpan& s, int64_t b, int64_t e) {
  using F = typename Vec::F;
  const F beta1 = Vec::set1(c.beta1), omb1 = Vec::set1(c.one_minus_beta1);
  const F beta2 = Vec::set1(c.beta2), omb2 = Vec::set1(c.one_minus_beta2);
  const F eps = Vec::set1(c.eps), step = Vec::set1(c.step_size), bc2 = Vec::set1(c.bc2_sqrt);
  const F gscale = Vec::set1(c.grad_scale);
  const F wd = Vec::set1(s.weight_decay), decay = Vec::set1(s.decay);
  const bool l2 = !c.adam_w_mode && s.weight_decay != 0.0f;
  const bool decoupled = c.adam_w_mode && s.weight_decay != 0.0f;
  const bool mask = c.mask_nonfinite;
  constexpr bool kStreamable = Vec::kCanStream && (CD == kBF16 || CD == kF16);
  bool bad = false;

  // stream: the copy goes out with non-temporal stores (cp + i is then 32-byte aligned).
  auto group = [&](void* p, const void* g, float* m, float* v, void* cp, int64_t i,
                   bool stream) {
    for (int part = 0; part < kParts; ++part) {
      const int64_t j = i + part * Vec::W;
      const F p0 = Vec::template load<PD>(p, j);
      F grad = Vec::template load<GD>(g, j) * gscale;
      typename Vec::M ok{};
      if (mask) {
        ok = Vec::finite(grad);
        bad |= !Vec::all(ok);
      }
      if (l2) grad = grad + p0 * wd;
      const F m0 = Vec::template load<kF32>(m, j);
      const F v0 = Vec::template load<kF32>(v, j);
      F m1 = m0 * beta1 + grad * omb1;
      F v1 = v0 * beta2 + (grad * grad) * omb2;
      const F denom = Vec::sqrt(v1) / bc2 + eps;
      F p1 = (decoupled ? p0 * decay : p0) - (step * m1) / denom;
      if (mask) {
        p1 = Vec::select(ok, p1, p0);
        m1 = Vec::select(ok, m1, m0);
        v1 = Vec::select(ok, v1, v0);
      }
      Vec::template store<PD>(p, j, p1);
      Vec::template store<kF32>(m, j, m1);
      Vec::template store<kF32>(v, j, v1);
      if constexpr (kStreamable) {
        if (stream) {
          Vec::template stream<CD>(cp, j, p1);
          continue;
        }
      }
      if constexpr (CD != kNone) Vec::template store<CD>(cp, j, p1);
    }
  };

  // Runs [i, i + n), n < kGroup, through zero-padded scratch buffers.
  auto via_buffer = [&](int64_t i, int64_t n) {
    alignas(64) unsigned char pb[kGroup * 4], gb[kGroup * 4], mb[kGroup * 4], vb[kGroup * 4],
        cb[kGroup * 4];
    tail_in(pb, s.param, i, n, PD);
    tail_in(gb, s.grad, i, n, GD);
    tail_in(mb, s.exp_avg, i, n, kF32);
    tail_in(vb, s.exp_avg_sq, i, n, kF32);
    group(pb, gb, reinterpret_cast<float*>(mb), reinterpret_cast<float*>(vb), cb, 0, false);
    tail_out(s.param, pb, i, n, PD);
    tail_out(s.exp_avg, mb, i, n, kF32);
    tail_out(s.exp_avg_sq, vb, i, n, kF32);
    if constexpr (CD != kNone) tail_out(s.copy, cb, i, n, CD);
  };

  int64_t i = b;
  bool stream = false;
  if constexpr (kStreamable) {
    if (c.stream_copy && e - b >= 4 * kGroup) {  // peel to a 32-byte aligned copy address
      const auto addr = reinterpret_cast<uintptr_t>(static_cast<uint16_t*>(s.copy) + i);
      if (addr % 2 == 0) {
        const int64_t head = static_cast<int64_t>((32 - addr % 32) % 32 / 2);
        if (head > 0) via_buffer(i, head);
        i += head;
        stream = true;
      }
    }
  }
  for (; i + kGroup <= e; i += kGroup) {
    group(s.param, s.grad, s.exp_avg, s.exp_avg_sq, s.copy, i, stream);
  }
  if (i < e) via_buffer(i, e - i);
  if (stream) Vec::stream_fence();
  return bad;
}

template <int PD, int GD, int CD>
bool adam_units_t(const AdamConsts& c, const AdamSpan* spans, const megazero::WorkUnit* units,
                  int64_t lo, int64_t hi) {
  bool bad = false;
  for (int64_t u = lo; u < hi; ++u) {
    bad |= adam_range<PD, GD, CD>(c, spans[units[u].span], units[u].begin, units[u].end);
  }
  return bad;
}

// The copy exists only for fp32 params (the fused step's main partition).
template <int GD>
bool adam_units_f32(const AdamConsts& c, const AdamSpan* s, const megazero::WorkUnit* u,
                    int64_t lo, int64_t hi) {
  switch (c.copy_dtype) {
    case kF32: return adam_units_t<kF32, GD, kF32>(c, s, u, lo, hi);
    case kBF16: return adam_units_t<kF32, GD, kBF16>(c, s, u, lo, hi);
    case kF16: return adam_units_t<kF32, GD, kF16>(c, s, u, lo, hi);
    default: return adam_units_t<kF32, GD, kNone>(c, s, u, lo, hi);
  }
}

template <int PD>
bool adam_units_lowp(const AdamConsts& c, const AdamSpan* s, const megazero::WorkUnit* u,
                     int64_t lo, int64_t hi) {
  switch (c.grad_dtype) {
    case kF32: return adam_units_t<PD, kF32, kNone>(c, s, u, lo, hi);
    case kBF16: return adam_units_t<PD, kBF16, kNone>(c, s, u, lo, hi);
    default: return adam_units_t<PD, kF16, kNone>(c, s, u, lo, hi);
  }
}

inline bool adam_units(const AdamConsts& c, const AdamSpan* s, const megazero::WorkUnit* u,
                       int64_t lo, int64_t hi) {
  if (c.param_dtype == kBF16) return adam_units_lowp<kBF16>(c, s, u, lo, hi);
  if (c.param_dtype == kF16) return adam_units_lowp<kF16>(c, s, u, lo, hi);
  switch (c.grad_dtype) {
    case kF32: return adam_units_f32<kF32>(c, s, u, lo, hi);
    case kBF16: return adam_units_f32<kBF16>(c, s, u, lo, hi);
    default: return adam_units_f32<kF16>(c, s, u, lo, hi);
  }
}

}  // namespace

namespace megazero::adam::MZ_ISA {

extern const AdamKernels kKernels = {adam_units, sumsq_units};

}  // namespace megazero::adam::MZ_ISA
