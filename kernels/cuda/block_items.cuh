// The statistics of one (row, vocabulary block) from a warp's loaded values, shared by the
// statistics kernels and the fused statistics + top-k kernel (private to kernels/cuda). The
// arithmetic mirrors kernels/cpu/cpu_kernels.cc operation for operation (same clamp, same flags,
// same cross-term signs); only the summation order inside a block differs (lane_block.cuh), so
// CPU and GPU agree to rounding, not bit for bit. Every kernel that writes a block record calls
// these functions, so a record has the same bits whichever kernel wrote it.
#pragma once

#include <cstdlib>
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
struct SingleSums {
  float s[2] = {0.0f, 0.0f}, w[2] = {0.0f, 0.0f};
  // The lane's values of chunks [j0, j0 + kChunks) of its share, in order.
  template <FloatType T, int kChunks>
  __device__ __forceinline__ void Add(const DeviceSource& src, const LaneBlock<T, kChunks>& b,
                                      float m) {
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float dz = fmaxf(Z(src, b, j, e) - m, kClampShift);
        const float ex = ExpShift(dz);
        s[e & 1] += ex;
        w[e & 1] = fmaf(ex, dz, w[e & 1]);
      }
    }
  }
  __device__ __forceinline__ void Finish(float* s_out, float* w_out) const {
    *s_out = WarpSum(s[0] + s[1]);
    *w_out = WarpSum(w[0] + w[1]);
  }
};

template <FloatType T>
__device__ __forceinline__ void WarpBlockSums(const DeviceSource& src, const LaneBlock<T>& b,
                                              float m, float* s_out, float* w_out) {
  SingleSums sums;
  sums.Add(src, b, m);
  sums.Finish(s_out, w_out);
}

// The record of one (row, block) of a single distribution, from the lane's loaded values.
template <FloatType T>
__device__ __forceinline__ void SingleItem(const DeviceSource& a, int64_t row, int64_t blk,
                                           int lane, LaneBlock<T>& va, PairBlockStats* stats,
                                           int64_t stats_ld, int64_t stats_offset) {
  const int64_t c0 = blk * kVocabBlock;
  TransformInPlace(a, c0, lane, va);
  const float m = WarpMaxNaN(LaneMax(a, va));
  BlockStats out = EmptyBlockStats();
  out.flags = BadFlags(m);
  if (out.flags == 0 && m != NegInfF()) {  // uniform over the warp
    WarpBlockSums(a, va, m, &out.s, &out.w);
    out.m = m;
  }
  if (lane == 0) {
    stats[row * stats_ld + stats_offset + blk] = PairBlockStats{out, EmptyBlockStats(), 0.0f, 0.0f};
  }
}

// The running sums of a pair block, value pair by value pair in the fixed order (lane_block.cuh),
// for the register kernels and the streamed ones alike. kMasked: some token of the block is masked
// on a side, so shifts are clamped and support is tested. Without one (every shift finite), no
// clamp can matter: a shift below kClampShift has exp = 0 and adds 0 * shift = -0 either way, and
// every token is live on both sides, so both forms give the same bits.
struct PairSums {
  float sa[2] = {0.0f, 0.0f}, wa[2] = {0.0f, 0.0f}, sb[2] = {0.0f, 0.0f}, wb[2] = {0.0f, 0.0f};
  float cab[2] = {0.0f, 0.0f}, cba[2] = {0.0f, 0.0f};
  bool a_only = false, b_only = false;

