// Running top-k per row from one read of the logits.
//
//   1. The (row, block) kernel that computes the block statistics (block_items.cuh: a warp per
//      block, the records' bits unchanged) also writes every lane's maximum (128 bytes per 4 KB
//      block) to a scratch array, and beside them where in the lane it lies (LaneMaxOp). A lane's
//      maximum is one of its 64 values, so the k-th largest of a row's 32 * blocks lane maxima is
//      at most the row's k-th largest value: a threshold T that every member of the top-k reaches,
//      and that only the values of the (about k) lanes whose maximum reaches T can reach.
//   2. A small CTA per row (for k <= 64 a warp per row instead: topk_warp_select.cu) finds T
//      (radix select over the lane maxima), loads the 64 values of each lane that reaches it
//      again (128 bytes each: about k of the row's 32 * blocks lanes) and keeps each value >= T,
//      with its id, as a candidate in shared memory. For k > 128 (TopKSelectWideKernel) most
//      lanes reach T, so the values are offered in two steps: every 8-value chunk of those lanes
//      is loaded and only its maximum tested (the chunks that reach T listed), then the listed
//      chunks' values are tested one by one.
//   3. An exact radix select on a 64-bit key that orders like Better (value, then the smaller id)
//      picks the k best of the candidates and of the running list; a sort orders them (CUB's
//      block merge sort for k > 128, a bitonic sort in shared memory below).
// The previous design (a CTA per row offering block after block to a sorted list: a bitonic sort
// and a merge per 2048 ids) ran at 20x one read. A first version of this one fused steps 1-3 into
// a CTA per row: 3 CTAs per SM, each spending half its time in the selection, left DRAM 30 % busy
// (Nsight Compute, 0.89 ms for k = 64); separating step 1 gives it the statistics kernel's rate.
// Step 2-3 alone is latency-bound (for 8192 rows, k = 64: about 0.2 ms with this CTA per row, 0.1
// ms with the warp per row): the CUDA backend runs it for row tile t beside step 1 of tile t + 1
// (LaunchTopKLaneMax / LaunchTopKSelect, two streams), which hides part of it (H200:
// docs/performance-history.md).
//
// Rows the threshold cannot serve go to the previous kernel, kept below as the exact fallback,
// flagged by a negative count: candidates overflowing the buffer (heavy ties at T), or fewer than k
// finite candidates (a mostly masked row, whose list -inf entries fill by id). Both kernels give
// the unique top-k of the strict total order Better, so the result does not depend on which one
// served a row, on the order blocks are seen in, or on the shard layout.
#include <algorithm>
#include <climits>
#include <type_traits>

#include "kernels/cuda/block_items.cuh"
#include "kernels/cuda/topk_common.cuh"
#include "kernels/cuda/topk_select.cuh"

