// Top-k steps 2-3 for a large k, a CTA of 256 threads per row (topk_kernel.cu has steps 1-3, the
// smaller k and the fallback).
#include <climits>
#include <cub/block/block_merge_sort.cuh>

#include "kernels/cuda/block_items.cuh"
#include "kernels/cuda/topk_common.cuh"
#include "kernels/cuda/topk_select.cuh"

namespace logitserve::kernels::cuda::detail {
namespace {

// Steps 2-3 for k > 128 (topk_kernel.cu, kNarrowLoadsMaxK): a CTA of kWideThreads per row. For
// k = 1024 about 5 / 6 of a row's lanes reach T (a Qwen-size row has 1,216 lane maxima), and the
// previous form, which tested each of their values, spent a third of its instructions there, a
// third in the bitonic sort and an eighth in the radix select (Nsight Compute, H200, 97.8 M warp
// instructions for 1024 rows). Here:
//   a. every 8-value chunk of a lane that reaches T is loaded (16 bytes; chunk g holds columns
//      [8 g, 8 g + 8), so a warp's loads cover 512 contiguous bytes) and only its maximum is
//      compared with T; the chunks that reach it (about one in four for k = 1024) are listed;
//   b. the listed chunks are loaded again (from L2) and each of their values >= T becomes a
//      candidate; more listed chunks than kMaxCandidates means more candidates too: the fallback;
//   c. the k best as in TopKSelectKernel (ranks by counting, or the radix select), then sorted in
//      registers by CUB's block merge sort on their 64-bit keys (KeyOf: the order of Better, ids
//      distinct), the values carried along (each zero keeps its sign bit).
// Shared memory: the candidates, then the chunk list (in step c the k best), then the lane keys.
constexpr int kWideThreads = 256;
constexpr int kWideItems = kMaxTopK / kWideThreads;  // the k best a thread holds for the sort
using WideSort = cub::BlockMergeSort<uint64_t, kWideThreads, kWideItems, float>;
static_assert(sizeof(WideSort::TempStorage) <= kMaxCandidates * sizeof(TopKEntry),
              "the sort's storage reuses the candidates'");
static_assert(kMaxTopK * sizeof(TopKEntry) <= kMaxCandidates * sizeof(int),
              "the k best reuse the chunk list's storage");

size_t WideSharedBytes(int64_t blocks) {
  return sizeof(SelectShared) + kMaxCandidates * (sizeof(TopKEntry) + sizeof(int)) +
         static_cast<size_t>(blocks) * 32 * sizeof(uint32_t);
}

// Candidates of 8 loaded values each (v[q], columns c[q] .. c[q] + 7 of the source) that reach
// tf, appended to cand[0, cap) behind sh->num_cand: the warp's hits before this thread's by an
// inclusive scan, then one shared atomic by the last lane. Every lane of the warp calls it.
template <int kInFlight>
__device__ __forceinline__ void AppendCandidates(const float (&v)[kInFlight][8],
                                                 const int64_t (&c)[kInFlight], int64_t col0,
                                                 float tf, int cap, TopKEntry* cand,
                                                 int* num_cand) {
  const int t = threadIdx.x & 31;
  int hits = 0;
#pragma unroll
  for (int q = 0; q < kInFlight; ++q) {
#pragma unroll
    for (int e = 0; e < 8; ++e) hits += v[q][e] >= tf ? 1 : 0;
  }
  const int incl = WarpInclusiveSum(hits, t);
  int base = 0;
  if (t == 31 && incl != 0) base = atomicAdd(num_cand, incl);
  int i = __shfl_sync(kFullMask, base, 31) + incl - hits;
#pragma unroll
  for (int q = 0; q < kInFlight; ++q) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      if (v[q][e] >= tf) {
        if (i < cap) cand[i] = TopKEntry{v[q][e], static_cast<int32_t>(col0 + c[q] + e)};
        ++i;
      }
    }
  }
}

struct KeyGreater {
  __device__ __forceinline__ bool operator()(uint64_t x, uint64_t y) const { return x > y; }
};

