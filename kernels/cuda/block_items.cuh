// The statistics of one (row, vocabulary block) from a warp's loaded values, shared by the
// statistics kernels and the fused statistics + top-k kernel (private to kernels/cuda). The
// arithmetic mirrors kernels/cpu/cpu_kernels.cc operation for operation (same clamp, same flags,
// same cross-term signs); only the summation order inside a block differs (lane_block.cuh), so
// CPU and GPU agree to rounding, not bit for bit. Every kernel that writes a block record calls
// these functions, so a record has the same bits whichever kernel wrote it.
#pragma once

#include <type_traits>

#include "kernels/cuda/lane_block.cuh"

namespace logitserve::kernels::cuda::detail {

inline constexpr uint32_t kBadInput = kFlagNaN | kFlagPosInf;

__device__ __forceinline__ uint32_t BadFlags(float m) {
  return (m != m ? kFlagNaN : 0u) | (m == PosInfF() ? kFlagPosInf : 0u);
}

// The sums of one distribution's block, centred on its maximum m (finite): s = sum exp(dz),
// w = sum exp(dz) dz with dz = max(z - m, kClampShift). Two accumulators a lane (even / odd e),
// then the butterfly: the fixed order of lane_block.cuh.
template <FloatType T, bool kOn>
__device__ __forceinline__ void WarpBlockSums(Temper<T, kOn> tp, const LaneBlock<T>& b, float m,
                                              float* s_out, float* w_out) {
  float s[2] = {0.0f, 0.0f}, w[2] = {0.0f, 0.0f};
#pragma unroll
  for (int j = 0; j < kLaneChunks; ++j) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float dz = fmaxf(Z(tp, b, j, e) - m, kClampShift);
      const float ex = ExpShift(dz);
      s[e & 1] += ex;
      w[e & 1] = fmaf(ex, dz, w[e & 1]);
    }
  }
  *s_out = WarpSum(s[0] + s[1]);
  *w_out = WarpSum(w[0] + w[1]);
}

// The record of one (row, block) of a single distribution, from the lane's loaded values.
template <FloatType T>
__device__ __forceinline__ void SingleItem(const DeviceSource& a, int64_t row, int64_t blk,
                                           int lane, LaneBlock<T>& va, PairBlockStats* stats,
                                           int64_t stats_ld, int64_t stats_offset) {
  const int64_t c0 = blk * kVocabBlock;
  TransformInPlace(a, c0, lane, va);
  BlockStats out = EmptyBlockStats();
  WithTemper<T>(a, [&](auto ta) {
    const float m = WarpMaxNaN(LaneMax(ta, va));
    out.flags = BadFlags(m);
    if (out.flags == 0 && m != NegInfF()) {  // uniform over the warp
      WarpBlockSums(ta, va, m, &out.s, &out.w);
      out.m = m;
    }
  });
  if (lane == 0) {
    stats[row * stats_ld + stats_offset + blk] = PairBlockStats{out, EmptyBlockStats(), 0.0f, 0.0f};
  }
}

