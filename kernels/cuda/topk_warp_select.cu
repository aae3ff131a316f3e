// Top-k steps 2-3 for a small k, a warp per row (topk_kernel.cu has steps 1-3 and the fallback).
#include "kernels/cuda/block_items.cuh"
#include "kernels/cuda/topk_common.cuh"

namespace logitserve::kernels::cuda::detail {
namespace {

// Steps 2-3 for a small k, a warp per row (TopKSelectKernel spends ~20 cycles an instruction on
// its CTA barriers and shared radix passes: Nsight Compute, H200, 60 us a 2048-row tile, DRAM 26 %;
// beside the next tile's statistics it took ~105 us a tile, the longest stage of the pipeline).
// Everything lives in the warp's registers and a little shared memory of its own; the warp never
// waits for another one.
//   a. Each lane holds the maxima of its lane index across the row's blocks (key i of thread t is
//      block i's lane t), as keys ordered like the values. The threshold T is the largest multiple
//      of 2^last_bit with at least k keys >= T, found bit by bit from the top with one warp-wide
//      count per bit: the k-th largest maximum rounded down, so still a lower bound of the row's
//      k-th value (exact for 16-bit inputs without a transform). Only the keys above a cheap
//      floor are counted, and only the bits below those the floor shares with the largest key
//      are searched (7 of them for bf16 normal logits instead of 16 over all keys).
//   b. The lanes whose maximum reaches T (about k) are listed. A lane whose other 63 values all
//      stay below T (its aux word from step 1 says so for all but a lane or two a row) gives its
//      maximum as its only candidate, with the id of the place the aux word names: nothing is
//      loaded. The others' 64 values are loaded again, 16 bytes a thread, and each value >= T
//      takes a slot with its id. (A 16-byte chunk loaded again at a random place costs 64 bytes
//      of DRAM: loading the chunk holding each listed lane's maximum, as this kernel did before,
//      made a 2048-row tile read 26 MB in 30 us; now 18 MB in 19-20 us. Nsight Compute, H200.)
//   c. With the running list's entries added, each candidate's place is the number of candidate
//      keys above it (keys are distinct: ids are), and the k best are written in order.
// Rows it cannot serve (more lanes or candidates than it has room for, fewer than k candidates)
// are flagged for the exact fallback exactly like TopKSelectKernel's.
constexpr int kWarpSelectWarps = 4;    // rows a CTA serves
constexpr int kWarpSelectCap = 256;    // candidates (with the running list) a row may hold
constexpr int kWarpSelectItems = 256;  // lanes reaching T a row may list
static_assert(kWarpSelectItems <= 256, "a lane loaded again is listed in a byte");
// Blocks a row may have (WarpSelectServes): the lane maxima a thread holds in registers.
constexpr int kWarpSelectShortKeys = 40;
constexpr int kWarpSelectLongKeys = 80;

// The largest threshold that keeps `prefix`'s bits above `high`, is a multiple of 2^last_bit and
// has at least k of the warp's keys >= it, found bit by bit from `high` down with one warp-wide
// count per bit (`prefix` itself must have k keys >= it).
template <int N>
__device__ __forceinline__ uint32_t WarpThreshold(const uint32_t (&key)[N], uint32_t prefix,
                                                  int high, int last_bit, int32_t k) {
  uint32_t threshold = prefix;
  for (int bit = high; bit >= last_bit; --bit) {
    const uint32_t trial = threshold | (1u << bit);
    unsigned reach = 0;
#pragma unroll
    for (int i = 0; i < N; ++i) reach += key[i] >= trial ? 1u : 0u;
    if (__reduce_add_sync(kFullMask, reach) >= static_cast<unsigned>(k)) threshold = trial;
  }
  return threshold;
}

template <int kKeys>
__global__ void __launch_bounds__(32 * kWarpSelectWarps)
    TopKWarpSelectKernel(DeviceSource a, int64_t col0, int blocks, int64_t rows,
                         const float* lane_max, const uint32_t* lane_aux, int32_t k, int last_bit,
                         TopKEntry* lists, int32_t* counts) {
  __shared__ uint64_t keys_all[kWarpSelectWarps][kWarpSelectCap];
  __shared__ TopKEntry cand_all[kWarpSelectWarps][kWarpSelectCap];
  __shared__ int items_all[kWarpSelectWarps][kWarpSelectItems];
  __shared__ uint32_t item_keys_all[kWarpSelectWarps][kWarpSelectItems];
  __shared__ uint8_t reread_all[kWarpSelectWarps][kWarpSelectItems];
  __shared__ int num_cand_all[kWarpSelectWarps];
  const int warp = threadIdx.x >> 5;
  const int t = threadIdx.x & 31;
  const unsigned below = (1u << t) - 1;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpSelectWarps + warp;
  if (row >= rows) return;  // the whole warp: no CTA-wide barrier below
  uint64_t* keys = keys_all[warp];
  TopKEntry* cand = cand_all[warp];
  int* items = items_all[warp];
  uint32_t* item_keys = item_keys_all[warp];
  const int count = counts[row];
  TopKEntry* global_list = lists + row * k;
  const int64_t lanes0 = row * blocks * 32;  // the row's first lane maximum and aux word

  // a. The threshold. Keys past the row's blocks are 0, below every key that can be listed (the
  // floor and T are at least 1), so no later test needs the bound.
  uint32_t key[kKeys];
  const float* row_max = lane_max + lanes0 + t;
#pragma unroll
  for (int i = 0; i < kKeys; ++i) key[i] = i < blocks ? OrderedBits(__ldg(row_max + i * 32)) : 0u;
  // Every lane holds at least two keys >= the smallest of the lanes' second largest ones, so at
  // least 64 >= k keys reach that floor: T lies between it and the largest key, and only the
  // keys >= the floor (about 2-3 k of a row's 32 * blocks on normal logits) need counting.
  uint32_t top1 = 0, top2 = 0;
#pragma unroll
  for (int i = 0; i < kKeys; ++i) {
    top2 = max(top2, min(top1, key[i]));
    top1 = max(top1, key[i]);
  }
  const uint32_t floor_key = max(__reduce_min_sync(kFullMask, top2), 1u);
  const uint32_t max_key = __reduce_max_sync(kFullMask, top1);
  // The keys >= the floor, listed (key, index) in the warp's shared memory.
  int mine = 0;
#pragma unroll
  for (int i = 0; i < kKeys; ++i) mine += key[i] >= floor_key ? 1 : 0;
  const int incl = WarpInclusiveSum(mine, t);
  const int listed = __shfl_sync(kFullMask, incl, 31);
  if (listed <= kWarpSelectCap) {  // uniform
    int at = incl - mine;
#pragma unroll
    for (int i = 0; i < kKeys; ++i) {
      if (key[i] >= floor_key) {
        keys[at++] = (static_cast<uint64_t>(key[i]) << 32) | static_cast<uint32_t>(i * 32 + t);
      }
    }
  }
  __syncwarp();
  uint32_t threshold;
  int num_items = 0;
  const uint32_t least = OrderedBits(NegInfF()) + 1;  // masked tokens never count
  if (listed <= kWarpSelectCap) {                     // uniform
    // The bits above the highest one in which floor and maximum differ are T's too.
    constexpr int kPer = kWarpSelectCap / 32;
    uint32_t lk[kPer];
    int index[kPer];
#pragma unroll
    for (int q = 0; q < kPer; ++q) {
      const uint64_t e = q * 32 + t < listed ? keys[q * 32 + t] : 0ull;
      lk[q] = static_cast<uint32_t>(e >> 32);
      index[q] = static_cast<int>(static_cast<uint32_t>(e));
    }
    const uint32_t diff = floor_key ^ max_key;
    const int high = diff == 0 ? -1 : 31 - __clz(diff);
    threshold =
        WarpThreshold(lk, high >= 31 ? 0u : floor_key & (~0u << (high + 1)), high, last_bit, k);
    if (count == k) threshold = max(threshold, OrderedBits(global_list[k - 1].value));
    threshold = max(threshold, least);
    // b. The listed lanes that reach T (padding entries have key 0).
#pragma unroll
    for (int q = 0; q < kPer; ++q) {
      const bool hit = lk[q] >= threshold;
      const unsigned m = __ballot_sync(kFullMask, hit);
      if (hit) {
        const int at = num_items + __popc(m & below);
        items[at] = index[q];
        item_keys[at] = lk[q];
      }
      num_items += __popc(m);
    }
  } else {
    // Many keys at the floor (a row masked but for a few lanes): every key counts.
    // (0 ranks below every key but a negative NaN's; padding keys are 0 and never count.)
    threshold = WarpThreshold(key, 0u, 31, last_bit, k);
    if (count == k) threshold = max(threshold, OrderedBits(global_list[k - 1].value));
    threshold = max(threshold, least);
    // b. The lanes that reach it.
#pragma unroll
    for (int i = 0; i < kKeys; ++i) {
      const unsigned m = __ballot_sync(kFullMask, key[i] >= threshold);
      const int at = num_items + __popc(m & below);
      if (((m >> t) & 1) && at < kWarpSelectItems) {
        items[at] = i * 32 + t;
        item_keys[at] = key[i];
      }
      num_items += __popc(m);
    }
  }
  if (num_items > kWarpSelectItems) {        // uniform: heavy ties at T
    if (t == 0) counts[row] = -(count + 1);  // left to the fallback
    return;
  }
  __syncwarp();
  // Each listed lane: its maximum is its only value >= T when its aux word's second value (| 63:
  // an upper bound of its key) stays below T; that candidate goes straight in, with the id of the
  // place the aux word names. (Not for a maximum of 0, which may stand for -0 or +0: the list
  // keeps the value's own bits.) The other lanes are listed to be loaded again.
  constexpr int kItemsPer = kWarpSelectItems / 32;
  constexpr uint32_t kZeroKey = 0x80000000u;  // OrderedBits(+-0)
  uint8_t* reread = reread_all[warp];
  int num_direct = 0, num_reread = 0;
#pragma unroll
  for (int q = 0; q < kItemsPer; ++q) {
    const int i = q * 32 + t;
    bool direct = false, again = false;
    TopKEntry x{};
    if (i < num_items) {
      const int item = items[i];
      const uint32_t kx = item_keys[i];
      const uint32_t aux = __ldg(lane_aux + lanes0 + item);
      direct = (aux | 63u) < threshold && kx != kZeroKey;
      again = !direct;
      if (direct) {
        const uint32_t place = aux & 63u;
        x.value = ValueOfOrderedBits(kx);
        x.id = static_cast<int32_t>(col0 + LaneChunkColumn(item, static_cast<int>(place >> 3)) +
                                    (place & 7));
      }
    }
    const unsigned dm = __ballot_sync(kFullMask, direct);
    if (direct) {
      const int at = num_direct + __popc(dm & below);  // < num_items <= kWarpSelectCap
      cand[at] = x;
      keys[at] = KeyOf(x);
    }
    num_direct += __popc(dm);
    const unsigned am = __ballot_sync(kFullMask, again);
    if (again) reread[num_reread + __popc(am & below)] = static_cast<uint8_t>(i);
    num_reread += __popc(am);
  }
  // The lanes loaded again: a chunk of 8 values a thread, two chunks in flight. A chunk whose
  // maximum misses T costs a compare; the values that reach it take a slot from a counter in
  // shared memory (their order does not matter: step c places them by key). Values compare as
  // floats against T's value: the same test as their keys against T's for every value but NaN,
  // which is not offered (a row with a NaN fails anyway).
  const float tf = ValueOfOrderedBits(threshold);
  int* num_cand_at = &num_cand_all[warp];
  if (t == 0) *num_cand_at = num_direct;
  __syncwarp();
  constexpr int kInFlight = 2;
  const int pieces = num_reread * kLaneChunks;
  for (int p0 = 0; p0 < pieces; p0 += 32 * kInFlight) {  // uniform bounds
    float v[kInFlight][8];
    int64_t c[kInFlight];
#pragma unroll
    for (int q = 0; q < kInFlight; ++q) {
      const int p = p0 + q * 32 + t;
      c[q] = 0;
      if (p < pieces) {
        const int item = items[reread[p >> 3]];
        c[q] = LaneChunkColumn(item, p & 7);
        Load8(a, row, c[q], v[q]);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) v[q][e] = NegInfF();
      }
    }
#pragma unroll
    for (int q = 0; q < kInFlight; ++q) {
      float m = v[q][0];
#pragma unroll
      for (int e = 1; e < 8; ++e) m = fmaxf(m, v[q][e]);
      if (m >= tf) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          if (v[q][e] >= tf) {
            const int at = atomicAdd(num_cand_at, 1);
            if (at < kWarpSelectCap) {
              const TopKEntry x{v[q][e], static_cast<int32_t>(col0 + c[q] + e)};
              cand[at] = x;
              keys[at] = KeyOf(x);
            }
          }
        }
      }
    }
  }
  __syncwarp();
  const int num_cand = *num_cand_at;
  // (A row with a NaN fails anyway; here nothing overflows or hangs.)
  const int n = num_cand + count;
  if (n > kWarpSelectCap || n < k) {
    if (t == 0) counts[row] = -(count + 1);  // left to the fallback
    return;
  }
  for (int i = t; i < count; i += 32) {
    const TopKEntry x = global_list[i];
    cand[num_cand + i] = x;
    keys[num_cand + i] = KeyOf(x);
  }
  __syncwarp();  // also orders the reads of global_list above before the writes below

  // c. Place = keys above; three candidates a thread per sweep over the keys (one sweep for up
  // to 96 candidates, the usual case).
  constexpr int kOwn = 3;
  for (int i0 = 0; i0 < n; i0 += 32 * kOwn) {  // uniform bounds
    uint64_t own[kOwn];
    int place[kOwn];
#pragma unroll
    for (int q = 0; q < kOwn; ++q) {
      const int i = i0 + q * 32 + t;
      own[q] = i < n ? keys[i] : ~0ull;
      place[q] = 0;
    }
#pragma unroll 4
    for (int j = 0; j < n; ++j) {
      const uint64_t kj = keys[j];
#pragma unroll
      for (int q = 0; q < kOwn; ++q) place[q] += kj > own[q] ? 1 : 0;
    }
#pragma unroll
    for (int q = 0; q < kOwn; ++q) {
      const int i = i0 + q * 32 + t;
      if (i < n && place[q] < k) global_list[place[q]] = cand[i];
    }
  }
  if (t == 0) counts[row] = k;
}