__global__ void __launch_bounds__(kWideThreads)
    TopKSelectWideKernel(DeviceSource a, int64_t col0, int64_t blocks, const float* lane_max,
                         int32_t k, TopKEntry* lists, int32_t* counts) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  SelectShared& sh = *reinterpret_cast<SelectShared*>(smem_raw);
  TopKEntry* cand = reinterpret_cast<TopKEntry*>(smem_raw + sizeof(SelectShared));
  int* chunks = reinterpret_cast<int*>(cand + kMaxCandidates);
  uint32_t* keys = reinterpret_cast<uint32_t*>(chunks + kMaxCandidates);
  const int maxima = static_cast<int>(blocks * 32);
  const int64_t row = blockIdx.x;
  const int count = counts[row];
  TopKEntry* global_list = lists + row * k;
  const uint32_t threshold =
      RowThreshold(lane_max + row * maxima, maxima, k, count, global_list, keys, &sh);
  // Values compare as floats against T's value: the same test as their keys against T's for every
  // value but NaN (a row with a NaN fails anyway).
  const float tf = ValueOfOrderedBits(threshold);
  const int t = threadIdx.x & 31;
  const unsigned below = (1u << t) - 1;

  // a. Chunk g of block g / 256 belongs to lane g % 32 of that block (lane_block.cuh's layout).
  const int num_groups = maxima * kLaneChunks;
  {
    constexpr int kInFlight = 4;
    for (int g0 = 0; g0 < num_groups; g0 += kWideThreads * kInFlight) {  // uniform bounds
      float v[kInFlight][8];
#pragma unroll
      for (int q = 0; q < kInFlight; ++q) {
        const int g = g0 + q * kWideThreads + static_cast<int>(threadIdx.x);
        const bool live = g < num_groups && keys[((g >> 8) << 5) | (g & 31)] >= threshold;
        Load8If(live, a, row, int64_t{8} * g, v[q]);
      }
      unsigned hit[kInFlight];
      int total = 0;
#pragma unroll
      for (int q = 0; q < kInFlight; ++q) {
        float m = v[q][0];
#pragma unroll
        for (int e = 1; e < 8; ++e) m = fmaxf(m, v[q][e]);
        hit[q] = __ballot_sync(kFullMask, m >= tf);
        total += __popc(hit[q]);
      }
      int base = 0;
      if (t == 0 && total != 0) base = atomicAdd(&sh.num_items, total);
      base = __shfl_sync(kFullMask, base, 0);
#pragma unroll
      for (int q = 0; q < kInFlight; ++q) {
        const int i = base + __popc(hit[q] & below);
        if (((hit[q] >> t) & 1) && i < kMaxCandidates) {
          chunks[i] = g0 + q * kWideThreads + static_cast<int>(threadIdx.x);
        }
        base += __popc(hit[q]);
      }
    }
  }
  __syncthreads();
  const int num_chunks = sh.num_items;
  if (num_chunks > kMaxCandidates) {                   // uniform: each chunk holds a candidate
    if (threadIdx.x == 0) counts[row] = -(count + 1);  // left to the fallback
    return;
  }
  // b.
  {
    constexpr int kInFlight = 2;
    for (int i0 = 0; i0 < num_chunks; i0 += kWideThreads * kInFlight) {  // uniform bounds
      float v[kInFlight][8];
      int64_t c[kInFlight];
#pragma unroll
      for (int q = 0; q < kInFlight; ++q) {
        const int i = i0 + q * kWideThreads + static_cast<int>(threadIdx.x);
        c[q] = i < num_chunks ? int64_t{8} * chunks[i] : 0;
        Load8If(i < num_chunks, a, row, c[q], v[q]);
      }
      AppendCandidates(v, c, col0, tf, kMaxCandidates, cand, &sh.num_cand);
    }
  }
  __syncthreads();
  int n = 0;
  if (!JoinRunningList(sh.num_cand, count, k, kMaxCandidates, global_list, cand, &counts[row],
                       &n)) {
    return;
  }

  // c. The chunk list is read: its storage holds the k best.
  TopKEntry* best = reinterpret_cast<TopKEntry*>(chunks);
  if (n <= kRankByCount) {  // already in order
    RankByCount(cand, n, k, best);
    for (int i = threadIdx.x; i < k; i += blockDim.x) global_list[i] = best[i];
  } else {
    SelectBest(cand, n, k, &sh.radix, &sh.num_best, best);
    uint64_t key[kWideItems];
    float value[kWideItems];
#pragma unroll
    for (int j = 0; j < kWideItems; ++j) {
      const int i = static_cast<int>(threadIdx.x) * kWideItems + j;
      key[j] = i < k ? KeyOf(best[i]) : 0;
      value[j] = i < k ? best[i].value : 0.0f;
    }
    // The candidates are read (SelectBest's barrier): their storage holds the sort's.
    WideSort(*reinterpret_cast<WideSort::TempStorage*>(cand)).Sort(key, value, KeyGreater(), k, 0);
#pragma unroll
    for (int j = 0; j < kWideItems; ++j) {
      const int i = static_cast<int>(threadIdx.x) * kWideItems + j;
      const int32_t id = INT_MAX - static_cast<int32_t>(static_cast<uint32_t>(key[j]));
      if (i < k) global_list[i] = TopKEntry{value[j], id};
    }
  }
  if (threadIdx.x == 0) counts[row] = k;
}

}  // namespace

cudaError_t LaunchWideSelect(const LogitsSource& a, int64_t rows, const float* lane_max, int32_t k,
                             TopKEntry* lists, int32_t* counts, cudaStream_t stream) {
  const cudaError_t err =
      cudaFuncSetAttribute(TopKSelectWideKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(WideSharedBytes(kMaxSelectBlocks)));
  if (err != cudaSuccess) return err;
  const int64_t blocks = a.blocks();
  TopKSelectWideKernel<<<static_cast<unsigned>(rows), kWideThreads, WideSharedBytes(blocks),
                         stream>>>(MakeDeviceSource(a), a.col0, blocks, lane_max, k, lists, counts);
  return cudaGetLastError();
}

}  // namespace logitserve::kernels::cuda::detail
