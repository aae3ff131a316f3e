// The fold and the final formulas: one thread per row folds the gathered per-block records in
// global block order (block_stats.h's FoldBlock / FoldPairBlock: the same code the CPU backend
// runs), then writes the outputs with LogProb / Entropy / KlAB / KlBA. Every rank runs the fold on
// the same gathered bytes and therefore gets the same bits; only the rank that reports results
// passes RowOutputs. Also the JSD finish: per row, the gathered partials summed in block order.
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

__device__ void WriteOutputs(const GatheredTile& t, int64_t r, int64_t row, const RowStats& a,
                             const RowStats& b, const PairRowStats& pair, const RowOutputs& o) {
  if (o.target_logprobs != nullptr) {
    auto targets = [&](int rank) {
      return reinterpret_cast<const float*>(
          t.messages + static_cast<size_t>(rank) * t.layout.bytes + t.layout.target_offset);
    };
    for (int32_t j = 0; j < o.ids_per_row; ++j) {
      const int64_t idx = row * o.ids_per_row + j;
      const int32_t id = o.target_ids[idx];
      if (id == o.ignore_index) {
        o.target_logprobs[idx] = 0.0f;
        continue;
      }
      const int owner = OwnerOf(t.shards, id / kVocabBlock);
      o.target_logprobs[idx] = LogProb(targets(owner)[r * o.ids_per_row + j], a);
    }
  }
  if (o.top_k > 0) {
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
      const int64_t idx = row * o.top_k + j;
      if (best < 0) {  // cannot happen for top_k <= vocab; keep the output defined anyway
        o.top_k_ids[idx] = -1;
        o.top_k_logprobs[idx] = QuietNaN();
        continue;
      }
      const TopKEntry e = lists[best][pos[best]++];
      o.top_k_ids[idx] = e.id;
      o.top_k_logprobs[idx] = LogProb(e.value, a);
    }
  }
  if (o.entropy != nullptr) o.entropy[row] = Entropy(a);
  if (o.reference_entropy != nullptr) o.reference_entropy[row] = Entropy(b);
  // Model = a, reference = b: forward KL(reference || model) = KL(b || a).
  if (o.forward_kl != nullptr || o.jsd_endpoint == 1) {
    const float f = KlBA(pair);
    if (o.forward_kl != nullptr) o.forward_kl[row] = f;
    if (o.jsd_endpoint == 1) o.jsd[row] = f;
  }
  if (o.reverse_kl != nullptr || o.jsd_endpoint == 2) {
    const float rv = KlAB(pair);
    if (o.reverse_kl != nullptr) o.reverse_kl[row] = rv;
    if (o.jsd_endpoint == 2) o.jsd[row] = rv;
  }
}

constexpr int kFoldThreads = 32;  // small CTAs: 8192 rows are 256 warps, which should reach every SM

// One thread per row: the fold is a chain (each block's rescale depends on the running maxima),
// so what costs is the latency of each step. The records are loaded kFoldGroup at a time, the
// next group's loads in flight while the current group is folded. Measured on the H200 for 8192
// rows x 38 blocks (bf16 pairs): this 35 us; a warp per row folding redundantly in every lane 79
// us; records staged in shared memory by the CTA 62 us; a two-pass fold (maxima first, then every
// block rescaled to them, no chain) 35 us for pairs but 38 us for single rows against 20 here.
constexpr int kFoldGroup = 8;

__device__ __forceinline__ void LoadGroup(const GatheredTile& t, int64_t r, int64_t g,
                                          PairBlockStats (&rec)[kFoldGroup]) {
#pragma unroll
  for (int i = 0; i < kFoldGroup; ++i) {
    const int64_t b = g + i;
    if (b < t.num_blocks) {
      const int owner = OwnerOf(t.shards, b);
      rec[i] = Record(t, owner, r, b - t.shards.begin[owner]);
    }
  }
}

__global__ void __launch_bounds__(kFoldThreads)
    FoldRowsKernel(GatheredTile t, int64_t rows, int64_t row0, FoldedRows folded,
                   int32_t* first_bad_row, RowOutputs outputs, bool write_outputs) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kFoldThreads + threadIdx.x;
  if (r >= rows) return;
  PairRowStats pair = EmptyPairRowStats();
  RowStats single = EmptyRowStats();
  PairBlockStats cur[kFoldGroup] = {}, next[kFoldGroup] = {};
  LoadGroup(t, r, 0, cur);
  for (int64_t g = 0; g < t.num_blocks; g += kFoldGroup) {
    if (g + kFoldGroup < t.num_blocks) LoadGroup(t, r, g + kFoldGroup, next);
#pragma unroll
    for (int i = 0; i < kFoldGroup; ++i) {
      if (g + i < t.num_blocks) {
        if (t.pair) {
          FoldPairBlock(pair, cur[i]);
        } else {
          FoldBlock(single, cur[i].a);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kFoldGroup; ++i) cur[i] = next[i];
  }
  const RowStats a = t.pair ? pair.a : single;
  const RowStats b = t.pair ? pair.b : EmptyRowStats();
  if (folded.a != nullptr) folded.a[r] = a;
  if (folded.b != nullptr) folded.b[r] = b;
  const int64_t row = row0 + r;
  const int32_t row32 = row < INT_MAX ? static_cast<int32_t>(row) : INT_MAX - 1;
  if (a.flags & kBadInput) atomicMin(first_bad_row, row32);
  if (b.flags & kBadInput) atomicMin(first_bad_row + 1, row32);
  if (write_outputs) WriteOutputs(t, r, row, a, b, pair, outputs);
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
  FoldRowsKernel<<<static_cast<unsigned>((rows + kFoldThreads - 1) / kFoldThreads), kFoldThreads,
                   0, stream>>>(
      tile, rows, row0, folded, first_bad_row, outputs != nullptr ? *outputs : RowOutputs{},
      outputs != nullptr);
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
