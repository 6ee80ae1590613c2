// Rotary position embedding (rotate half) forward and backward, CUDA.
//
// t [b, heads, s, hn] is read through its strides (unit stride along hn: the model's q and k
// are permuted views of the qkv output), cos and sin [b, s, rot] through theirs (stride 0 on a
// broadcast batch); out is written through its own strides. One warp per row of hn: lane k of
// the first rot/2 handles the pair (k, k + rot/2), the rest copy dims rot..hn; 8 rows a block,
// grid-stride over rows. fp32 arithmetic.
//   forward   o1 = x1 c1 - x2 s1,  o2 = x2 c2 + x1 s2
//   backward  o1 = x1 c1 + x2 s2,  o2 = x2 c2 - x1 s1   (x: the output's gradient)
#include "cuda_common.cuh"
#include "fused_cuda.h"

namespace megazero_cuda {
namespace {

constexpr int kRowsPerBlock = 8;

template <class T>
__global__ void rope_kernel(const T* __restrict__ t, const T* __restrict__ cs,
                            const T* __restrict__ sn, T* __restrict__ out, RopeDims d,
                            bool backward) {
  const int64_t rows = d.b * d.heads * d.s;
  const int64_t half = d.rot / 2, per_row = half + (d.hn - d.rot);
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.y; row < rows;
       row += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
    const int64_t is = row % d.s, bh = row / d.s;
    const int64_t ih = bh % d.heads, ib = bh / d.heads;
    const T* tr = t + ib * d.t_sb + ih * d.t_sh + is * d.t_ss;
    T* orow = out + ib * d.o_sb + ih * d.o_sh + is * d.o_ss;
    const T* cr = cs + ib * d.c_sb + is * d.c_ss;
    const T* sr = sn + ib * d.s_sb + is * d.s_ss;
    for (int64_t k = threadIdx.x; k < per_row; k += 32) {
      if (k < half) {
        const float x1 = to_f32(tr[k]), x2 = to_f32(tr[k + half]);
        const float c1 = to_f32(cr[k]), c2 = to_f32(cr[k + half]);
        const float s1 = to_f32(sr[k]), s2 = to_f32(sr[k + half]);
        orow[k] = from_f32<T>(backward ? x1 * c1 + x2 * s2 : x1 * c1 - x2 * s1);
        orow[k + half] = from_f32<T>(backward ? x2 * c2 - x1 * s1 : x2 * c2 + x1 * s2);
      } else {
        const int64_t c = d.rot + (k - half);  // dims past rot pass through
        orow[c] = tr[c];
      }
    }
  }
}

}  // namespace

cudaError_t rope(const void* t, const void* cos, const void* sin, void* out, RopeDims d,
                 bool backward, int dt, cudaStream_t stream) {
  const int64_t rows = d.b * d.heads * d.s;
  if (rows == 0 || d.hn == 0) return cudaSuccess;
  const dim3 block(32, kRowsPerBlock);
  const unsigned grid = grid_for(rows, kRowsPerBlock, 1 << 20);
  MZ_DISPATCH(dt, T, (rope_kernel<T><<<grid, block, 0, stream>>>(
      static_cast<const T*>(t), static_cast<const T*>(cos), static_cast<const T*>(sin),
      static_cast<T*>(out), d, backward)));
  return cudaGetLastError();
}

}  // namespace megazero_cuda
