// The per-(row, vocabulary block) kernels: block statistics (single and pair), the JSD partials
// of the second pass, and the target-logit gather.
//
// One warp reads one block of one row exactly once (lane_block.cuh: the layout, the loads and
// why a warp): the values stay in registers between the max and the exp sums, so no per-element
// rescale (a second exp) is ever needed; blocks are combined later with scalar rescales
// (FoldBlock). The arithmetic mirrors kernels/cpu/cpu_kernels.cc operation for operation (same
// clamp, same flags, same cross-term signs); only the summation order inside a block differs (see
// cuda_kernels.h), so CPU and GPU agree to rounding, not bit for bit.
#include <cfloat>
#include <climits>
#include <type_traits>

#include "kernels/cuda/lane_block.cuh"

namespace logitserve::kernels::cuda {
namespace {

using detail::DeviceSource;

constexpr uint32_t kBadInput = kFlagNaN | kFlagPosInf;

// Warp w of CTA x owns (row, block) pair x * kPairWarps + w of the grid's rows * blocks pairs,
// blocks of a row adjacent. Returns false for the grid's spare warps (uniform per warp).
__device__ __forceinline__ bool WarpPair(int64_t blocks, int64_t pairs, int64_t* row,
                                         int64_t* blk) {
  const int64_t p = static_cast<int64_t>(blockIdx.x) * detail::kPairWarps + (threadIdx.x >> 5);
  if (p >= pairs) return false;
  *row = p / blocks;
  *blk = p - *row * blocks;
  return true;
}

__device__ __forceinline__ uint32_t BadFlags(float m) {
  return (m != m ? kFlagNaN : 0u) | (m == detail::PosInfF() ? kFlagPosInf : 0u);
}

// The sums of one distribution's block, centred on its maximum m (finite): s = sum exp(dz),
// w = sum exp(dz) dz with dz = max(z - m, kClampShift). Two accumulators a lane (even / odd e),
// then the butterfly: the fixed order of lane_block.cuh.
template <FloatType T>
__device__ __forceinline__ void WarpBlockSums(const DeviceSource& src,
                                              const detail::LaneBlock<T>& b, float m, float* s_out,
                                              float* w_out) {
  float s[2] = {0.0f, 0.0f}, w[2] = {0.0f, 0.0f};
#pragma unroll
  for (int j = 0; j < detail::kLaneChunks; ++j) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float dz = fmaxf(detail::Z(src, b, j, e) - m, detail::kClampShift);
      const float ex = detail::ExpShift(dz);
      s[e & 1] += ex;
      w[e & 1] = fmaf(ex, dz, w[e & 1]);
    }
  }
  *s_out = detail::WarpSum(s[0] + s[1]);
  *w_out = detail::WarpSum(w[0] + w[1]);
}

// The record of one (row, block) of a single distribution, from the lane's loaded values.
template <FloatType T>
__device__ __forceinline__ void SingleItem(const DeviceSource& a, int64_t row, int64_t blk,
                                           int lane, detail::LaneBlock<T>& va,
                                           PairBlockStats* stats, int64_t stats_ld,
                                           int64_t stats_offset) {
  const int64_t c0 = blk * kVocabBlock;
  detail::TransformInPlace(a, c0, lane, va);
  const float m = detail::WarpMaxNaN(detail::LaneMax(a, va));
  BlockStats out = EmptyBlockStats();
  out.flags = BadFlags(m);
  if (out.flags == 0 && m != detail::NegInfF()) {  // uniform over the warp
    WarpBlockSums(a, va, m, &out.s, &out.w);
    out.m = m;
  }
  if (lane == 0) {
    stats[row * stats_ld + stats_offset + blk] = PairBlockStats{out, EmptyBlockStats(), 0.0f, 0.0f};
  }
}

