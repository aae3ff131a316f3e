// The statistics of one (row, vocabulary block) from a warp's loaded values, shared by the
// statistics kernels and the fused statistics + top-k kernel (private to kernels/cuda). The
// arithmetic mirrors kernels/cpu/cpu_kernels.cc operation for operation (same clamp, same flags,
// same cross-term signs); only the summation order inside a block differs (lane_block.cuh), so
// CPU and GPU agree to rounding, not bit for bit. Every kernel that writes a block record calls
// these functions, so a record has the same bits whichever kernel wrote it.
#pragma once

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "kernels/cuda/lane_block.cuh"
#include "kernels/cuda/sm90.cuh"

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

// ---- The streamed form (fp32 statistics): persistent warps, each with a ring of two blocks -----
//
// Why. A warp of the direct kernel has its loads in flight only until they land, and none during
// the ~640 instructions of its statistics; an fp32 block is 8 KB a warp and its kernel holds 96
// registers, so only 16 warps an SM take turns (Nsight Compute, H200: DRAM 84 %, 1.19x one
// read). Here a warp owns items p, p + step, p + 2 step, ... of the grid's rows * blocks; lane 0
// brings each item's block into the warp's two-stage ring with one bulk copy (cp.async.bulk, no
// registers) and refills a stage as soon as the lanes hold its words, so the next two blocks are
// on their way while the warp computes. The lanes read their words from shared memory in the
// very layout LoadLaneBlock gives (lane_block.cuh), so the op computes the same bits from the
// same registers. The copies carry an L2 evict-first policy (the logits are read once): without
// it the bf16 form was 14 us slower.
//
// Where it runs, measured (H200, [8192 x 75968], kernels alone, one call): fp32 single statistics
// 0.659 -> 0.584 ms. Everything else stays direct: 16-bit single statistics 0.291 -> 0.311 (three
// and four stages 0.320 / 0.344: the 16-bit items are near issue-bound, and the ring's shared
// memory cuts the resident warps), pairs 0.591 -> 0.809 (bf16) and 1.311 -> 1.691 (fp32; 168
// registers), and the top-k statistics, whose Score lost beside the selection kernels (fp32 top-k
// 64 0.866 -> 0.882 ms) although the kernel alone gained. Hidden mode's fp32 tiles (sources with
// a head transform) stay direct too: the streamed form was not measured there.
inline constexpr int kRingStages = 2;
inline constexpr uint32_t kRingBlockBytes = kVocabBlock * sizeof(float);
inline constexpr size_t kRingSmem =
    size_t{kPairWarps} * kRingStages * (kRingBlockBytes + sizeof(uint64_t));

template <typename Op>
inline constexpr bool kStreamedOp = std::is_same_v<Op, StatsOp>;

// The bytes of the block at column c0 that its bulk copy brings: the columns left, in whole
// 16-byte units (a partial block's last few values, if any, are read from global memory).
__device__ __forceinline__ uint32_t RingCopyBytes(const DeviceSource& s, int64_t c0) {
  const int64_t n = s.cols - c0 < kVocabBlock ? s.cols - c0 : kVocabBlock;
  return static_cast<uint32_t>(n * static_cast<int64_t>(sizeof(float))) & ~15u;
}

// LoadLaneBlock's words of an fp32 block staged at `stage` (`copied` bytes of it).
__device__ __forceinline__ void FillLaneBlock(const DeviceSource& s, const uint8_t* stage,
                                              uint32_t copied, int64_t row, int64_t c0, int lane,
                                              LaneBlock<FloatType::kFloat32>& b) {
  if (c0 + kVocabBlock <= s.cols) {  // a full block, all of it staged (uniform over the warp)
#pragma unroll
    for (int j = 0; j < kLaneChunks; ++j) {
      const uint4* p = reinterpret_cast<const uint4*>(stage) + (j * 256 + lane * 8) / 4;
      const uint4 x0 = p[0], x1 = p[1];
      b.w[j][0] = x0.x, b.w[j][1] = x0.y, b.w[j][2] = x0.z, b.w[j][3] = x0.w;
      b.w[j][4] = x1.x, b.w[j][5] = x1.y, b.w[j][6] = x1.z, b.w[j][7] = x1.w;
    }
    return;
  }
  // The row's last block: staged values, then global memory, then -inf past the columns.
  const int64_t left = s.cols - (c0 + lane * 8);
  const int64_t base = row * s.ld + c0 + lane * 8;
  const auto* staged = reinterpret_cast<const uint32_t*>(stage);
#pragma unroll
  for (int j = 0; j < kLaneChunks; ++j) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int off = j * 256 + e;
      const int at = j * 256 + lane * 8 + e;  // the value's index in the block
      uint32_t bits = NegInfBits<FloatType::kFloat32>();
      if (off < left) {
        bits = static_cast<uint32_t>(at) * 4 < copied ? staged[at]
                                                      : RawBits<FloatType::kFloat32>(s, base + off);
      }
      b.w[j][e] = bits;
    }
  }
}