// The last bit of the threshold's search: the lane maxima of 16-bit inputs without a transform
// have no lower bits (an fp16 value's 10 mantissa bits end at bit 13 of an fp32); for the others
// bits below 8 would tighten T by less than 2^-15 of its value.
int ThresholdLastBit(const LogitsSource& a) {
  const bool raw = !a.transform.head && a.transform.temperature == 1.0f;
  if (raw && a.type == FloatType::kBFloat16) return 16;
  if (raw && a.type == FloatType::kFloat16) return 13;
  return 8;
}

}  // namespace

cudaError_t LaunchWarpSelect(const LogitsSource& a, int64_t rows, const float* lane_max,
                             const uint32_t* lane_aux, int32_t k, TopKEntry* lists, int32_t* counts,
                             cudaStream_t stream) {
  const int64_t blocks = a.blocks();
  const unsigned ctas = static_cast<unsigned>((rows + kWarpSelectWarps - 1) / kWarpSelectWarps);
  auto* kernel = blocks <= kWarpSelectShortKeys ? TopKWarpSelectKernel<kWarpSelectShortKeys>
                                                : TopKWarpSelectKernel<kWarpSelectLongKeys>;
  kernel<<<ctas, 32 * kWarpSelectWarps, 0, stream>>>(
      MakeDeviceSource(a), a.col0, static_cast<int>(blocks), rows, lane_max, lane_aux, k,
      ThresholdLastBit(a), lists, counts);
  return cudaGetLastError();
}

}  // namespace logitserve::kernels::cuda::detail
