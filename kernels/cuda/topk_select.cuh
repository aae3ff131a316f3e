// The CTA-per-row top-k selections' shared parts (private to kernels/cuda): topk_kernel.cu's
// TopKSelectKernel and topk_wide_select.cu's TopKSelectWideKernel run steps 2-3 of topk_kernel.cu
// with the same threshold, the same candidates (every value >= it) and the same exact selection of
// the k best, so both give the unique top-k of Better.
#pragma once

#include <climits>
#include <cstdint>

#include "kernels/cuda/topk_common.cuh"

namespace logitserve::kernels::cuda::detail {

// Candidates a row may collect in shared memory: without ties at T, the k lanes that reach it hold
// at most 64 k values; normal logits in bf16 give about 1.1 k (k = 64) to 2.3 k (k = 1024).
inline constexpr int kMaxCandidates = 4096;
// Candidates up to which the selection ranks by counting (n^2 / threads key compares a thread)
// rather than by radix select and a sort.
inline constexpr int kRankByCount = 512;
// Blocks a source may have for the selection kernels (their lane maxima are staged in shared
// memory: 128 bytes a block); longer sources go to the fallback for every row.
inline constexpr int64_t kMaxSelectBlocks = 512;
// Radix select: 8-bit digits.
inline constexpr int kRadixBins = 256;

// The smallest power of two >= n (n >= 1): the bitonic sort's padded length.
__host__ __device__ __forceinline__ int PowerOfTwoAtLeast(int n) {
  int p = 1;
  while (p < n) p <<= 1;
  return p;
}

// Ranks after every real entry (also -inf ones, whose ids are smaller).
__device__ __forceinline__ TopKEntry Sentinel() { return TopKEntry{NegInfF(), INT_MAX}; }

// What the CTA agrees on after each radix pass (written by one thread, read by all).
struct RadixShared {
  int hist[kRadixBins];
  int digit;
  int above;  // keys of the current prefix group with a larger digit
  int count;  // keys of the current prefix group with this digit
};

// The k best (largest) of n keys, 1 <= k <= n, key(i) for i < n, zero above bit `top_bit` + 8,
// digits from bit `top_bit` down to bit `last_bit`: returns (prefix, shift) such that the keys with
// key >> shift >= prefix >> shift are the k largest when the keys are distinct in their bits above
// last_bit (otherwise a superset: every key that ties the k-th above last_bit). With `stop_early`,
// stops at the first digit whose group is taken whole (still exact as a selection). Called by
// every thread of the CTA; the result is uniform.
template <typename KeyAt>
__device__ __forceinline__ void RadixSelect(int n, int k, int top_bit, int last_bit,
                                            bool stop_early, KeyAt key_at, RadixShared* sh,
                                            uint64_t* prefix_out, int* shift_out) {
  uint64_t prefix = 0;
  int remaining = k;
  for (int shift = top_bit; shift >= last_bit; shift -= 8) {
    for (int i = threadIdx.x; i < kRadixBins; i += blockDim.x) sh->hist[i] = 0;
    __syncthreads();
    const uint64_t group_mask = shift + 8 >= 64 ? 0 : (~0ull << (shift + 8));
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const uint64_t key = key_at(i);
      if ((key & group_mask) == prefix) {
        atomicAdd(&sh->hist[static_cast<int>(key >> shift) & (kRadixBins - 1)], 1);
      }
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      // Lane l holds digits 255 - 8 l down to 248 - 8 l: lanes in order visit digits largest first.
      const int lane = threadIdx.x;
      int c[8], mine = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        c[j] = sh->hist[kRadixBins - 1 - 8 * lane - j];
        mine += c[j];
      }
      const int incl = WarpInclusiveSum(mine, lane);
      int above = incl - mine;
      if (above < remaining && remaining <= incl) {  // exactly one lane
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (above + c[j] >= remaining) {
            sh->digit = kRadixBins - 1 - 8 * lane - j;
            sh->above = above;
            sh->count = c[j];
            break;
          }
          above += c[j];
        }
      }
    }
    __syncthreads();
    prefix |= static_cast<uint64_t>(sh->digit) << shift;
    remaining -= sh->above;
    if ((stop_early && sh->count == remaining) || shift == last_bit) {
      *prefix_out = prefix;
      *shift_out = shift;
      return;
    }
    // sh is written again only after the next pass's two barriers: every thread has read it.
  }
}