// The record of one (row, block) of a pair of distributions, from the lanes' loaded values.
template <FloatType TA, FloatType TB>
__device__ __forceinline__ void PairItem(const DeviceSource& a, const DeviceSource& b, int64_t row,
                                         int64_t blk, int lane, detail::LaneBlock<TA>& va,
                                         detail::LaneBlock<TB>& vb, PairBlockStats* stats,
                                         int64_t stats_ld, int64_t stats_offset) {
  const int64_t c0 = blk * kVocabBlock;
  detail::TransformInPlace(a, c0, lane, va);
  detail::TransformInPlace(b, c0, lane, vb);
  const float ma = detail::WarpMaxNaN(detail::LaneMax(a, va));
  const float mb = detail::WarpMaxNaN(detail::LaneMax(b, vb));
  PairBlockStats out{EmptyBlockStats(), EmptyBlockStats(), 0.0f, 0.0f};
  out.a.flags = BadFlags(ma);
  out.b.flags = BadFlags(mb);
  if (((out.a.flags | out.b.flags) & kBadInput) == 0) {  // uniform over the warp
    const float ninf = detail::NegInfF();
    // A fully masked side has m = -inf; shifting by 0 instead keeps its values at -inf (masked).
    const float sha = ma == ninf ? 0.0f : ma;
    const float shb = mb == ninf ? 0.0f : mb;
    // Per side the very sums of WarpBlockSums (same operations, same order): the model side of a
    // pair job has the single job's bits.
    float sa[2] = {0.0f, 0.0f}, wa[2] = {0.0f, 0.0f}, sb[2] = {0.0f, 0.0f}, wb[2] = {0.0f, 0.0f};
    float cab[2] = {0.0f, 0.0f}, cba[2] = {0.0f, 0.0f};
    bool a_only = false, b_only = false;
    // Fast path: no token of the block is masked on either side (every shift finite, so no
    // clamp can matter: a shift below kClampShift has exp = 0 and adds 0 * shift = -0 either way,
    // and every token is live on both sides). The bits equal the general path's.
    const float lo_a = detail::WarpMin(detail::LaneMin(a, va)) - sha;
    const float lo_b = detail::WarpMin(detail::LaneMin(b, vb)) - shb;
    if (lo_a > ninf && lo_b > ninf) {  // uniform over the warp
#pragma unroll
      for (int j = 0; j < detail::kLaneChunks; ++j) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float da = detail::Z(a, va, j, e) - sha;
          const float db = detail::Z(b, vb, j, e) - shb;
          const float ea = detail::ExpShift(da);
          const float eb = detail::ExpShift(db);
          sa[e & 1] += ea;
          wa[e & 1] = fmaf(ea, da, wa[e & 1]);
          sb[e & 1] += eb;
          wb[e & 1] = fmaf(eb, db, wb[e & 1]);
          const float diff = da - db;
          cab[e & 1] = fmaf(ea, diff, cab[e & 1]);
          cba[e & 1] = fmaf(-eb, diff, cba[e & 1]);
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < detail::kLaneChunks; ++j) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float da = detail::Z(a, va, j, e) - sha;
          const float db = detail::Z(b, vb, j, e) - shb;
          const bool live_a = da > ninf;
          const bool live_b = db > ninf;
          a_only |= live_a && !live_b;
          b_only |= live_b && !live_a;
          const float dac = fmaxf(da, detail::kClampShift);
          const float dbc = fmaxf(db, detail::kClampShift);
          const float ea = detail::ExpShift(dac);
          const float eb = detail::ExpShift(dbc);
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
    if (__any_sync(detail::kFullMask, a_only)) out.a.flags |= kFlagASupportsBMasked;
    if (__any_sync(detail::kFullMask, b_only)) out.a.flags |= kFlagBSupportsAMasked;
    if (ma != ninf) {
      out.a.m = ma;
      out.a.s = detail::WarpSum(sa[0] + sa[1]);
      out.a.w = detail::WarpSum(wa[0] + wa[1]);
      out.c_ab = detail::WarpSum(cab[0] + cab[1]);
    }
    if (mb != ninf) {
      out.b.m = mb;
      out.b.s = detail::WarpSum(sb[0] + sb[1]);
      out.b.w = detail::WarpSum(wb[0] + wb[1]);
      out.c_ba = detail::WarpSum(cba[0] + cba[1]);
    }
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
                                             int lane, detail::LaneBlock<TA>& va) const {
    SingleItem(a, row, blk, lane, va, stats, stats_ld, stats_offset);
  }
  template <FloatType TA, FloatType TB>
  __device__ __forceinline__ void operator()(const DeviceSource& a, const DeviceSource& b,
                                             int64_t row, int64_t blk, int lane,
                                             detail::LaneBlock<TA>& va,
                                             detail::LaneBlock<TB>& vb) const {
    PairItem(a, b, row, blk, lane, va, vb, stats, stats_ld, stats_offset);
  }
};