// The record of one (row, block) of a pair of distributions, from the lanes' loaded values.
template <FloatType TA, FloatType TB>
__device__ __forceinline__ void PairItem(const DeviceSource& a, const DeviceSource& b, int64_t row,
                                         int64_t blk, int lane, LaneBlock<TA>& va,
                                         LaneBlock<TB>& vb, PairBlockStats* stats, int64_t stats_ld,
                                         int64_t stats_offset) {
  const int64_t c0 = blk * kVocabBlock;
  TransformInPlace(a, c0, lane, va);
  TransformInPlace(b, c0, lane, vb);
  PairBlockStats out{EmptyBlockStats(), EmptyBlockStats(), 0.0f, 0.0f};
  WithTempers<TA, TB>(a, b, [&](auto ta, auto tb) {
    const float ma = WarpMaxNaN(LaneMax(ta, va));
    const float mb = WarpMaxNaN(LaneMax(tb, vb));
    out.a.flags = BadFlags(ma);
    out.b.flags = BadFlags(mb);
    if (((out.a.flags | out.b.flags) & kBadInput) == 0) {  // uniform over the warp
      const float ninf = NegInfF();
      // A fully masked side has m = -inf; shifting by 0 instead keeps its values at -inf (masked).
      const float sha = ma == ninf ? 0.0f : ma;
      const float shb = mb == ninf ? 0.0f : mb;
      // Per side the very sums of WarpBlockSums (same operations, same order): the model side of a
      // pair job has the single job's bits.
      float sa[2] = {0.0f, 0.0f}, wa[2] = {0.0f, 0.0f}, sb[2] = {0.0f, 0.0f}, wb[2] = {0.0f, 0.0f};
      float cab[2] = {0.0f, 0.0f}, cba[2] = {0.0f, 0.0f};
      bool a_only = false, b_only = false;
      // One token's terms into accumulator q (both paths: the same operations in the same order).
      auto add = [&](int q, float ea, float da, float eb, float db, float diff) {
        sa[q] += ea;
        wa[q] = fmaf(ea, da, wa[q]);
        sb[q] += eb;
        wb[q] = fmaf(eb, db, wb[q]);
        cab[q] = fmaf(ea, diff, cab[q]);
        cba[q] = fmaf(-eb, diff, cba[q]);
      };
      // Fast path: no token of the block is masked on either side (every shift finite, so no
      // clamp can matter: a shift below kClampShift has exp = 0 and adds 0 * shift = -0 either way,
      // and every token is live on both sides). The bits equal the general path's.
      const float lo_a = WarpMin(LaneMin(ta, va)) - sha;
      const float lo_b = WarpMin(LaneMin(tb, vb)) - shb;
      if (lo_a > ninf && lo_b > ninf) {  // uniform over the warp
#pragma unroll
        for (int j = 0; j < kLaneChunks; ++j) {
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const float da = Z(ta, va, j, e) - sha;
            const float db = Z(tb, vb, j, e) - shb;
            add(e & 1, ExpShift(da), da, ExpShift(db), db, da - db);
          }
        }
      } else {
#pragma unroll
        for (int j = 0; j < kLaneChunks; ++j) {
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const float da = Z(ta, va, j, e) - sha;
            const float db = Z(tb, vb, j, e) - shb;
            const bool live_a = da > ninf;
            const bool live_b = db > ninf;
            a_only |= live_a && !live_b;
            b_only |= live_b && !live_a;
            const float dac = fmaxf(da, kClampShift);
            const float dbc = fmaxf(db, kClampShift);
            // Cross terms over tokens both sides support, with the unclamped shifts: a deep but
            // finite logit (b - m_b = -300) is underflow, not masking, and its KL term grows with
            // it. A token only one side supports raised a mismatch flag, which overrides that
            // direction with +inf.
            add(e & 1, ExpShift(dac), dac, ExpShift(dbc), dbc, (live_a && live_b) ? da - db : 0.0f);
          }
        }
      }
      if (__any_sync(kFullMask, a_only)) out.a.flags |= kFlagASupportsBMasked;
      if (__any_sync(kFullMask, b_only)) out.a.flags |= kFlagBSupportsAMasked;
      if (ma != ninf) {
        out.a.m = ma;
        out.a.s = WarpSum(sa[0] + sa[1]);
        out.a.w = WarpSum(wa[0] + wa[1]);
        out.c_ab = WarpSum(cab[0] + cab[1]);
      }
      if (mb != ninf) {
        out.b.m = mb;
        out.b.s = WarpSum(sb[0] + sb[1]);
        out.b.w = WarpSum(wb[0] + wb[1]);
        out.c_ba = WarpSum(cba[0] + cba[1]);
      }
    }
  });
  if (lane == 0) stats[row * stats_ld + stats_offset + blk] = out;
}

// The target logits of `row` that lie in block `blk` of an fp32 source, from the lane values
// after TransformInPlace: for each id, the lane that holds it writes it. Full blocks without a
// transform tail add 0 where TransformOne selects +0 for a zero: the same bits for every number
// (a NaN's payload aside, and a NaN logit fails the row). Ids outside the block, the source's
// columns or negative (ignore_index) are left to other blocks and shards.
struct BlockTargets {
  const int32_t* ids = nullptr;  // null: no targets
  int32_t ids_per_row = 0;
  float* targets = nullptr;
  int64_t col0 = 0;  // global id of the source's column 0
  __device__ __forceinline__ void Write(const DeviceSource& a, int64_t row, int64_t blk, int lane,
                                        const LaneBlock<FloatType::kFloat32>& v) const {
    const int64_t c0 = blk * kVocabBlock;
    for (int32_t q = 0; q < ids_per_row; ++q) {
      const int64_t i = row * ids_per_row + q;
      const int64_t c = static_cast<int64_t>(ids[i]) - col0;  // the source's column
      const int64_t d = c - c0;
      // Uniform over the warp (every lane reads the same id).
      if (d < 0 || d >= static_cast<int64_t>(kVocabBlock) || c >= a.cols) continue;
      if (static_cast<int>((d >> 3) & 31) != lane) continue;
      const int jj = static_cast<int>(d >> 8), ee = static_cast<int>(d & 7);
      float x = 0.0f;
#pragma unroll
      for (int j = 0; j < kLaneChunks; ++j) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          if (j == jj && e == ee) x = v.Value(j, e);  // selects: no indexed register array
        }
      }
      targets[i] = x;
    }
  }
};

