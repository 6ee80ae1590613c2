// One-lane "vector" ops: the portable fallback, same interface as vec_avx2.h / vec_avx512.h.
// Included by fused_simd.cpp inside the scalar namespace; <cmath>, <cstring> and
// fused_common.h come before.

constexpr int W = 1;
struct Vf {
  float v;
};

static inline float bf16_to_f32(bf16_t h) {
  uint32_t bits = static_cast<uint32_t>(h.bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
static inline bf16_t f32_to_bf16(float f) {  // round to nearest even, NaN -> 0x7fc0
  if (std::isnan(f)) return {0x7fc0};
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return {static_cast<uint16_t>(bits >> 16)};
}

static inline Vf vset1(float a) { return {a}; }
static inline Vf vzero() { return {0.0f}; }
static inline Vf vload(const float* p) { return {*p}; }
static inline Vf vload(const bf16_t* p) { return {bf16_to_f32(*p)}; }
static inline Vf vload_part(const float* p, int n, float fill) { return {n > 0 ? *p : fill}; }
static inline Vf vload_part(const bf16_t* p, int n, float fill) {
  return {n > 0 ? bf16_to_f32(*p) : fill};
}
static inline void vstore(float* p, Vf a) { *p = a.v; }
static inline void vstore(bf16_t* p, Vf a) { *p = f32_to_bf16(a.v); }
static inline void vstore_part(float* p, Vf a, int n) {
  if (n > 0) *p = a.v;
}
static inline void vstore_part(bf16_t* p, Vf a, int n) {
  if (n > 0) *p = f32_to_bf16(a.v);
}
static inline Vf operator+(Vf a, Vf b) { return {a.v + b.v}; }
static inline Vf operator-(Vf a, Vf b) { return {a.v - b.v}; }
static inline Vf operator*(Vf a, Vf b) { return {a.v * b.v}; }
static inline Vf operator/(Vf a, Vf b) { return {a.v / b.v}; }
static inline Vf vfma(Vf a, Vf b, Vf c) { return {a.v * b.v + c.v}; }
static inline Vf vfnma(Vf a, Vf b, Vf c) { return {c.v - a.v * b.v}; }
static inline Vf vmax(Vf a, Vf b) { return {a.v > b.v ? a.v : b.v}; }
static inline Vf vmin(Vf a, Vf b) { return {a.v < b.v ? a.v : b.v}; }
static inline float vsum(Vf a) { return a.v; }
static inline float vhmax(Vf a) { return a.v; }
static inline Vf vfirst(Vf a, int n, Vf b) { return n > 0 ? a : b; }
static inline Vf vexp(Vf x) { return {std::exp(x.v)}; }
// Pairs (SwiGLU's interleaved gate/up): with one lane, a block of 2W is one (even, odd) pair.
static inline void vdeinterleave(Vf a, Vf b, Vf& even, Vf& odd) {
  even = a;
  odd = b;
}
static inline void vinterleave(Vf even, Vf odd, Vf& a, Vf& b) {
  a = even;
  b = odd;
}
static inline Vf vdropout(uint32_t lo0, uint32_t key, uint32_t threshold, float scale) {
  return {mix32(mix32(lo0 ^ key)) >= threshold ? scale : 0.0f};
}