template <typename Op>
__global__ void __launch_bounds__(kPairThreads)
    RingKernel(DeviceSource a, int64_t blocks, int64_t pairs, Op op) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr FloatType T = FloatType::kFloat32;
  extern __shared__ __align__(128) uint8_t ring_smem[];
  const int warp = static_cast<int>(threadIdx.x >> 5);
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int64_t step = static_cast<int64_t>(gridDim.x) * kPairWarps;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kPairWarps + warp;
  if (first >= pairs) return;  // uniform per warp; the warps share nothing
  uint8_t* ring = ring_smem + warp * (kRingStages * kRingBlockBytes);
  uint64_t* bar =
      reinterpret_cast<uint64_t*>(ring_smem + kPairWarps * kRingStages * kRingBlockBytes) +
      warp * kRingStages;
  const uint64_t policy = sm90::EvictFirstPolicy();
  // Lane 0 stages item p in stage st: one barrier phase.
  auto issue = [&](int64_t p, int st) {
    const int64_t row = p / blocks;
    const int64_t c0 = (p - row * blocks) * kVocabBlock;
    const uint32_t n = RingCopyBytes(a, c0);
    sm90::ArriveExpectTx(&bar[st], n);
    const float* src = static_cast<const float*>(a.data) + row * a.ld + c0;
    if (n > 0) sm90::BulkLoad(ring + st * kRingBlockBytes, src, n, &bar[st], policy);
  };
  if (lane == 0) {
#pragma unroll
    for (int st = 0; st < kRingStages; ++st) sm90::BarrierInit(&bar[st], 1);
    sm90::FenceBarrierInit();
#pragma unroll
    for (int st = 0; st < kRingStages; ++st) {
      if (first + st * step < pairs) issue(first + st * step, st);
    }
  }
  __syncwarp();
  uint32_t parity = 0;  // bit st: the parity of stage st's phase to wait for
  int st = 0;
  for (int64_t p = first; p < pairs; p += step) {
    const int64_t row = p / blocks;
    const int64_t blk = p - row * blocks;
    const int64_t c0 = blk * kVocabBlock;
    sm90::Wait(&bar[st], (parity >> st) & 1u);
    parity ^= 1u << st;
    LaneBlock<T> va;
    FillLaneBlock(a, ring + st * kRingBlockBytes, RingCopyBytes(a, c0), row, c0, lane, va);
    // The stage's words are the lanes' now: the warp barrier orders every lane's reads before
    // lane 0's next instructions, and the proxy fence those before its bulk copy (the async
    // proxy) that overwrites the stage.
    __syncwarp();
    if (lane == 0 && p + kRingStages * step < pairs) {
      sm90::FenceProxyAsync();
      issue(p + kRingStages * step, st);
    }
    op(a, row, blk, lane, va);
    st ^= 1;
  }
#endif
}

// Whether the streamed form may run (LOGITSERVE_ITEM_KERNEL=direct: never, for measurements side
// by side); it also needs rows 16-byte aligned (bulk copies), a logits-mode source and an sm_90
// device.
inline bool RingAllowed() {
  static const bool allowed = [] {
    const char* v = std::getenv("LOGITSERVE_ITEM_KERNEL");
    return v == nullptr || std::strcmp(v, "direct") != 0;
  }();
  return allowed;
}

// The persistent grid of RingKernel<Op> on the current device: as many CTAs as fit on every SM
// at once (0: none fits, or no sm_90). Computed once per device (the function attribute that
// allows more than 48 KB of dynamic shared memory is set then).
template <typename Op>
int RingGrid() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> grids[kMaxDevices];  // 0: unknown; -1: none
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) return 0;
  int grid = grids[device].load(std::memory_order_relaxed);
  if (grid == 0) {
    int major = 0, sms = 0, per_sm = 0;
    grid = -1;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
        major >= 9 &&
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess &&
        cudaFuncSetAttribute(RingKernel<Op>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(kRingSmem)) == cudaSuccess &&
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, RingKernel<Op>, kPairThreads,
                                                      kRingSmem) == cudaSuccess &&
        per_sm > 0) {
      grid = per_sm * sms;
    }
    if (grid < 0) (void)cudaGetLastError();  // a failed query leaves the direct kernel
    grids[device].store(grid, std::memory_order_relaxed);
  }
  return grid > 0 ? grid : 0;
}

template <FloatType TA, FloatType TB, bool kPair, typename Op>
cudaError_t LaunchItems(const DeviceSource& a, const DeviceSource& b, int64_t blocks, int64_t pairs,
                        const Op& op, cudaStream_t stream) {
  if constexpr (!kPair && TA == FloatType::kFloat32 && kStreamedOp<Op>) {
    if (RingAllowed() && a.vectorized && !a.t.head) {
      if (const int grid = RingGrid<Op>(); grid > 0) {
        const int64_t needed = static_cast<int64_t>(PairGrid(pairs));
        RingKernel<Op><<<static_cast<unsigned>(needed < grid ? needed : grid), kPairThreads,
                         kRingSmem, stream>>>(a, blocks, pairs, op);
        return cudaSuccess;
      }
    }
  }
  DirectKernel<TA, TB, kPair, Op>
      <<<PairGrid(pairs), kPairThreads, 0, stream>>>(a, b, blocks, pairs, op);
  return cudaSuccess;
}

}  // namespace logitserve::kernels::cuda::detail
