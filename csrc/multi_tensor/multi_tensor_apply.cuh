// Multi-tensor apply: split a list of tensors into fixed-size chunks and launch one kernel
// over up to kMaxBlocks chunks (of up to MAX_TENSORS tensors) at a time, the addresses riding
// in the kernel's parameter block (under the 4 KiB limit), as apex's multi_tensor_apply does.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace megazero_cuda {

constexpr int64_t kChunkSize = 65536;  // elements per block
constexpr int kMaxBlocks = 320;         // blocks per launch
constexpr int kThreads = 512;

// Tensors [0, count) of one launch: DEPTH lists of addresses (param, grad, m, v, ...).
template <int DEPTH, int MAX_TENSORS>
struct TensorChunks {
  void* addr[DEPTH][MAX_TENSORS];
  int64_t numel[MAX_TENSORS];
  int64_t chunk_base[MAX_TENSORS];  // global index of the tensor's first chunk
  int count;
  unsigned char block_tensor[kMaxBlocks];
  int block_chunk[kMaxBlocks];
};

__host__ __device__ inline int64_t num_chunks(int64_t numel) {
  return (numel + kChunkSize - 1) / kChunkSize;
}

// Calls launch(meta, nblocks) for consecutive groups of chunks; lists[d][t] is the address of
// tensor t in list d. Empty tensors are skipped. Returns the first launch error.
template <int DEPTH, int MAX_TENSORS, class Launch>
cudaError_t for_each_chunk(int n, void* const* const* lists, const int64_t* numels,
                           Launch launch) {
  TensorChunks<DEPTH, MAX_TENSORS> meta;
  meta.count = 0;
  int blocks = 0;
  int64_t chunk_base = 0;
  for (int t = 0; t < n; ++t) {
    const int64_t chunks = num_chunks(numels[t]);
    if (chunks == 0) continue;
    for (int64_t c = 0; c < chunks; ++c) {
      if (c == 0 || meta.count == 0) {  // (re)register tensor t in this launch
        for (int d = 0; d < DEPTH; ++d) meta.addr[d][meta.count] = lists[d][t];
        meta.numel[meta.count] = numels[t];
        meta.chunk_base[meta.count] = chunk_base;
        ++meta.count;
      }
      meta.block_tensor[blocks] = static_cast<unsigned char>(meta.count - 1);
      meta.block_chunk[blocks] = static_cast<int>(c);
      ++blocks;
      const bool tensors_full = meta.count == MAX_TENSORS && c == chunks - 1;
      if (blocks == kMaxBlocks || tensors_full) {
        launch(meta, blocks);
        cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess) return err;
        blocks = 0;
        meta.count = 0;
      }
    }
    chunk_base += chunks;
  }
  if (blocks > 0) launch(meta, blocks);
  return cudaGetLastError();
}

}  // namespace megazero_cuda
