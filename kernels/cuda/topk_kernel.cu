// Running top-k per row. One CTA per row walks the source's blocks in order; for each block:
//   1. every thread keeps those of its 8 values that beat the list's current k-th entry (all of
//      them while the list holds fewer than k) as candidates in shared memory;
//   2. the candidates are padded to a power of two with sentinels and bitonic-sorted, best first;
//   3. the list and the candidates are merged by rank: an entry's place in the merged list is its
//      index in its own list plus the number of entries of the other list that are Better than it
//      (a binary search). Better is a strict total order on (value, id) and ids are distinct, so
//      places are unique and the first k form the new list.
// Candidates are appended with a shared atomic counter, in no particular order; the sort makes the
// result independent of that order, and the strict order makes the final top-k unique, whatever
// the block order or shard layout.
#include <climits>

#include "kernels/cuda/device_common.cuh"

namespace logitserve::kernels::cuda {
namespace {

using detail::DeviceSource;

// Ranks after every real entry (also -inf ones, whose ids are smaller).
__device__ __forceinline__ TopKEntry Sentinel() { return TopKEntry{detail::NegInfF(), INT_MAX}; }

// Number of entries of sorted list[0, n) that are Better than x.
__device__ __forceinline__ int CountBetter(const TopKEntry* list, int n, const TopKEntry& x) {
  int lo = 0, hi = n;  // list[0, lo) are Better than x, list[hi, n) are not
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (Better(list[mid], x)) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Bitonic sort of s[0, n), n a power of two, best first.
__device__ void BitonicSortBestFirst(TopKEntry* s, int n) {
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < n / 2; i += blockDim.x) {
        const int lo = 2 * stride * (i / stride) + (i % stride);
        const int hi = lo + stride;
        const bool best_first = (lo & size) == 0;
        const TopKEntry x = s[lo];
        const TopKEntry y = s[hi];
        if (best_first ? Better(y, x) : Better(x, y)) {
          s[lo] = y;
          s[hi] = x;
        }
      }
      __syncthreads();
    }
  }
}

__global__ void __launch_bounds__(kBlockThreads)
    TopKUpdateKernel(DeviceSource a, int64_t col0, int64_t blocks, int32_t k, TopKEntry* lists,
                     int32_t* counts) {
  __shared__ TopKEntry list[kMaxTopK];
  __shared__ TopKEntry merged[kMaxTopK];
  __shared__ TopKEntry cand[kVocabBlock];
  // Candidate counters, used alternately: block `blk` appends to num_cand[blk & 1] while the
  // other one is reset for the next block (every thread has read it by the barrier at the top).
  __shared__ int num_cand[2];
  const int64_t row = blockIdx.x;
  int count = counts[row];
  TopKEntry* global_list = lists + row * k;
  for (int i = threadIdx.x; i < count; i += blockDim.x) list[i] = global_list[i];
  if (threadIdx.x == 0) num_cand[0] = num_cand[1] = 0;

  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int p = static_cast<int>(blk & 1);
    __syncthreads();  // the previous block is done: list, count and num_cand[p ^ 1] are settled
    if (threadIdx.x == 0) num_cand[p ^ 1] = 0;
    const bool full = count == k;
    const TopKEntry worst = full ? list[k - 1] : Sentinel();
    const int64_t c = blk * kVocabBlock + threadIdx.x * kElemsPerThread;
    float v[8];
    detail::Load8(a, row, c, v);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (c + j >= a.cols) break;
      const TopKEntry e{v[j], static_cast<int32_t>(col0 + c + j)};
      if (!full || Better(e, worst)) cand[atomicAdd(&num_cand[p], 1)] = e;
    }
    __syncthreads();
    const int n = num_cand[p];
    if (n == 0) continue;  // uniform: nothing in this block beats the list
    int padded = 1;
    while (padded < n) padded <<= 1;
    for (int i = n + threadIdx.x; i < padded; i += blockDim.x) cand[i] = Sentinel();
    __syncthreads();
    BitonicSortBestFirst(cand, padded);
    const int take = n < k ? n : k;
    for (int i = threadIdx.x; i < count; i += blockDim.x) {
      const int place = i + CountBetter(cand, take, list[i]);
      if (place < k) merged[place] = list[i];
    }
    for (int j = threadIdx.x; j < take; j += blockDim.x) {
      const int place = j + CountBetter(list, count, cand[j]);
      if (place < k) merged[place] = cand[j];
    }
    __syncthreads();
    count = count + take < k ? count + take : k;
    for (int i = threadIdx.x; i < count; i += blockDim.x) list[i] = merged[i];
  }
  __syncthreads();

  for (int i = threadIdx.x; i < count; i += blockDim.x) global_list[i] = list[i];
  if (threadIdx.x == 0) counts[row] = count;
}

}  // namespace

cudaError_t LaunchTopKUpdate(const LogitsSource& a, int64_t rows, int32_t k, TopKEntry* lists,
                             int32_t* counts, cudaStream_t stream) {
  if (rows <= 0 || k <= 0 || a.cols <= 0) return cudaSuccess;
  if (k > kMaxTopK || rows > INT_MAX) return cudaErrorInvalidValue;
  TopKUpdateKernel<<<static_cast<unsigned>(rows), kBlockThreads, 0, stream>>>(
      detail::MakeDeviceSource(a), a.col0, a.blocks(), k, lists, counts);
  return cudaGetLastError();
}

}  // namespace logitserve::kernels::cuda