  // The lane's values of chunks [j0, j0 + kChunks) of both shares, in order; sha / shb the shifts.
  template <bool kMasked, FloatType TA, FloatType TB, int kChunks>
  __device__ __forceinline__ void Add(const DeviceSource& a, const DeviceSource& b,
                                      const LaneBlock<TA, kChunks>& va,
                                      const LaneBlock<TB, kChunks>& vb, float sha, float shb) {
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float da = Z(a, va, j, e) - sha;
        const float db = Z(b, vb, j, e) - shb;
        if constexpr (!kMasked) {
          const float ea = ExpShift(da);
          const float eb = ExpShift(db);
          sa[e & 1] += ea;
          wa[e & 1] = fmaf(ea, da, wa[e & 1]);
          sb[e & 1] += eb;
          wb[e & 1] = fmaf(eb, db, wb[e & 1]);
          const float diff = da - db;
          cab[e & 1] = fmaf(ea, diff, cab[e & 1]);
          cba[e & 1] = fmaf(-eb, diff, cba[e & 1]);
        } else {
          const float ninf = NegInfF();
          const bool live_a = da > ninf;
          const bool live_b = db > ninf;
          a_only |= live_a && !live_b;
          b_only |= live_b && !live_a;
          const float dac = fmaxf(da, kClampShift);
          const float dbc = fmaxf(db, kClampShift);
          const float ea = ExpShift(dac);
          const float eb = ExpShift(dbc);
          sa[e & 1] += ea;
          wa[e & 1] = fmaf(ea, dac, wa[e & 1]);
          sb[e & 1] += eb;
          wb[e & 1] = fmaf(eb, dbc, wb[e & 1]);
          // Cross terms over tokens both sides support, with the unclamped shifts: a deep but
          // finite logit (b - m_b = -300) is underflow, not masking, and its KL term grows with
          // it. A token only one side supports raised a mismatch flag, which overrides that
          // direction with +inf.
          const float diff = (live_a && live_b) ? da - db : 0.0f;
          cab[e & 1] = fmaf(ea, diff, cab[e & 1]);
          cba[e & 1] = fmaf(-eb, diff, cba[e & 1]);
        }
      }
    }
  }

  // The warp's record from every lane's sums (ma / mb the block maxima, bad input already ruled
  // out).
  __device__ __forceinline__ void Finish(float ma, float mb, PairBlockStats* out) const {
    const float ninf = NegInfF();
    if (__any_sync(kFullMask, a_only)) out->a.flags |= kFlagASupportsBMasked;
    if (__any_sync(kFullMask, b_only)) out->a.flags |= kFlagBSupportsAMasked;
    if (ma != ninf) {
      out->a.m = ma;
      out->a.s = WarpSum(sa[0] + sa[1]);
      out->a.w = WarpSum(wa[0] + wa[1]);
      out->c_ab = WarpSum(cab[0] + cab[1]);
    }
    if (mb != ninf) {
      out->b.m = mb;
      out->b.s = WarpSum(sb[0] + sb[1]);
      out->b.w = WarpSum(wb[0] + wb[1]);
      out->c_ba = WarpSum(cba[0] + cba[1]);
    }
  }
};

// The record of one (row, block) of a pair of distributions, from the lanes' loaded values.
template <FloatType TA, FloatType TB>
__device__ __forceinline__ void PairItem(const DeviceSource& a, const DeviceSource& b, int64_t row,
                                         int64_t blk, int lane, LaneBlock<TA>& va,
                                         LaneBlock<TB>& vb, PairBlockStats* stats, int64_t stats_ld,
                                         int64_t stats_offset) {
  const int64_t c0 = blk * kVocabBlock;
  TransformInPlace(a, c0, lane, va);
  TransformInPlace(b, c0, lane, vb);
  const float ma = WarpMaxNaN(LaneMax(a, va));
  const float mb = WarpMaxNaN(LaneMax(b, vb));
  PairBlockStats out{EmptyBlockStats(), EmptyBlockStats(), 0.0f, 0.0f};
  out.a.flags = BadFlags(ma);
  out.b.flags = BadFlags(mb);
  if (((out.a.flags | out.b.flags) & kBadInput) == 0) {  // uniform over the warp
    const float ninf = NegInfF();
    // A fully masked side has m = -inf; shifting by 0 instead keeps its values at -inf (masked).
    const float sha = ma == ninf ? 0.0f : ma;
    const float shb = mb == ninf ? 0.0f : mb;
    // Per side the very sums of WarpBlockSums (same operations, same order): the model side of a
    // pair job has the single job's bits.
    PairSums sums;
    // Fast path: no token of the block is masked on either side (PairSums says why the bits are
    // the general path's).
    const float lo_a = WarpMin(LaneMin(a, va)) - sha;
    const float lo_b = WarpMin(LaneMin(b, vb)) - shb;
    if (lo_a > ninf && lo_b > ninf) {  // uniform over the warp
      sums.Add<false>(a, b, va, vb, sha, shb);
    } else {
      sums.Add<true>(a, b, va, vb, sha, shb);
    }
    sums.Finish(ma, mb, &out);
  }
  if (lane == 0) stats[row * stats_ld + stats_offset + blk] = out;
}

// ---- Streamed items: a share in pieces, read twice ----------------------------------------------
//
// The register kernels hold a lane's whole share: an fp32 pair 2 x 64 words, 168 registers, 16 %
// occupancy; in hidden mode (512 x 8192 fp32 tiles fresh from the GEMM) a tile's 2048 warps took
// 1.29 waves (Nsight Compute, H200: 29 us a tile). The streamed items read the share
// kStreamChunks chunks at a time, twice: once for the maxima and minima, once for the sums; the
// second read finds the lines in L2 (the warp read them microseconds before). Every value goes
// through the same operations in the same order as in the register kernels (the extremes continue
// RawExtreme's chain, SingleSums / PairSums add chunk after chunk), so the records have the same
// bits.
inline constexpr int kStreamChunks = 2;
static_assert(kLaneChunks % kStreamChunks == 0, "pieces tile a share");

