// What the top-k kernels share (private to kernels/cuda): the keys they order candidates by, and
// the selections topk_kernel.cu launches from other files: a warp per row for a small k
// (topk_warp_select.cu), a CTA of 256 threads per row for a large one (topk_wide_select.cu).
#pragma once

#include <climits>
#include <cstdint>

#include "kernels/cuda/device_common.cuh"
#include "logitserve/kernels/cuda_kernels.h"

namespace logitserve::kernels::cuda::detail {

// Unsigned bits ordered like the floats (for non-NaN values; -0 counts as +0, as in Better).
__device__ __forceinline__ uint32_t OrderedBits(float v) {
  const uint32_t u = __float_as_uint(v == 0.0f ? 0.0f : v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The float whose OrderedBits is `key`: the inverse for every value but NaN and -0 (whose key is
// +0's).
__device__ __forceinline__ float ValueOfOrderedBits(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// The first column, in its source, of chunk `chunk` of lane item % 32 of block item / 32 (item =
// block * 32 + lane; the layout of lane_block.cuh).
__device__ __forceinline__ int64_t LaneChunkColumn(int item, int chunk) {
  return static_cast<int64_t>(item >> 5) * kVocabBlock + chunk * 256 + (item & 31) * 8;
}

// A key ordered like Better: the value's ordered bits, then the smaller id. Ids are >= 0.
__device__ __forceinline__ uint64_t KeyOf(const TopKEntry& e) {
  return (static_cast<uint64_t>(OrderedBits(e.value)) << 32) |
         static_cast<uint32_t>(INT_MAX - e.id);
}

// x summed over lanes 0..t of the warp (t: this thread's lane; all 32 lanes call it).
__device__ __forceinline__ int WarpInclusiveSum(int x, int t) {
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int y = __shfl_up_sync(kFullMask, x, off);
    if (t >= off) x += y;
  }
  return x;
}

// Whether TopKWarpSelectKernel serves a source of `blocks` blocks for this k: k <= 64, and 8 to 80
// blocks (the lane maxima a thread holds in registers; with fewer than 4 k lane maxima the
// threshold lets through too many values).
inline bool WarpSelectServes(int64_t blocks, int32_t k) {
  return k <= 64 && blocks >= 8 && blocks <= 80;
}

// Steps 2-3 of topk_kernel.cu for the rows of `a`, a warp per row, from step 1's lane maxima and
// aux words (LaneMaxOp); rows it cannot serve are flagged for the fallback (a negative count).
cudaError_t LaunchWarpSelect(const LogitsSource& a, int64_t rows, const float* lane_max,
                             const uint32_t* lane_aux, int32_t k, TopKEntry* lists, int32_t* counts,
                             cudaStream_t stream);

// Steps 2-3 of topk_kernel.cu for k > 128, a CTA of 256 threads per row (topk_wide_select.cu),
// from step 1's lane maxima; rows it cannot serve are flagged for the fallback (a negative count).
cudaError_t LaunchWideSelect(const LogitsSource& a, int64_t rows, const float* lane_max, int32_t k,
                             TopKEntry* lists, int32_t* counts, cudaStream_t stream);

}  // namespace logitserve::kernels::cuda::detail