template <FloatType TS, FloatType TT>
__device__ __forceinline__ void JsdItem(const DeviceSource& s, const DeviceSource& t, int64_t row,
                                        int64_t blk, int lane, detail::LaneBlock<TS>& zs,
                                        detail::LaneBlock<TT>& zt, const RowStats* folded_s,
                                        const RowStats* folded_t, float beta, float* partials,
                                        int64_t partials_ld, int64_t partials_offset) {
  const RowStats rs = folded_s[row];
  const RowStats rt = folded_t[row];
  float* out = partials + row * partials_ld + partials_offset + blk;
  if (AllMasked(rs) || AllMasked(rt)) {  // uniform over the warp
    if (lane == 0) *out = 0.0f;
    return;
  }
  const RowNorm ns = NormOf(rs);
  const RowNorm nt = NormOf(rt);
  const int64_t c0 = blk * kVocabBlock;
  detail::TransformInPlace(s, c0, lane, zs);
  detail::TransformInPlace(t, c0, lane, zt);
  const float omb = 1.0f - beta;
  float acc_t[2] = {0.0f, 0.0f}, acc_s[2] = {0.0f, 0.0f};
  // Fast path: no masked token on either side (every log-probability finite), where the clamp
  // changes no bit: below kClampShift, p = 0 with or without it, and 0 times a finite difference
  // adds a zero of the same sign to a sum that starts at +0.
  const float lo_s = (detail::WarpMin(detail::LaneMin(s, zs)) - ns.m) - ns.log_s;
  const float lo_t = (detail::WarpMin(detail::LaneMin(t, zt)) - nt.m) - nt.log_s;
  const float clamp = (lo_s > detail::NegInfF() && lo_t > detail::NegInfF())
                          ? detail::NegInfF()
                          : detail::kClampShift;  // uniform over the warp
#pragma unroll
  for (int j = 0; j < detail::kLaneChunks; ++j) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float lps = fmaxf((detail::Z(s, zs, j, e) - ns.m) - ns.log_s, clamp);  // as LogProb
      const float lpt = fmaxf((detail::Z(t, zt, j, e) - nt.m) - nt.log_s, clamp);
      const float ps = detail::ExpShift(fminf(lps, 0.0f));
      const float pt = detail::ExpShift(fminf(lpt, 0.0f));
      const float mix = fmaxf(fmaf(beta, pt, omb * ps), FLT_MIN);
      const float log_m = logf(mix);
      acc_t[e & 1] = fmaf(pt, lpt - log_m, acc_t[e & 1]);
      acc_s[e & 1] = fmaf(ps, lps - log_m, acc_s[e & 1]);
    }
  }
  const float sum_t = detail::WarpSum(acc_t[0] + acc_t[1]);
  const float sum_s = detail::WarpSum(acc_s[0] + acc_s[1]);
  if (lane == 0) *out = beta * sum_t + omb * sum_s;
}

struct JsdOp {
  const RowStats* folded_s;
  const RowStats* folded_t;
  float beta;
  float* partials;
  int64_t partials_ld;
  int64_t partials_offset;
  template <FloatType TS, FloatType TT>
  __device__ __forceinline__ void operator()(const DeviceSource& s, const DeviceSource& t,
                                             int64_t row, int64_t blk, int lane,
                                             detail::LaneBlock<TS>& zs,
                                             detail::LaneBlock<TT>& zt) const {
    JsdItem(s, t, row, blk, lane, zs, zt, folded_s, folded_t, beta, partials, partials_ld,
            partials_offset);
  }
};