// Calls f(piece, j0) for the share's pieces in order: piece = chunks [j0, j0 + kStreamChunks) of
// lane `lane`'s share of the block at c0, loaded and transformed.
template <FloatType T, typename F>
__device__ __forceinline__ void ForPieces(const DeviceSource& s, int64_t row, int64_t c0, int lane,
                                          F&& f) {
#pragma unroll
  for (int j0 = 0; j0 < kLaneChunks; j0 += kStreamChunks) {
    const int64_t c = c0 + j0 * 256;
    LaneBlock<T, kStreamChunks> piece;
    LoadLaneBlock(s, row, c, lane, piece);
    TransformInPlace(s, c, lane, piece);
    f(piece, j0);
  }
}

// The lane's LaneMax and LaneMin of a share, read in pieces (their bits).
template <FloatType T>
__device__ __forceinline__ void StreamedExtremes(const DeviceSource& s, int64_t row, int64_t c0,
                                                 int lane, float* hi, float* lo) {
  using Piece = LaneBlock<T, kStreamChunks>;
  typename Piece::Chain x{}, n{};
  ForPieces<T>(s, row, c0, lane, [&](const Piece& piece, int j0) {
    if (j0 == 0) x = n = piece.ChainStart();
    x = piece.template ChainFrom<true>(x);
    n = piece.template ChainFrom<false>(n);
  });
  *hi = Tempered<T>(s, Piece::template ChainEnd<true>(x));
  *lo = Tempered<T>(s, Piece::template ChainEnd<false>(n));
}

// SingleItem's record, streamed.
template <FloatType T>
__device__ __forceinline__ void StreamedSingleItem(const DeviceSource& a, int64_t row, int64_t blk,
                                                   int lane, PairBlockStats* stats,
                                                   int64_t stats_ld, int64_t stats_offset) {
  const int64_t c0 = blk * kVocabBlock;
  float hi, lo;
  StreamedExtremes<T>(a, row, c0, lane, &hi, &lo);
  const float m = WarpMaxNaN(hi);
  BlockStats out = EmptyBlockStats();
  out.flags = BadFlags(m);
  if (out.flags == 0 && m != NegInfF()) {  // uniform over the warp
    SingleSums sums;
    ForPieces<T>(a, row, c0, lane, [&](const auto& piece, int) { sums.Add(a, piece, m); });
    sums.Finish(&out.s, &out.w);
    out.m = m;
  }
  if (lane == 0) {
    stats[row * stats_ld + stats_offset + blk] = PairBlockStats{out, EmptyBlockStats(), 0.0f, 0.0f};
  }
}

// PairItem's record, streamed.
template <FloatType TA, FloatType TB>
__device__ __forceinline__ void StreamedPairItem(const DeviceSource& a, const DeviceSource& b,
                                                 int64_t row, int64_t blk, int lane,
                                                 PairBlockStats* stats, int64_t stats_ld,
                                                 int64_t stats_offset) {
  const int64_t c0 = blk * kVocabBlock;
  float hi_a, lo_a, hi_b, lo_b;
  StreamedExtremes<TA>(a, row, c0, lane, &hi_a, &lo_a);
  StreamedExtremes<TB>(b, row, c0, lane, &hi_b, &lo_b);
  const float ma = WarpMaxNaN(hi_a);
  const float mb = WarpMaxNaN(hi_b);
  PairBlockStats out{EmptyBlockStats(), EmptyBlockStats(), 0.0f, 0.0f};
  out.a.flags = BadFlags(ma);
  out.b.flags = BadFlags(mb);
  if (((out.a.flags | out.b.flags) & kBadInput) == 0) {  // uniform over the warp
    const float ninf = NegInfF();
    const float sha = ma == ninf ? 0.0f : ma;
    const float shb = mb == ninf ? 0.0f : mb;
    const bool masked = !(WarpMin(lo_a) - sha > ninf && WarpMin(lo_b) - shb > ninf);
    PairSums sums;
    auto pass = [&](auto kind) {
      constexpr bool kMasked = decltype(kind)::value;
#pragma unroll
      for (int j0 = 0; j0 < kLaneChunks; j0 += kStreamChunks) {
        const int64_t c = c0 + j0 * 256;
        LaneBlock<TA, kStreamChunks> pa;
        LaneBlock<TB, kStreamChunks> pb;
        LoadLaneBlock(a, row, c, lane, pa);
        LoadLaneBlock(b, row, c, lane, pb);
        TransformInPlace(a, c, lane, pa);
        TransformInPlace(b, c, lane, pb);
        sums.Add<kMasked>(a, b, pa, pb, sha, shb);
      }
    };
    if (masked) {  // uniform over the warp
      pass(std::true_type{});
    } else {
      pass(std::false_type{});
    }
    sums.Finish(ma, mb, &out);
  }
  if (lane == 0) stats[row * stats_ld + stats_offset + blk] = out;
}

