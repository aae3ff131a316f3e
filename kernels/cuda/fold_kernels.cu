// The fold and the final formulas: one warp per row folds the gathered per-block records (the
// sums of block_stats.h's FoldBlock / FoldPairBlock, which the CPU backend runs, re-associated so
// that no block waits for the previous one; see FoldRowsKernel), then writes the outputs with
// LogProb / Entropy / KlAB / KlBA. Every rank runs the fold on the same gathered bytes and
// therefore gets the same bits; only the rank that reports results passes RowOutputs. Also the JSD
// finish: per row, the gathered partials summed in block order.
#include <climits>

#include "kernels/cuda/device_common.cuh"

namespace logitserve::kernels::cuda {
namespace {

constexpr uint32_t kBadInput = kFlagNaN | kFlagPosInf;
constexpr int kRowThreads = 128;

unsigned RowGrid(int64_t rows) {
  return static_cast<unsigned>((rows + kRowThreads - 1) / kRowThreads);
}

// Record (rank, row, local block) of the gathered messages.
__device__ __forceinline__ const PairBlockStats& Record(const GatheredTile& t, int rank,
                                                        int64_t row, int64_t local) {
  const auto* stats = reinterpret_cast<const PairBlockStats*>(
      t.messages + static_cast<size_t>(rank) * t.layout.bytes + t.layout.stats_offset);
  return stats[row * t.layout.max_blocks + local];
}

// The rank owning global block b.
__device__ __forceinline__ int OwnerOf(const ShardBlocks& s, int64_t b) {
  int r = 0;
  while (r + 1 < s.ranks && b >= s.begin[r + 1]) ++r;
  return r;
}

// One rank's sorted list is the row's top-k as it stands: the lanes of a warp copy it, entry j by
// lane j % 32 (the multi-rank merge below is sequential).
__device__ void CopyOneRankTopK(const GatheredTile& t, int64_t r, int64_t row, const RowStats& a,
                                const RowOutputs& o, int lane) {
  const TopKEntry* list =
      reinterpret_cast<const TopKEntry*>(t.messages + t.layout.topk_offset) + r * o.top_k;
  const int count = reinterpret_cast<const int32_t*>(t.messages + t.layout.count_offset)[r];
  for (int32_t j = lane; j < o.top_k; j += 32) {
    FinishTopKEntry(o, row, j, j < count ? &list[j] : nullptr, a);
  }
}

__device__ void WriteOutputs(const GatheredTile& t, int64_t r, int64_t row, const RowStats& a,
                             const RowStats& b, const PairRowStats& pair, const RowOutputs& o,
                             bool topk_done) {
  // The row finisher (row_finisher.h, shared with the CPU backend); this kernel's part is finding
  // a target's logit in the message of the rank whose columns hold it, and the k-way top-k merge.
  FinishRow(o, row, a, b, pair, [&](int32_t j, int32_t id) {
    const int owner = OwnerOf(t.shards, id / kVocabBlock);
    return reinterpret_cast<const float*>(t.messages + static_cast<size_t>(owner) * t.layout.bytes +
                                          t.layout.target_offset)[r * o.ids_per_row + j];
  });
  if (o.top_k > 0 && !topk_done) {
    // Merge the ranks' sorted lists (their ids are disjoint, so Better decides every step).
    int pos[kMaxRanks];
    const TopKEntry* lists[kMaxRanks];
    int counts[kMaxRanks];
    const int ranks = t.shards.ranks;
    for (int q = 0; q < ranks; ++q) {
      const uint8_t* m = t.messages + static_cast<size_t>(q) * t.layout.bytes;
      lists[q] = reinterpret_cast<const TopKEntry*>(m + t.layout.topk_offset) + r * o.top_k;
      counts[q] = reinterpret_cast<const int32_t*>(m + t.layout.count_offset)[r];
      pos[q] = 0;
    }
    for (int32_t j = 0; j < o.top_k; ++j) {
      int best = -1;
      for (int q = 0; q < ranks; ++q) {
        if (pos[q] < counts[q] && (best < 0 || Better(lists[q][pos[q]], lists[best][pos[best]]))) {
          best = q;
        }
      }
      FinishTopKEntry(o, row, j, best < 0 ? nullptr : &lists[best][pos[best]++], a);
    }
  }
}

// One warp per row, in two passes over the row's records: the global maxima first (exact, so
// order-free), then every block rescaled straight to them and summed in a fixed order (lane l
// holds blocks l, l + 32, ... in order, then the xor butterfly): no step waits for another, where
// FoldBlock / FoldPairBlock's running re-centring is a chain of one rescale per block. Measured
// on the H200 (bf16 pairs, 8192 rows x 38 blocks): that chain, a thread per row, 35 us, and 33 us
// for a 64-row tile (latency, not work); a warp per row folding the chain redundantly 79 us. The
// guards are FoldBlock's: an empty or fully masked block (s = 0) adds nothing, a block whose shift
// to the maximum overflows (exp = 0) adds nothing (no 0 * inf), and a side with no block of its
// own uses shift 0 in the other side's cross term. Equal to the sequential fold in exact
// arithmetic; deterministic and independent of the shard layout, since the records in global
// block order are all it reads; every lane ends with the same bits.
//
// The loads. A lane loads its first kFoldCached records at once, every field unconditionally, and
// keeps them in registers for the second pass (rows of up to 32 * kFoldCached blocks; longer rows
// load their further blocks in each pass). Nsight Compute (H200, 8192 rows x 38 blocks, bf16
// logprobs): with a load per field under its branch, a record's maximum waited for its sum (two
// round trips to DRAM a block, each block after the previous one) and the second pass loaded
// everything again: 532 instructions a row, 10.1 us, half the stall samples on the first load.
constexpr int kFoldWarps = 4;
constexpr int kFoldCached = 4;

__device__ __forceinline__ float WarpMaxF(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(detail::kFullMask, x, off));
  return x;
}

// Block stats at p: two 8-byte loads when the records are 8-byte aligned (a record is 40 bytes).
__device__ __forceinline__ BlockStats LoadBlockStats(const BlockStats* p, bool aligned8) {
  if (aligned8) {
    const float2 ms = __ldg(reinterpret_cast<const float2*>(p));
    const float2 wf = __ldg(reinterpret_cast<const float2*>(p) + 1);
    return BlockStats{ms.x, ms.y, wf.x, __float_as_uint(wf.y)};
  }
  return BlockStats{__ldg(&p->m), __ldg(&p->s), __ldg(&p->w), __ldg(&p->flags)};
}

// The fields of a record the fold reads: b and the cross terms only for pairs (left unset
// otherwise).
template <bool kPair>
__device__ __forceinline__ PairBlockStats LoadFoldRecord(const GatheredTile& t, int64_t r,
                                                         int64_t blk, bool aligned8) {
  const int owner = OwnerOf(t.shards, blk);
  const PairBlockStats& rec = Record(t, owner, r, blk - t.shards.begin[owner]);
  PairBlockStats f;
  f.a = LoadBlockStats(&rec.a, aligned8);
  if constexpr (kPair) {
    f.b = LoadBlockStats(&rec.b, aligned8);
    f.c_ab = __ldg(&rec.c_ab);
    f.c_ba = __ldg(&rec.c_ba);
  }
  return f;
}

template <bool kPair>
__global__ void __launch_bounds__(32 * kFoldWarps)
    FoldRowsKernel(GatheredTile t, int64_t rows, int64_t row0, FoldedRows folded,
                   int32_t* first_bad_row, RowOutputs outputs, bool write_outputs, bool aligned8) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kFoldWarps + (threadIdx.x >> 5);
  if (r >= rows) return;  // uniform per warp
  const int lane = threadIdx.x & 31;
  const int64_t n = t.num_blocks;
  PairBlockStats cached[kFoldCached];
#pragma unroll
  for (int i = 0; i < kFoldCached; ++i) {
    const int64_t blk = lane + 32 * i;
    if (blk < n) cached[i] = LoadFoldRecord<kPair>(t, r, blk, aligned8);
  }
  float ma = detail::NegInfF(), mb = detail::NegInfF();
  uint32_t fa = 0, fb = 0;
  auto first_pass = [&](const PairBlockStats& rec) {
    fa |= rec.a.flags;
    if (rec.a.s > 0.0f) ma = fmaxf(ma, rec.a.m);
    if constexpr (kPair) {
      fb |= rec.b.flags;
      if (rec.b.s > 0.0f) mb = fmaxf(mb, rec.b.m);
    }
  };
#pragma unroll
  for (int i = 0; i < kFoldCached; ++i) {
    if (lane + 32 * i < n) first_pass(cached[i]);
  }
  for (int64_t blk = lane + 32 * kFoldCached; blk < n; blk += 32) {
    first_pass(LoadFoldRecord<kPair>(t, r, blk, aligned8));
  }
  ma = WarpMaxF(ma);
  mb = WarpMaxF(mb);
  fa = __reduce_or_sync(detail::kFullMask, fa);
  fb = __reduce_or_sync(detail::kFullMask, fb);
  float sa = 0.0f, wa = 0.0f, sb = 0.0f, wb = 0.0f, cab = 0.0f, cba = 0.0f;
  auto second_pass = [&](const PairBlockStats& rec) {
    const bool live_a = rec.a.s > 0.0f;
    const float da = live_a ? rec.a.m - ma : 0.0f;  // <= 0; may overflow to -inf
    const float ea = live_a ? expf(da) : 0.0f;
    if (ea > 0.0f) {
      sa += rec.a.s * ea;
      wa += (rec.a.w + rec.a.s * da) * ea;
    }
    if constexpr (kPair) {
      const bool live_b = rec.b.s > 0.0f;
      const float db = live_b ? rec.b.m - mb : 0.0f;
      const float eb = live_b ? expf(db) : 0.0f;
      if (eb > 0.0f) {
        sb += rec.b.s * eb;
        wb += (rec.b.w + rec.b.s * db) * eb;
      }
      if (ea > 0.0f) cab += (rec.c_ab + rec.a.s * (da - db)) * ea;
      if (eb > 0.0f) cba += (rec.c_ba + rec.b.s * (db - da)) * eb;
    }
  };
#pragma unroll
  for (int i = 0; i < kFoldCached; ++i) {
    if (lane + 32 * i < n) second_pass(cached[i]);
  }
  for (int64_t blk = lane + 32 * kFoldCached; blk < n; blk += 32) {
    second_pass(LoadFoldRecord<kPair>(t, r, blk, aligned8));
  }
  sa = detail::WarpSum(sa);
  wa = detail::WarpSum(wa);
  RowStats a = ma != detail::NegInfF() ? RowStats{ma, sa, wa, fa}
                                       : RowStats{detail::NegInfF(), 0.0f, 0.0f, fa};
  RowStats b = EmptyRowStats();
  PairRowStats pair = EmptyPairRowStats();
  if constexpr (kPair) {
    sb = detail::WarpSum(sb);
    wb = detail::WarpSum(wb);
    cab = detail::WarpSum(cab);
    cba = detail::WarpSum(cba);
    b = mb != detail::NegInfF() ? RowStats{mb, sb, wb, fb}
                                : RowStats{detail::NegInfF(), 0.0f, 0.0f, fb};
    pair = PairRowStats{a, b, ma != detail::NegInfF() ? cab : 0.0f,
                        mb != detail::NegInfF() ? cba : 0.0f};
  }
  const int64_t row = row0 + r;
  const bool topk_by_lanes = write_outputs && outputs.top_k > 0 && t.shards.ranks == 1;
  if (topk_by_lanes) CopyOneRankTopK(t, r, row, a, outputs, lane);
  if (lane != 0) return;
  if (folded.a != nullptr) folded.a[r] = a;
  if (folded.b != nullptr) folded.b[r] = b;
  const int32_t row32 = row < INT_MAX ? static_cast<int32_t>(row) : INT_MAX - 1;
  if (a.flags & kBadInput) atomicMin(first_bad_row, row32);
  if (b.flags & kBadInput) atomicMin(first_bad_row + 1, row32);
  if (write_outputs) WriteOutputs(t, r, row, a, b, pair, outputs, topk_by_lanes);
}