namespace logitserve::kernels::cuda {
namespace {

using detail::DeviceSource;
using detail::JoinRunningList;
using detail::kMaxSelectBlocks;
using detail::kRankByCount;
using detail::OrderedBits;
using detail::PowerOfTwoAtLeast;
using detail::RankByCount;
using detail::RowThreshold;
using detail::SelectBest;
using detail::SelectShared;
using detail::Sentinel;

// Threads of the selection CTA (one CTA per row).
constexpr int kSelectThreads = 128;
// The largest k TopKSelectKernel serves (it loads the listed lanes a warp per lane); larger ones go
// to TopKSelectWideKernel.
constexpr int32_t kNarrowLoadsMaxK = 128;
// Candidates TopKSelectKernel's row may hold (k <= kNarrowLoadsMaxK: at most a quarter of
// kMaxCandidates).
int CandidateCap(int32_t k) { return k <= 64 ? 512 : 1024; }
// Lanes reaching the threshold a row may list (about k; more only with ties at T).
constexpr int kMaxItems = 2048;

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
        // i with a 0 bit inserted at stride's place (stride is a power of two: a run-time
        // i / stride and i % stride were an integer division each, ~20 instructions, in a loop
        // that was a third of the k = 1024 selection's instructions; Nsight Compute, H200).
        const int lo = ((i & ~(stride - 1)) << 1) | (i & (stride - 1));
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

// Where a launch's aux words start in its scratch: behind the lanes' maxima of its rows.
template <typename F>
__host__ __device__ inline auto* LaneAux(F* lane_max, int64_t rows, int64_t blocks) {
  using U = std::conditional_t<std::is_const_v<F>, const uint32_t, uint32_t>;
  return reinterpret_cast<U*>(lane_max + rows * blocks * 32);
}

// Step 1's per-block work: the statistics record (kStats), the lanes' maxima, and for each lane
// where its maximum lies and the largest of its other 63 values (`lane_aux`: the ordered key of
// that second value, its low 6 bits replaced by the maximum's place j * 8 + e in the lane, the
// first in that order when it repeats; so a lower bound of the key that `| 63` turns into an upper
// bound). TopKWarpSelectKernel takes a listed lane's maximum as its only candidate when that second
// value cannot reach its threshold, with no load, and loads the lane's 64 values again otherwise;
// when it does not serve the job (lane_aux null), only the maxima are written.
template <bool kStats>
struct LaneMaxOp {
  detail::StatsOp stats;
  float* lane_max;     // [rows][blocks * 32]
  uint32_t* lane_aux;  // [rows][blocks * 32], or null
  int64_t lane_ld;     // blocks * 32
  template <FloatType T>
  __device__ __forceinline__ void operator()(const DeviceSource& a, int64_t row, int64_t blk,
                                             int lane, detail::LaneBlock<T>& v) const {
    if constexpr (kStats) {
      stats(a, row, blk, lane, v);  // transforms fp32 words in place, as TransformInPlace does
    } else {
      detail::TransformInPlace(a, blk * kVocabBlock, lane, v);
    }
    const int64_t at = row * lane_ld + blk * 32 + lane;
    if (lane_aux == nullptr) {  // uniform over the grid
      lane_max[at] = detail::LaneMax(a, v);
      return;
    }
    // The chunk holding the maximum (the first when chunks tie) and the largest other chunk
    // maximum, from the packed chunk maxima.
    float top = v.RawChunkMax(0), all = top, second = detail::NegInfF();
    int arg = 0;
#pragma unroll
    for (int j = 1; j < detail::kLaneChunks; ++j) {
      const float m = v.RawChunkMax(j);
      all = detail::MaxNaN(all, m);
      if (m > top) {
        second = top;
        top = m;
        arg = j;
      } else {
        second = fmaxf(second, m);
      }
    }
    // That chunk's words, picked by selects (an index into a register array that is not known at
    // compile time goes through local memory); in it the first value equal to the maximum, and the
    // largest of its other values.
    using Block = detail::LaneBlock<T>;
    uint32_t c[Block::kWords];
#pragma unroll
    for (int k = 0; k < Block::kWords; ++k) c[k] = v.w[0][k];
#pragma unroll
    for (int j = 1; j < detail::kLaneChunks; ++j) {
#pragma unroll
      for (int k = 0; k < Block::kWords; ++k) c[k] = j == arg ? v.w[j][k] : c[k];
    }
    int place = 0;
#pragma unroll
    for (int e = 7; e >= 0; --e) place = Block::ChunkValue(c, e) == top ? e : place;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      if (e != place) second = fmaxf(second, Block::ChunkValue(c, e));
    }
    lane_max[at] = detail::Tempered<T>(a, all);
    lane_aux[at] = (OrderedBits(detail::Tempered<T>(a, second)) & ~63u) |
                   static_cast<uint32_t>(arg * 8 + place);
  }
};

// TopKSelectKernel's dynamic shared memory: SelectShared, the candidates, the k best, the lane
// maxima's keys, the list of lanes that reach the threshold.
size_t SelectSharedBytes(int64_t blocks, int32_t k) {
  const int padded = PowerOfTwoAtLeast(k);
  const int64_t maxima = blocks * 32;
  return sizeof(SelectShared) + static_cast<size_t>(maxima) * sizeof(uint32_t) +
         static_cast<size_t>(std::min<int64_t>(maxima, kMaxItems)) * sizeof(int) +
         static_cast<size_t>(CandidateCap(k) + padded) * sizeof(TopKEntry);
}

// Steps 2-3 for 64 < k <= kNarrowLoadsMaxK (and for smaller k on sources the warp selection does
// not serve): a CTA of kSelectThreads per row.
__global__ void __launch_bounds__(kSelectThreads)
    TopKSelectKernel(DeviceSource a, int64_t col0, int64_t blocks, const float* lane_max, int32_t k,
                     int cap, TopKEntry* lists, int32_t* counts) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  SelectShared& sh = *reinterpret_cast<SelectShared*>(smem_raw);
  const int maxima = static_cast<int>(blocks * 32);
  TopKEntry* cand = reinterpret_cast<TopKEntry*>(smem_raw + sizeof(SelectShared));
  const int padded = PowerOfTwoAtLeast(k);
  TopKEntry* best = cand + cap;
  uint32_t* keys = reinterpret_cast<uint32_t*>(best + padded);
  int* items = reinterpret_cast<int*>(keys + maxima);
  const int64_t row = blockIdx.x;
  const int count = counts[row];
  TopKEntry* global_list = lists + row * k;
  const uint32_t threshold =
      RowThreshold(lane_max + row * maxima, maxima, k, count, global_list, keys, &sh);