// What a (row, block) kernel computes per item, given the lanes' loaded values.
struct StatsOp {
  PairBlockStats* stats;
  int64_t stats_ld;
  int64_t stats_offset;
  template <FloatType TA>
  __device__ __forceinline__ void operator()(const DeviceSource& a, int64_t row, int64_t blk,
                                             int lane, LaneBlock<TA>& va) const {
    SingleItem(a, row, blk, lane, va, stats, stats_ld, stats_offset);
  }
  template <FloatType TA, FloatType TB>
  __device__ __forceinline__ void operator()(const DeviceSource& a, const DeviceSource& b,
                                             int64_t row, int64_t blk, int lane, LaneBlock<TA>& va,
                                             LaneBlock<TB>& vb) const {
    PairItem(a, b, row, blk, lane, va, vb, stats, stats_ld, stats_offset);
  }
  // The streamed forms (fp32 only), which load their own values.
  static constexpr bool kStreams = true;
  template <FloatType TA>
  __device__ __forceinline__ void Streamed(const DeviceSource& a, int64_t row, int64_t blk,
                                           int lane) const {
    StreamedSingleItem<TA>(a, row, blk, lane, stats, stats_ld, stats_offset);
  }
  template <FloatType TA, FloatType TB>
  __device__ __forceinline__ void Streamed(const DeviceSource& a, const DeviceSource& b,
                                           int64_t row, int64_t blk, int lane) const {
    StreamedPairItem<TA, TB>(a, b, row, blk, lane, stats, stats_ld, stats_offset);
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

// A warp per (row, block) whose op loads its own values (Op::Streamed), at least kCtas CTAs of
// kPairWarps warps an SM.
template <FloatType TA, FloatType TB, bool kPair, int kCtas, typename Op>
__global__ void __launch_bounds__(kPairThreads, kCtas)
    StreamedKernel(DeviceSource a, DeviceSource b, int64_t blocks, int64_t pairs, Op op) {
  int64_t row, blk;
  if (!WarpPair(blocks, pairs, &row, &blk)) return;
  const int lane = threadIdx.x & 31;
  if constexpr (kPair) {
    op.template Streamed<TA, TB>(a, b, row, blk, lane);
  } else {
    op.template Streamed<TA>(a, row, blk, lane);
  }
}

template <typename Op, typename = void>
struct HasStreamed : std::false_type {};
template <typename Op>
struct HasStreamed<Op, std::void_t<decltype(Op::kStreams)>> : std::true_type {};

// Which sources take the streamed kernels: LOGITSERVE_STREAMED (read once), bits 1 fp32 pairs,
// 2 fp32 singles, 4 same-type 16-bit pairs; default 0 (none). An A/B switch until the streamed
// kernels are measured on the GPU machine (docs/PERFORMANCE.md, "Streamed statistics"); the
// records' bits do not depend on it (block_items.cuh, streamed items).
int StreamedMode();
// 5 CTAs of 4 warps an SM: <= 102 registers, which ptxas meets without spills for every
// instantiation (6 spilled for fp32 pairs).
inline constexpr int kStreamedCtas = 5;

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
  // Streamed forms for fp32 sources and same-type 16-bit pairs only (each instantiation adds
  // ~40 KB of code to every binary that links the kernels).
  constexpr bool kF32 = TA == FloatType::kFloat32 && (!kPair || TB == FloatType::kFloat32);
  constexpr bool kSame16 = kPair && TA == TB && TA != FloatType::kFloat32;
  if constexpr (HasStreamed<Op>::value && (kF32 || kSame16)) {
    if (StreamedMode() & (kF32 ? (kPair ? 1 : 2) : 4)) {
      StreamedKernel<TA, TB, kPair, kStreamedCtas, Op>
          <<<PairGrid(pairs), kPairThreads, 0, stream>>>(a, b, blocks, pairs, op);
      return cudaSuccess;
    }
  }
  DirectKernel<TA, TB, kPair, Op>
      <<<PairGrid(pairs), kPairThreads, 0, stream>>>(a, b, blocks, pairs, op);
  return cudaSuccess;
}

}  // namespace logitserve::kernels::cuda::detail
