// 16-lane fp32 vector ops for AVX-512 (F, BW, VL, DQ). Included by fused_simd.cpp inside the
// avx512 or avx512bf16 namespace, compiled with that level's flags; <immintrin.h> and
// fused_common.h are included before. At avx512bf16 (MZ_ISA_BF16_NATIVE), fp32->bf16 stores
// use VCVTNEPS2BF16; otherwise round-to-nearest-even in integer ops (same results, NaN ->
// 0x7fc0).

constexpr int W = 16;
struct Vf {
  __m512 v;
};
struct Vm {  // per-lane predicate
  __mmask16 m;
};

static inline __mmask16 first_n(int n) { return static_cast<__mmask16>((1u << n) - 1u); }

static inline Vf vset1(float a) { return {_mm512_set1_ps(a)}; }
static inline Vf vzero() { return {_mm512_setzero_ps()}; }
static inline Vf vload(const float* p) { return {_mm512_loadu_ps(p)}; }
static inline Vf vload(const bf16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
// Lanes [0, n) from p, the others `fill`.
static inline Vf vload_part(const float* p, int n, float fill) {
  return {_mm512_mask_loadu_ps(_mm512_set1_ps(fill), first_n(n), p)};
}
static inline Vf vload_part(const bf16_t* p, int n, float fill) {
  __m256i h = _mm256_maskz_loadu_epi16(first_n(n), p);
  __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  return {_mm512_mask_blend_ps(first_n(n), _mm512_set1_ps(fill), v)};
}
static inline __m256i to_bf16(__m512 a) {
#if defined(MZ_ISA_BF16_NATIVE)
  __m256bh r = _mm512_cvtneps_pbh(a);
  __m256i out;
  __builtin_memcpy(&out, &r, sizeof(out));
  return out;
#else
  __m512i b = _mm512_castps_si512(a);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  r = _mm512_srli_epi32(r, 16);
  __mmask16 nan = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
#endif
}
static inline void vstore(float* p, Vf a) { _mm512_storeu_ps(p, a.v); }
static inline void vstore(bf16_t* p, Vf a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(a.v));
}
static inline void vstore_part(float* p, Vf a, int n) {
  _mm512_mask_storeu_ps(p, first_n(n), a.v);
}
static inline void vstore_part(bf16_t* p, Vf a, int n) {
  _mm256_mask_storeu_epi16(p, first_n(n), to_bf16(a.v));
}

static inline Vf operator+(Vf a, Vf b) { return {_mm512_add_ps(a.v, b.v)}; }
static inline Vf operator-(Vf a, Vf b) { return {_mm512_sub_ps(a.v, b.v)}; }
static inline Vf operator*(Vf a, Vf b) { return {_mm512_mul_ps(a.v, b.v)}; }
static inline Vf operator/(Vf a, Vf b) { return {_mm512_div_ps(a.v, b.v)}; }
static inline Vf vfma(Vf a, Vf b, Vf c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }   // a*b+c
static inline Vf vfnma(Vf a, Vf b, Vf c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; } // c-a*b
static inline Vf vmax(Vf a, Vf b) { return {_mm512_max_ps(a.v, b.v)}; }
static inline Vf vmin(Vf a, Vf b) { return {_mm512_min_ps(a.v, b.v)}; }
static inline float vsum(Vf a) { return _mm512_reduce_add_ps(a.v); }
static inline float vhmax(Vf a) { return _mm512_reduce_max_ps(a.v); }
// Lanes [0, n) of a, the others of b.
static inline Vf vfirst(Vf a, int n, Vf b) { return {_mm512_mask_blend_ps(first_n(n), b.v, a.v)}; }

// Pairs (SwiGLU's interleaved gate/up): a, b hold elements [0, W) and [W, 2W) of a block of
// 2W; even gets the even-indexed elements, odd the odd ones (vinterleave is the inverse).
static inline void vdeinterleave(Vf a, Vf b, Vf& even, Vf& odd) {
  const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i io = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  even = {_mm512_permutex2var_ps(a.v, ie, b.v)};
  odd = {_mm512_permutex2var_ps(a.v, io, b.v)};
}
static inline void vinterleave(Vf even, Vf odd, Vf& a, Vf& b) {
  const __m512i il = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i ih =
      _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  a = {_mm512_permutex2var_ps(even.v, il, odd.v)};
  b = {_mm512_permutex2var_ps(even.v, ih, odd.v)};
}

// Round to the nearest integer (ties to even), and p * 2^n (vexp in fused_kernels_impl.h).
static inline Vf vround(Vf x) {
  return {_mm512_roundscale_ps(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
static inline Vf vscale2n(Vf p, Vf n) { return {_mm512_scalef_ps(p.v, n.v)}; }

// Dropout multipliers for flat indices whose low words are lo0 .. lo0+W-1 (no 2^32 wrap):
// `scale` where mix(mix(lo ^ key)) >= threshold, else 0.
static inline __m512i vmix(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(kMixMul1)));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(kMixMul2)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}
static inline Vf vdropout(uint32_t lo0, uint32_t key, uint32_t threshold, float scale) {
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i i = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(lo0)), iota);
  __m512i h = vmix(vmix(_mm512_xor_si512(i, _mm512_set1_epi32(static_cast<int>(key)))));
  __mmask16 keep = _mm512_cmpge_epu32_mask(h, _mm512_set1_epi32(static_cast<int>(threshold)));
  return {_mm512_maskz_mov_ps(keep, _mm512_set1_ps(scale))};
}