// One warp per (row, block), loading straight from global memory: every warp has its 16-byte loads
// in flight before the first use. (A persistent variant, each warp walking its items with a
// cp.async ring of 3-4 staged blocks in shared memory, measured slower on the H200: bf16 single
// statistics 0.341 ms against 0.290, pairs 1.09 against 0.78 ms; the ring's shared memory cut
// the resident warps to 12 per SM, and the per-item compute then serialised.)
template <FloatType TA, FloatType TB, bool kPair, typename Op>
__global__ void __launch_bounds__(detail::kPairThreads)
    DirectKernel(DeviceSource a, DeviceSource b, int64_t blocks, int64_t pairs, Op op) {
  int64_t row, blk;
  if (!WarpPair(blocks, pairs, &row, &blk)) return;
  const int lane = threadIdx.x & 31;
  const int64_t c0 = blk * kVocabBlock;
  detail::LaneBlock<TA> va;
  detail::LoadLaneBlock(a, row, c0, lane, va);
  if constexpr (kPair) {
    detail::LaneBlock<TB> vb;
    detail::LoadLaneBlock(b, row, c0, lane, vb);
    op(a, b, row, blk, lane, va, vb);
  } else {
    op(a, row, blk, lane, va);
  }
}

__global__ void GatherTargetsKernel(DeviceSource a, int64_t col0, int64_t count, const int32_t* ids,
                                    int32_t ids_per_row, float* targets) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const int64_t c = static_cast<int64_t>(ids[i]) - col0;
  if (c < 0 || c >= a.cols) return;  // another shard's (or ignore_index)
  targets[i] = detail::LoadOne(a, i / ids_per_row, c);
}

bool GridTooLarge(int64_t rows, int64_t blocks) {
  return rows * blocks > static_cast<int64_t>(INT_MAX);
}

// Rows * blocks warps in CTAs of kPairWarps.
unsigned PairGrid(int64_t pairs) {
  return static_cast<unsigned>((pairs + detail::kPairWarps - 1) / detail::kPairWarps);
}

// Head transforms are applied in place, which needs fp32 words (hidden mode's GEMM output is
// fp32); a 16-bit source may carry a temperature only.
bool Supported(const LogitsSource& s) { return s.type == FloatType::kFloat32 || !s.transform.head; }

// Calls f(std::integral_constant<FloatType, T>{}) for the run-time type t.
template <typename F>
void WithType(FloatType t, F&& f) {
  switch (t) {
    case FloatType::kFloat32:
      f(std::integral_constant<FloatType, FloatType::kFloat32>{});
      break;
    case FloatType::kBFloat16:
      f(std::integral_constant<FloatType, FloatType::kBFloat16>{});
      break;
    case FloatType::kFloat16:
      f(std::integral_constant<FloatType, FloatType::kFloat16>{});
      break;
  }
}

template <FloatType TA, FloatType TB, bool kPair, typename Op>
cudaError_t LaunchItems(const DeviceSource& a, const DeviceSource& b, int64_t blocks, int64_t pairs,
                        const Op& op, cudaStream_t stream) {
  DirectKernel<TA, TB, kPair, Op>
      <<<PairGrid(pairs), detail::kPairThreads, 0, stream>>>(a, b, blocks, pairs, op);
  return cudaSuccess;
}

}  // namespace