struct alignas(16) SelectShared {
  RadixShared radix;
  int num_cand;
  int num_best;
  int num_items;  // TopKSelectKernel: lanes listed; TopKSelectWideKernel: chunks listed
};

// Step 2's start: the row's lane maxima (row_max[0, maxima)) staged as ordered keys in keys[], the
// CTA's counters cleared, and the threshold as an ordered key: the k-th largest lane maximum when
// there are k of them, raised to the list's worst entry when the list is full (a value below it
// cannot enter), and above -inf (masked tokens are never candidates). Called by every thread of
// the CTA; the result is uniform.
__device__ __forceinline__ uint32_t RowThreshold(const float* row_max, int maxima, int32_t k,
                                                 int count, const TopKEntry* global_list,
                                                 uint32_t* keys, SelectShared* sh) {
#pragma unroll 4
  for (int i = threadIdx.x; i < maxima; i += blockDim.x) keys[i] = OrderedBits(__ldg(row_max + i));
  if (threadIdx.x == 0) sh->num_cand = 0, sh->num_best = 0, sh->num_items = 0;
  __syncthreads();
  uint32_t threshold = 0;
  if (maxima >= k) {
    uint64_t prefix;
    int shift;
    // The top 16 bits only (two passes): exact for 16-bit inputs, whose values have no more, and a
    // slightly lower threshold (a few more candidates) for fp32.
    RadixSelect(
        maxima, k, 24, 16, /*stop_early=*/false,
        [&](int i) { return static_cast<uint64_t>(keys[i]); }, &sh->radix, &prefix, &shift);
    threshold = static_cast<uint32_t>(prefix);
  }
  if (count == k) threshold = max(threshold, OrderedBits(global_list[k - 1].value));
  return max(threshold, OrderedBits(NegInfF()) + 1);
}

// Elements [c, c + 8) of the row into v when `live` (Load8), else -inf.
__device__ __forceinline__ void Load8If(bool live, const DeviceSource& a, int64_t row, int64_t c,
                                        float (&v)[8]) {
  if (live) {
    Load8(a, row, c, v);
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = NegInfF();
  }
}

// After step 2 (and a barrier): whether the row's `fresh` candidates and the `count` entries of its
// running list fit in cand[0, cap) and number at least k. If they do, the list's entries join the
// candidates (then a barrier) and *n is their number; if not (heavy ties at T, or a mostly masked
// row), the row is flagged for the fallback (a negative count). Uniform over the CTA.
__device__ __forceinline__ bool JoinRunningList(int fresh, int count, int32_t k, int cap,
                                                const TopKEntry* list, TopKEntry* cand,
                                                int32_t* row_count, int* n) {
  // (A NaN ranks by its bits here; such a row fails anyway, and nothing overflows or hangs.)
  if (fresh + count > cap || fresh + count < k) {
    if (threadIdx.x == 0) *row_count = -(count + 1);  // left to the fallback
    return false;
  }
  for (int i = threadIdx.x; i < count; i += blockDim.x) cand[fresh + i] = list[i];
  __syncthreads();
  *n = fresh + count;
  return true;
}

// Few candidates: each one's place among cand[0, n) is the number of keys above it (keys are
// distinct: ids are), which selects and sorts at once: best[0, k) in order, then a barrier.
__device__ __forceinline__ void RankByCount(const TopKEntry* cand, int n, int32_t k,
                                            TopKEntry* best) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const TopKEntry e = cand[i];
    const uint64_t key = KeyOf(e);
    int place = 0;
    for (int j = 0; j < n; ++j) place += KeyOf(cand[j]) > key ? 1 : 0;
    if (place < k) best[place] = e;
  }
  __syncthreads();
}

// Many candidates: the k best of cand[0, n) by a radix select on their keys, into best[0, k) in no
// particular order (*num_best counts them from 0), then a barrier.
__device__ __forceinline__ void SelectBest(const TopKEntry* cand, int n, int32_t k,
                                           RadixShared* radix, int* num_best, TopKEntry* best) {
  uint64_t prefix;
  int shift;
  RadixSelect(
      n, k, 56, 0, /*stop_early=*/true, [&](int i) { return KeyOf(cand[i]); }, radix, &prefix,
      &shift);
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const TopKEntry e = cand[i];
    if ((KeyOf(e) >> shift) >= (prefix >> shift)) best[atomicAdd(num_best, 1)] = e;
  }
  __syncthreads();
}

}  // namespace logitserve::kernels::cuda::detail