  // 2. The lanes that reach the threshold offer their 64 values (TransformOne: the operations of
  // TransformInPlace, so the same bits). First a list of those lanes, then a warp per lane, four
  // lanes in flight: thread t loads values 2 (t % 4) and 2 (t % 4) + 1 of the lane's chunk t / 4
  // and the warp appends its hits with one atomic (a thread per lane left 9.8 of 32 threads
  // active and took 0.47 ms for k = 64; a warp per lane, one at a time, 0.26 ms; this form 0.19
  // ms).
  const int warp = threadIdx.x >> 5;
  const int t = threadIdx.x & 31;
  const unsigned below = (1u << t) - 1;
  const int item_cap = min(maxima, kMaxItems);
  for (int64_t blk = warp; blk < blocks; blk += kSelectThreads / 32) {
    const bool hit = keys[blk * 32 + t] >= threshold;
    const unsigned m = __ballot_sync(detail::kFullMask, hit);
    int base = 0;
    if (t == 0 && m != 0) base = atomicAdd(&sh.num_items, __popc(m));
    base = __shfl_sync(detail::kFullMask, base, 0);
    const int i = base + __popc(m & below);
    if (hit && i < item_cap) items[i] = static_cast<int>(blk * 32 + t);
  }
  __syncthreads();
  const int num_items = sh.num_items;
  if (num_items > item_cap) {                          // uniform: heavy ties at T
    if (threadIdx.x == 0) counts[row] = -(count + 1);  // left to the fallback
    return;
  }
  constexpr int kLanesInFlight = 4;
  for (int i0 = warp * kLanesInFlight; i0 < num_items; i0 += kSelectThreads / 32 * kLanesInFlight) {
    float z[kLanesInFlight][2];
    int64_t c[kLanesInFlight];
#pragma unroll
    for (int q = 0; q < kLanesInFlight; ++q) {
      c[q] = 0;
      z[q][0] = z[q][1] = detail::NegInfF();
      if (i0 + q < num_items) {  // uniform over the warp
        const int item = items[i0 + q];
        c[q] = detail::LaneChunkColumn(item, t >> 2) + (t & 3) * 2;
        z[q][0] = detail::LoadOne(a, row, c[q]);
        z[q][1] = detail::LoadOne(a, row, c[q] + 1);
      }
    }
    unsigned h[kLanesInFlight][2];
    int total = 0;
#pragma unroll
    for (int q = 0; q < kLanesInFlight; ++q) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        h[q][e] = __ballot_sync(detail::kFullMask, OrderedBits(z[q][e]) >= threshold);
        total += __popc(h[q][e]);
      }
    }
    int base = 0;
    if (t == 0 && total != 0) base = atomicAdd(&sh.num_cand, total);
    base = __shfl_sync(detail::kFullMask, base, 0);
#pragma unroll
    for (int q = 0; q < kLanesInFlight; ++q) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int i = base + __popc(h[q][e] & below);
        if (((h[q][e] >> t) & 1) && i < cap) {
          cand[i] = TopKEntry{z[q][e], static_cast<int32_t>(col0 + c[q] + e)};
        }
        base += __popc(h[q][e]);
      }
    }
  }
  __syncthreads();
  int n = 0;
  if (!JoinRunningList(sh.num_cand, count, k, cap, global_list, cand, &counts[row], &n)) return;

  // 3. The k best of candidates and list, in order: ranked by counting, or the radix select and
  // a bitonic sort.
  if (n <= kRankByCount) {
    RankByCount(cand, n, k, best);
  } else {
    for (int i = k + threadIdx.x; i < padded; i += blockDim.x) best[i] = Sentinel();
    SelectBest(cand, n, k, &sh.radix, &sh.num_best, best);
    BitonicSortBestFirst(best, padded);
  }
  for (int i = threadIdx.x; i < k; i += blockDim.x) global_list[i] = best[i];
  if (threadIdx.x == 0) counts[row] = k;
}

