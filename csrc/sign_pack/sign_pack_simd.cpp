// The sign codec's kernels compiled once per SIMD level: setup.py passes -DMZ_ISA=<level> and
// the level's flags (see megazero/simd.h), and each object defines that level's
// megazero_sign_pack::<level>::kTable. Everything else here has internal linkage.
//
// Vector paths: pack compares 8 (AVX2, movemask) or 16 (AVX-512, compare into a mask
// register) floats against zero with an ordered >= (NaN -> 0); unpack expands a byte (a
// 16-bit mask) into a blend of +scale / -scale. No arithmetic on the data, so every level
// gives the same bits as the scalar code and the PyTorch reference.
#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "sign_pack_common.h"

#if !defined(MZ_ISA_SCALAR)
#include <immintrin.h>
#endif

namespace megazero_sign_pack {
namespace MZ_ISA {
namespace {

// Bytes per OpenMP work block (8 * this many elements), and the fewest bytes worth a thread.
constexpr int64_t kBlockBytes = 1 << 14;
constexpr int64_t kMinBytesPerThread = 1 << 15;

int team_size(int64_t bytes, int nthreads) {
  const int64_t useful = std::max<int64_t>(1, bytes / kMinBytesPerThread);
  return static_cast<int>(std::min<int64_t>(useful, nthreads > 0 ? nthreads : 1));
}

inline uint8_t pack_byte_scalar(const float* x, int64_t count) {
  unsigned byte = 0;
  for (int64_t j = 0; j < count; ++j) byte |= static_cast<unsigned>(x[j] >= 0.0f) << j;
  return static_cast<uint8_t>(byte);
}

// out[0, nbytes) from x[0, 8 * nbytes): whole bytes only.
inline void pack_bytes(const float* x, uint8_t* out, int64_t nbytes) {
  int64_t b = 0;
#if defined(MZ_ISA_AVX512)
  const __m512 zero = _mm512_setzero_ps();
  for (; b + 2 <= nbytes; b += 2) {
    const uint16_t m = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + 8 * b), zero, _CMP_GE_OQ);
    out[b] = static_cast<uint8_t>(m);
    out[b + 1] = static_cast<uint8_t>(m >> 8);
  }
#endif
#if defined(MZ_ISA_AVX2) || defined(MZ_ISA_AVX512)
  const __m256 zero8 = _mm256_setzero_ps();
  for (; b < nbytes; ++b) {
    const __m256 ge = _mm256_cmp_ps(_mm256_loadu_ps(x + 8 * b), zero8, _CMP_GE_OQ);
    out[b] = static_cast<uint8_t>(_mm256_movemask_ps(ge));
  }
#endif
  for (; b < nbytes; ++b) out[b] = pack_byte_scalar(x + 8 * b, 8);
}

// out[0, 8 * nbytes) = +-s by the bits of packed[0, nbytes).
inline void unpack_bytes(const uint8_t* packed, float* out, int64_t nbytes, float s) {
  int64_t b = 0;
#if defined(MZ_ISA_AVX512)
  const __m512 pos = _mm512_set1_ps(s), neg = _mm512_set1_ps(-s);
  for (; b + 2 <= nbytes; b += 2) {
    const __mmask16 m = static_cast<__mmask16>(packed[b] | (packed[b + 1] << 8));
    _mm512_storeu_ps(out + 8 * b, _mm512_mask_blend_ps(m, neg, pos));
  }
#endif
#if defined(MZ_ISA_AVX2) || defined(MZ_ISA_AVX512)
  const __m256i lanes = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256 pos8 = _mm256_set1_ps(s), neg8 = _mm256_set1_ps(-s);
  for (; b < nbytes; ++b) {
    const __m256i v = _mm256_and_si256(_mm256_set1_epi32(packed[b]), lanes);
    const __m256 set = _mm256_castsi256_ps(_mm256_cmpeq_epi32(v, lanes));
    _mm256_storeu_ps(out + 8 * b, _mm256_blendv_ps(neg8, pos8, set));
  }
#endif
  for (; b < nbytes; ++b) {
    for (int j = 0; j < 8; ++j) out[8 * b + j] = (packed[b] >> j) & 1 ? s : -s;
  }
}

inline float unpack_one(const uint8_t* packed, int64_t i, float s) {
  return (packed[i >> 3] >> (i & 7)) & 1 ? s : -s;
}

// Elements [e0, e1) of the unpack (e0 a multiple of 8): a run of whole bytes per chunk, with
// single elements where a chunk boundary falls inside a byte.
void unpack_range(const uint8_t* packed, float* out, const float* scales, int64_t chunk,
                  int64_t e0, int64_t e1) {
  int64_t e = e0;
  while (e < e1) {
    const int64_t c = e / chunk;
    const int64_t stop = std::min(e1, (c + 1) * chunk);
    const float s = scales[c];
    for (; e < stop && (e & 7); ++e) out[e] = unpack_one(packed, e, s);
    const int64_t nbytes = (stop - e) >> 3;
    unpack_bytes(packed + (e >> 3), out + e, nbytes, s);
    e += nbytes << 3;
    for (; e < stop; ++e) out[e] = unpack_one(packed, e, s);
  }
}

void pack(const float* x, uint8_t* out, int64_t n, int nthreads) {
  const int64_t full = n >> 3, blocks = (full + kBlockBytes - 1) / kBlockBytes;
#pragma omp parallel for schedule(static) num_threads(team_size(full, nthreads))
  for (int64_t k = 0; k < blocks; ++k) {
    const int64_t b0 = k * kBlockBytes, b1 = std::min(full, b0 + kBlockBytes);
    pack_bytes(x + 8 * b0, out + b0, b1 - b0);
  }
  if (n & 7) out[full] = pack_byte_scalar(x + 8 * full, n & 7);
}

void unpack(const uint8_t* packed, float* out, int64_t n, const float* scales, int64_t chunk,
            int nthreads) {
  const int64_t span = 8 * kBlockBytes, blocks = (n + span - 1) / span;
#pragma omp parallel for schedule(static) num_threads(team_size(n >> 3, nthreads))
  for (int64_t k = 0; k < blocks; ++k) {
    unpack_range(packed, out, scales, chunk, k * span, std::min(n, (k + 1) * span));
  }
}

}  // namespace

extern const KernelTable kTable;
const KernelTable kTable = {pack, unpack};

}  // namespace MZ_ISA
}  // namespace megazero_sign_pack