cudaError_t LaunchBlockStats(const LogitsSource& a, const LogitsSource* b, int64_t rows,
                             PairBlockStats* stats, int64_t stats_ld, int64_t stats_offset,
                             cudaStream_t stream) {
  const int64_t blocks = a.blocks();
  if (rows <= 0 || blocks <= 0) return cudaSuccess;
  if (GridTooLarge(rows, blocks)) return cudaErrorInvalidConfiguration;
  if (b != nullptr && (b->cols != a.cols || b->col0 != a.col0)) {
    return cudaErrorInvalidValue;
  }
  if (!Supported(a) || (b != nullptr && !Supported(*b))) return cudaErrorInvalidValue;
  const int64_t pairs = rows * blocks;
  const DeviceSource da = detail::MakeDeviceSource(a);
  const DeviceSource db = b != nullptr ? detail::MakeDeviceSource(*b) : da;
  const StatsOp op{stats, stats_ld, stats_offset};
  cudaError_t err = cudaSuccess;
  WithType(a.type, [&](auto ta) {
    constexpr FloatType TA = decltype(ta)::value;
    if (b == nullptr) {
      err = LaunchItems<TA, TA, false>(da, db, blocks, pairs, op, stream);
      return;
    }
    WithType(b->type, [&](auto tb) {
      err = LaunchItems<TA, decltype(tb)::value, true>(da, db, blocks, pairs, op, stream);
    });
  });
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

cudaError_t LaunchGatherTargets(const LogitsSource& a, int64_t rows, const int32_t* ids,
                                int32_t ids_per_row, float* targets, cudaStream_t stream) {
  const int64_t count = rows * ids_per_row;
  if (count <= 0 || a.cols <= 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t grid = (count + kThreads - 1) / kThreads;
  if (grid > INT_MAX) return cudaErrorInvalidConfiguration;
  GatherTargetsKernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
      detail::MakeDeviceSource(a), a.col0, count, ids, ids_per_row, targets);
  return cudaGetLastError();
}

cudaError_t LaunchJsdPartials(const LogitsSource& s, const LogitsSource& t, int64_t rows,
                              const RowStats* folded_s, const RowStats* folded_t, float beta,
                              float* partials, int64_t partials_ld, int64_t partials_offset,
                              cudaStream_t stream) {
  const int64_t blocks = s.blocks();
  if (rows <= 0 || blocks <= 0) return cudaSuccess;
  if (GridTooLarge(rows, blocks)) return cudaErrorInvalidConfiguration;
  if (t.cols != s.cols || t.col0 != s.col0) return cudaErrorInvalidValue;
  if (!Supported(s) || !Supported(t)) return cudaErrorInvalidValue;
  const int64_t pairs = rows * blocks;
  const DeviceSource ds = detail::MakeDeviceSource(s);
  const DeviceSource dt = detail::MakeDeviceSource(t);
  const JsdOp op{folded_s, folded_t, beta, partials, partials_ld, partials_offset};
  cudaError_t err = cudaSuccess;
  WithType(s.type, [&](auto ts) {
    WithType(t.type, [&](auto tt) {
      err = LaunchItems<decltype(ts)::value, decltype(tt)::value, true>(ds, dt, blocks, pairs, op,
                                                                        stream);
    });
  });
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

TileMessage MakeTileMessage(int64_t rows, int64_t max_blocks, int32_t top_k, int32_t ids_per_row) {
  auto align = [](size_t x) { return (x + 255) / 256 * 256; };
  TileMessage m;
  m.rows = rows;
  m.max_blocks = max_blocks;
  m.top_k = top_k;
  m.ids_per_row = ids_per_row;
  const size_t r = static_cast<size_t>(rows);
  m.stats_offset = 0;
  m.topk_offset =
      align(m.stats_offset + sizeof(PairBlockStats) * r * static_cast<size_t>(max_blocks));
  m.count_offset = align(m.topk_offset + sizeof(TopKEntry) * r * static_cast<size_t>(top_k));
  m.target_offset = align(m.count_offset + sizeof(int32_t) * r);
  m.bytes = align(m.target_offset + sizeof(float) * r * static_cast<size_t>(ids_per_row));
  return m;
}

cudaError_t CheckKernelImage() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(
      &attr, DirectKernel<FloatType::kFloat32, FloatType::kFloat32, false, StatsOp>);
}

}  // namespace logitserve::kernels::cuda
