// 8-lane fp32 vector ops for AVX2 + FMA. Included by fused_simd.cpp inside the avx2
// namespace, compiled with the avx2 flags; <immintrin.h>, <cstring> and fused_common.h are
// included before. Partial bf16 loads/stores go through a stack buffer.

constexpr int W = 8;
struct Vf {
  __m256 v;
};

static inline __m256i lanes_below(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline Vf vset1(float a) { return {_mm256_set1_ps(a)}; }
static inline Vf vzero() { return {_mm256_setzero_ps()}; }
static inline Vf vload(const float* p) { return {_mm256_loadu_ps(p)}; }
static inline Vf vload(const bf16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))};
}
static inline Vf vfirst(Vf a, int n, Vf b) {
  return {_mm256_blendv_ps(b.v, a.v, _mm256_castsi256_ps(lanes_below(n)))};
}
static inline Vf vload_part(const float* p, int n, float fill) {
  Vf v = {_mm256_maskload_ps(p, lanes_below(n))};
  return vfirst(v, n, vset1(fill));
}
static inline Vf vload_part(const bf16_t* p, int n, float fill) {
  bf16_t tmp[W] = {};
  std::memcpy(tmp, p, sizeof(bf16_t) * n);
  return vfirst(vload(tmp), n, vset1(fill));
}
static inline __m128i to_bf16(__m256 a) {
  __m256i b = _mm256_castps_si256(a);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  r = _mm256_srli_epi32(r, 16);
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
static inline void vstore(float* p, Vf a) { _mm256_storeu_ps(p, a.v); }
static inline void vstore(bf16_t* p, Vf a) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16(a.v));
}
static inline void vstore_part(float* p, Vf a, int n) {
  _mm256_maskstore_ps(p, lanes_below(n), a.v);
}
static inline void vstore_part(bf16_t* p, Vf a, int n) {
  bf16_t tmp[W];
  _mm_storeu_si128(reinterpret_cast<__m128i*>(tmp), to_bf16(a.v));
  std::memcpy(p, tmp, sizeof(bf16_t) * n);
}

static inline Vf operator+(Vf a, Vf b) { return {_mm256_add_ps(a.v, b.v)}; }
static inline Vf operator-(Vf a, Vf b) { return {_mm256_sub_ps(a.v, b.v)}; }
static inline Vf operator*(Vf a, Vf b) { return {_mm256_mul_ps(a.v, b.v)}; }
static inline Vf operator/(Vf a, Vf b) { return {_mm256_div_ps(a.v, b.v)}; }
static inline Vf vfma(Vf a, Vf b, Vf c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
static inline Vf vfnma(Vf a, Vf b, Vf c) { return {_mm256_fnmadd_ps(a.v, b.v, c.v)}; }
static inline Vf vmax(Vf a, Vf b) { return {_mm256_max_ps(a.v, b.v)}; }
static inline Vf vmin(Vf a, Vf b) { return {_mm256_min_ps(a.v, b.v)}; }
static inline float vsum(Vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline float vhmax(Vf a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Pairs (SwiGLU's interleaved gate/up): a, b hold elements [0, W) and [W, 2W) of a block of
// 2W; even gets the even-indexed elements, odd the odd ones (vinterleave is the inverse).
static inline void vdeinterleave(Vf a, Vf b, Vf& even, Vf& odd) {
  // per 128-bit lane [a0 a2 b0 b2 | a4 a6 b4 b6], then 64-bit chunks reordered 0, 2, 1, 3
  __m256 e = _mm256_shuffle_ps(a.v, b.v, _MM_SHUFFLE(2, 0, 2, 0));
  __m256 o = _mm256_shuffle_ps(a.v, b.v, _MM_SHUFFLE(3, 1, 3, 1));
  even = {_mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), _MM_SHUFFLE(3, 1, 2, 0)))};
  odd = {_mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), _MM_SHUFFLE(3, 1, 2, 0)))};
}
static inline void vinterleave(Vf even, Vf odd, Vf& a, Vf& b) {
  __m256 lo = _mm256_unpacklo_ps(even.v, odd.v);  // [e0 o0 e1 o1 | e4 o4 e5 o5]
  __m256 hi = _mm256_unpackhi_ps(even.v, odd.v);  // [e2 o2 e3 o3 | e6 o6 e7 o7]
  a = {_mm256_permute2f128_ps(lo, hi, 0x20)};
  b = {_mm256_permute2f128_ps(lo, hi, 0x31)};
}

// Round to the nearest integer (ties to even), and p * 2^n for integral n in [-127, 128]
// (vexp in fused_kernels_impl.h); 2^n is built in the exponent bits, split as
// 2^(n/2) * 2^(n - n/2) so both factors are normal floats.
static inline Vf vround(Vf x) {
  return {_mm256_round_ps(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
static inline Vf vscale2n(Vf p, Vf n) {
  __m256i ni = _mm256_cvtps_epi32(n.v);
  __m256i n1 = _mm256_srai_epi32(ni, 1);
  __m256i n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return {_mm256_mul_ps(_mm256_mul_ps(p.v, s1), s2)};
}

static inline __m256i vmix(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(kMixMul1)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(kMixMul2)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}
static inline Vf vdropout(uint32_t lo0, uint32_t key, uint32_t threshold, float scale) {
  __m256i i = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(lo0)),
                               _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256i h = vmix(vmix(_mm256_xor_si256(i, _mm256_set1_epi32(static_cast<int>(key)))));
  __m256i t = _mm256_set1_epi32(static_cast<int>(threshold));
  __m256i keep = _mm256_cmpeq_epi32(_mm256_max_epu32(h, t), h);  // h >= t, unsigned
  return {_mm256_and_ps(_mm256_castsi256_ps(keep), _mm256_set1_ps(scale))};
}