// What a (row, block) kernel computes per item, given the lanes' loaded values.
struct StatsOp {
  PairBlockStats* stats;
  int64_t stats_ld;
  int64_t stats_offset;
  BlockTargets targets;  // fp32 `a` only (LaunchBlockStats checks)
  template <FloatType TA>
  __device__ __forceinline__ void operator()(const DeviceSource& a, int64_t row, int64_t blk,
                                             int lane, LaneBlock<TA>& va) const {
    SingleItem(a, row, blk, lane, va, stats, stats_ld, stats_offset);
    if constexpr (TA == FloatType::kFloat32) {
      if (targets.ids != nullptr) targets.Write(a, row, blk, lane, va);
    }
  }
  template <FloatType TA, FloatType TB>
  __device__ __forceinline__ void operator()(const DeviceSource& a, const DeviceSource& b,
                                             int64_t row, int64_t blk, int lane, LaneBlock<TA>& va,
                                             LaneBlock<TB>& vb) const {
    PairItem(a, b, row, blk, lane, va, vb, stats, stats_ld, stats_offset);
    if constexpr (TA == FloatType::kFloat32) {
      if (targets.ids != nullptr) targets.Write(a, row, blk, lane, va);
    }
  }
};

// Head transforms are applied in place, which needs fp32 words (hidden mode's GEMM output is
// fp32); a 16-bit source may carry a temperature only.
inline bool Supported(const LogitsSource& s) {
  return s.type == FloatType::kFloat32 || !s.transform.head;
}

// Warp w of CTA x owns (row, block) pair x * kPairWarps + w of the grid's rows * blocks pairs,
// blocks of a row adjacent. Returns false for the grid's spare warps (uniform per warp).
__device__ __forceinline__ bool WarpPair(int64_t blocks, int64_t pairs, int64_t* row,
                                         int64_t* blk) {
  const int64_t p = static_cast<int64_t>(blockIdx.x) * kPairWarps + (threadIdx.x >> 5);
  if (p >= pairs) return false;
  *row = p / blocks;
  *blk = p - *row * blocks;
  return true;
}

// One warp per (row, block), loading straight from global memory: every warp has its 16-byte loads
// in flight before the first use. (A persistent variant, each warp walking its items with a
// cp.async ring of 3-4 staged blocks in shared memory, measured slower on the H200: bf16 single
// statistics 0.341 ms against 0.290, pairs 1.09 against 0.78 ms; the ring's shared memory cut
// the resident warps to 12 per SM, and the per-item compute then serialised.)
template <FloatType TA, FloatType TB, bool kPair, typename Op>
__global__ void __launch_bounds__(kPairThreads)
    DirectKernel(DeviceSource a, DeviceSource b, int64_t blocks, int64_t pairs, Op op) {
  int64_t row, blk;
  if (!WarpPair(blocks, pairs, &row, &blk)) return;
  const int lane = threadIdx.x & 31;
  const int64_t c0 = blk * kVocabBlock;
  LaneBlock<TA> va;
  LoadLaneBlock(a, row, c0, lane, va);
  if constexpr (kPair) {
    LaneBlock<TB> vb;
    LoadLaneBlock(b, row, c0, lane, vb);
    op(a, b, row, blk, lane, va, vb);
  } else {
    op(a, row, blk, lane, va);
  }
}

inline bool GridTooLarge(int64_t rows, int64_t blocks) {
  return rows * blocks > static_cast<int64_t>(INT_MAX);
}

// Rows * blocks warps in CTAs of kPairWarps.
inline unsigned PairGrid(int64_t pairs) {
  return static_cast<unsigned>((pairs + kPairWarps - 1) / kPairWarps);
}

template <FloatType TA, FloatType TB, bool kPair, typename Op>
cudaError_t LaunchItems(const DeviceSource& a, const DeviceSource& b, int64_t blocks, int64_t pairs,
                        const Op& op, cudaStream_t stream) {
  DirectKernel<TA, TB, kPair, Op>
      <<<PairGrid(pairs), kPairThreads, 0, stream>>>(a, b, blocks, pairs, op);
  return cudaSuccess;
}

}  // namespace logitserve::kernels::cuda::detail