__global__ void __launch_bounds__(kRowThreads)
    JsdFinishKernel(const float* partials, size_t rank_stride, int64_t partials_ld,
                    ShardBlocks shards, int64_t num_blocks, const RowStats* folded_s,
                    const RowStats* folded_t, int64_t rows, int64_t row0, float* jsd) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  float sum = 0.0f;
  int owner = 0;
  for (int64_t b = 0; b < num_blocks; ++b) {
    while (owner + 1 < shards.ranks && b >= shards.begin[owner + 1]) ++owner;
    sum += partials[static_cast<size_t>(owner) * rank_stride + r * partials_ld +
                    (b - shards.begin[owner])];
  }
  const bool masked = AllMasked(folded_s[r]) || AllMasked(folded_t[r]);
  jsd[row0 + r] = masked ? QuietNaN() : sum;
}

}  // namespace

cudaError_t LaunchFoldRows(const GatheredTile& tile, int64_t rows, int64_t row0, FoldedRows folded,
                           int32_t* first_bad_row, const RowOutputs* outputs, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (tile.shards.ranks < 1 || tile.shards.ranks > kMaxRanks) return cudaErrorInvalidValue;
  if (outputs != nullptr && outputs->top_k > kMaxTopK) return cudaErrorInvalidValue;
  // Records are 8-byte aligned when the messages and their stride are (the backend's are: 256).
  const bool aligned8 =
      reinterpret_cast<uintptr_t>(tile.messages + tile.layout.stats_offset) % 8 == 0 &&
      tile.layout.bytes % 8 == 0;
  const unsigned grid = static_cast<unsigned>((rows + kFoldWarps - 1) / kFoldWarps);
  const RowOutputs o = outputs != nullptr ? *outputs : RowOutputs{};
  if (tile.pair) {
    FoldRowsKernel<true><<<grid, 32 * kFoldWarps, 0, stream>>>(
        tile, rows, row0, folded, first_bad_row, o, outputs != nullptr, aligned8);
  } else {
    FoldRowsKernel<false><<<grid, 32 * kFoldWarps, 0, stream>>>(
        tile, rows, row0, folded, first_bad_row, o, outputs != nullptr, aligned8);
  }
  return cudaGetLastError();
}

cudaError_t LaunchJsdFinish(const float* partials, size_t rank_stride, int64_t partials_ld,
                            const ShardBlocks& shards, int64_t num_blocks, const RowStats* folded_s,
                            const RowStats* folded_t, int64_t rows, int64_t row0, float* jsd,
                            cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (shards.ranks < 1 || shards.ranks > kMaxRanks) return cudaErrorInvalidValue;
  JsdFinishKernel<<<RowGrid(rows), kRowThreads, 0, stream>>>(
      partials, rank_stride, partials_ld, shards, num_blocks, folded_s, folded_t, rows, row0, jsd);
  return cudaGetLastError();
}

}  // namespace logitserve::kernels::cuda