// The exact fallback: one CTA per row walks the source's blocks in order; for each block:
//   1. every thread keeps those of its 8 values that beat the list's current k-th entry (all of
//      them while the list holds fewer than k) as candidates in shared memory;
//   2. the candidates are padded to a power of two with sentinels and bitonic-sorted, best first;
//   3. the list and the candidates are merged by rank: an entry's place in the merged list is its
//      index in its own list plus the number of entries of the other list that are Better than it
//      (a binary search). Better is a strict total order on (value, id) and ids are distinct, so
//      places are unique and the first k form the new list.
// Candidates are appended with a shared atomic counter, in no particular order; the sort makes the
// result independent of that order. With `only_flagged`, rows whose count is >= 0 (served by the
// fused kernel) are skipped and a flagged count -(c + 1) means c entries.
__global__ void __launch_bounds__(kBlockThreads)
    TopKMergeKernel(DeviceSource a, int64_t col0, int64_t blocks, int32_t k, TopKEntry* lists,
                    int32_t* counts, bool only_flagged) {
  __shared__ TopKEntry list[kMaxTopK];
  __shared__ TopKEntry merged[kMaxTopK];
  __shared__ TopKEntry cand[kVocabBlock];
  // Candidate counters, used alternately: block `blk` appends to num_cand[blk & 1] while the
  // other one is reset for the next block (every thread has read it by the barrier at the top).
  __shared__ int num_cand[2];
  const int64_t row = blockIdx.x;
  int count = counts[row];
  if (only_flagged) {
    if (count >= 0) return;  // uniform over the CTA
    count = -count - 1;
  }
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
    const int padded = PowerOfTwoAtLeast(n);
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

// Whether the selection kernel serves this source (else the fallback serves every row).
bool SelectServes(const LogitsSource& a, int64_t rows) {
  return a.blocks() <= kMaxSelectBlocks && !detail::GridTooLarge(rows, a.blocks());
}

// Step 1: the lanes' maxima, with the statistics when `stats` is set (and only the statistics when
// the selection does not serve the source: the fallback then needs no maxima).
cudaError_t LaunchLaneMax(const LogitsSource& a, int64_t rows, int32_t k,
                          const detail::StatsOp* stats, float* lane_max, cudaStream_t stream) {
  const int64_t blocks = a.blocks();
  if (!SelectServes(a, rows)) {
    if (stats == nullptr) return cudaSuccess;
    return LaunchBlockStats(a, nullptr, rows, stats->stats, stats->stats_ld, stats->stats_offset,
                            stream);
  }
  const DeviceSource da = detail::MakeDeviceSource(a);
  const int64_t pairs = rows * blocks;
  uint32_t* const lane_aux =
      detail::WarpSelectServes(blocks, k) ? LaneAux(lane_max, rows, blocks) : nullptr;
  cudaError_t err = cudaSuccess;
  detail::WithType(a.type, [&](auto ta) {
    constexpr FloatType T = decltype(ta)::value;
    if (stats != nullptr) {
      err = detail::LaunchItems<T, T, false>(
          da, da, blocks, pairs, LaneMaxOp<true>{*stats, lane_max, lane_aux, blocks * 32}, stream);
    } else {
      err = detail::LaunchItems<T, T, false>(
          da, da, blocks, pairs,
          LaneMaxOp<false>{detail::StatsOp{}, lane_max, lane_aux, blocks * 32}, stream);
    }
  });
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

// Steps 2-3 from step 1's maxima, and the fallback for flagged rows (for every row when the
// selection does not serve the source).
cudaError_t LaunchSelect(const LogitsSource& a, int64_t rows, int32_t k, TopKEntry* lists,
                         int32_t* counts, const float* lane_max, cudaStream_t stream) {
  const int64_t blocks = a.blocks();
  const DeviceSource da = detail::MakeDeviceSource(a);
  const unsigned grid = static_cast<unsigned>(rows);
  if (!SelectServes(a, rows)) {
    TopKMergeKernel<<<grid, kBlockThreads, 0, stream>>>(da, a.col0, blocks, k, lists, counts,
                                                        /*only_flagged=*/false);
    return cudaGetLastError();
  }
  if (detail::WarpSelectServes(blocks, k)) {
    const cudaError_t err = detail::LaunchWarpSelect(
        a, rows, lane_max, LaneAux(lane_max, rows, blocks), k, lists, counts, stream);
    if (err != cudaSuccess) return err;
  } else if (k > kNarrowLoadsMaxK) {
    const cudaError_t err = detail::LaunchWideSelect(a, rows, lane_max, k, lists, counts, stream);
    if (err != cudaSuccess) return err;
  } else {
    const cudaError_t err = cudaFuncSetAttribute(
        TopKSelectKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
        static_cast<int>(SelectSharedBytes(kMaxSelectBlocks, kNarrowLoadsMaxK)));
    if (err != cudaSuccess) return err;
    TopKSelectKernel<<<grid, kSelectThreads, SelectSharedBytes(blocks, k), stream>>>(
        da, a.col0, blocks, lane_max, k, CandidateCap(k), lists, counts);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  TopKMergeKernel<<<grid, kBlockThreads, 0, stream>>>(da, a.col0, blocks, k, lists, counts,
                                                      /*only_flagged=*/true);
  return cudaGetLastError();
}

bool TopKArgsValid(const LogitsSource& a, int64_t rows, int32_t k) {
  return k <= kMaxTopK && rows <= INT_MAX && detail::Supported(a);
}

}  // namespace

size_t TopKScratchBytes(int64_t rows, int64_t blocks) {
  // The lanes' maxima, then their aux words (LaneMaxOp).
  return 2 * static_cast<size_t>(rows) * static_cast<size_t>(blocks) * 32 * sizeof(float);
}

cudaError_t LaunchTopKUpdate(const LogitsSource& a, int64_t rows, int32_t k, TopKEntry* lists,
                             int32_t* counts, float* scratch, cudaStream_t stream) {
  const cudaError_t err = LaunchTopKLaneMax(a, nullptr, rows, nullptr, 0, 0, k, scratch, stream);
  if (err != cudaSuccess) return err;
  return LaunchTopKSelect(a, rows, k, lists, counts, scratch, stream);
}

cudaError_t LaunchBlockStatsTopK(const LogitsSource& a, const LogitsSource* b, int64_t rows,
                                 PairBlockStats* stats, int64_t stats_ld, int64_t stats_offset,
                                 int32_t k, TopKEntry* lists, int32_t* counts, float* scratch,
                                 cudaStream_t stream) {
  const cudaError_t err =
      LaunchTopKLaneMax(a, b, rows, stats, stats_ld, stats_offset, k, scratch, stream);
  if (err != cudaSuccess) return err;
  return LaunchTopKSelect(a, rows, k, lists, counts, scratch, stream);
}

cudaError_t LaunchTopKLaneMax(const LogitsSource& a, const LogitsSource* b, int64_t rows,
                              PairBlockStats* stats, int64_t stats_ld, int64_t stats_offset,
                              int32_t k, float* scratch, cudaStream_t stream) {
  if (stats != nullptr && (b != nullptr || k <= 0)) {
    // Pairs: the statistics kernel, then the maxima of `a` alone (a second read of `a`).
    const cudaError_t err = LaunchBlockStats(a, b, rows, stats, stats_ld, stats_offset, stream);
    if (err != cudaSuccess) return err;
    stats = nullptr;
  }
  if (rows <= 0 || k <= 0 || a.cols <= 0) return cudaSuccess;
  if (!TopKArgsValid(a, rows, k)) return cudaErrorInvalidValue;
  if (stats == nullptr) return LaunchLaneMax(a, rows, k, nullptr, scratch, stream);
  const detail::StatsOp op{stats, stats_ld, stats_offset};
  return LaunchLaneMax(a, rows, k, &op, scratch, stream);
}

cudaError_t LaunchTopKSelect(const LogitsSource& a, int64_t rows, int32_t k, TopKEntry* lists,
                             int32_t* counts, const float* scratch, cudaStream_t stream) {
  if (rows <= 0 || k <= 0 || a.cols <= 0) return cudaSuccess;
  if (!TopKArgsValid(a, rows, k)) return cudaErrorInvalidValue;
  return LaunchSelect(a, rows, k, lists, counts, scratch, stream);
}

}  // namespace logitserve::kernels::cuda
