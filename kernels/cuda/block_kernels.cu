// The per-(row, vocabulary block) kernels: block statistics (single and pair), the JSD partials
// of the second pass, and the target-logit gather.
//
// One CTA reads one block of one row exactly once: the values stay in registers between the max
// and the exp sums, so no per-element rescale (a second exp) is ever needed; blocks are combined
// later with scalar rescales (FoldBlock). The arithmetic mirrors kernels/cpu/cpu_kernels.cc
// operation for operation (same clamp, same flags, same cross-term signs); only the summation order
// inside a block differs (see cuda_kernels.h), so CPU and GPU agree to rounding, not bit for bit.
#include <cfloat>
#include <climits>

#include "kernels/cuda/device_common.cuh"

namespace logitserve::kernels::cuda {
namespace {

using detail::DeviceSource;

constexpr uint32_t kBadInput = kFlagNaN | kFlagPosInf;

__device__ __forceinline__ void BlockOf(int64_t blocks, int64_t* row, int64_t* blk) {
  *row = static_cast<int64_t>(blockIdx.x) / blocks;
  *blk = static_cast<int64_t>(blockIdx.x) % blocks;
}

// Max and the NaN / +inf flags of the CTA's block, reduced over the CTA.
__device__ __forceinline__ bool AnyNaN(const float (&v)[8]) {
  bool nan = false;
#pragma unroll
  for (int k = 0; k < 8; ++k) nan |= (v[k] != v[k]);
  return nan;
}
__device__ __forceinline__ float Max8(const float (&v)[8]) {
  float m = detail::NegInfF();
#pragma unroll
  for (int k = 0; k < 8; ++k) m = fmaxf(m, v[k]);
  return m;
}

__global__ void __launch_bounds__(kBlockThreads)
    SingleStatsKernel(DeviceSource a, int64_t blocks, PairBlockStats* stats, int64_t stats_ld,
                      int64_t stats_offset) {
  __shared__ float red_max[detail::kWarps];
  __shared__ float red_sum[2 * detail::kWarps];
  int64_t row, blk;
  BlockOf(blocks, &row, &blk);
  float v[8];
  detail::Load8(a, row, blk * kVocabBlock + threadIdx.x * kElemsPerThread, v);
  float m[1] = {Max8(v)};
  detail::BlockMaxes<1>(m, red_max);
  const bool nan = __syncthreads_or(AnyNaN(v)) != 0;
  BlockStats out = EmptyBlockStats();
  out.flags = (nan ? kFlagNaN : 0u) | (m[0] == detail::PosInfF() ? kFlagPosInf : 0u);
  if (out.flags == 0 && m[0] != detail::NegInfF()) {  // uniform over the CTA
    float sw[2] = {0.0f, 0.0f};
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float dz = fmaxf(v[k] - m[0], detail::kClampShift);  // <= 0; masked -> -200
      const float e = detail::ExpNonPositive(dz);
      sw[0] += e;
      sw[1] = fmaf(e, dz, sw[1]);
    }
    detail::BlockSums<2>(sw, red_sum);
    out.m = m[0];
    out.s = sw[0];
    out.w = sw[1];
  }
  if (threadIdx.x == 0) {
    stats[row * stats_ld + stats_offset + blk] = PairBlockStats{out, EmptyBlockStats(), 0.0f, 0.0f};
  }
}

__global__ void __launch_bounds__(kBlockThreads)
    PairStatsKernel(DeviceSource a, DeviceSource b, int64_t blocks, PairBlockStats* stats,
                    int64_t stats_ld, int64_t stats_offset) {
  __shared__ float red_max[2 * detail::kWarps];
  __shared__ float red_sum[6 * detail::kWarps];
  int64_t row, blk;
  BlockOf(blocks, &row, &blk);
  const int64_t c = blk * kVocabBlock + threadIdx.x * kElemsPerThread;
  float va[8], vb[8];
  detail::Load8(a, row, c, va);
  detail::Load8(b, row, c, vb);
  float m[2] = {Max8(va), Max8(vb)};
  detail::BlockMaxes<2>(m, red_max);
  const bool nan_a = __syncthreads_or(AnyNaN(va)) != 0;
  const bool nan_b = __syncthreads_or(AnyNaN(vb)) != 0;
  PairBlockStats out{EmptyBlockStats(), EmptyBlockStats(), 0.0f, 0.0f};
  out.a.flags = (nan_a ? kFlagNaN : 0u) | (m[0] == detail::PosInfF() ? kFlagPosInf : 0u);
  out.b.flags = (nan_b ? kFlagNaN : 0u) | (m[1] == detail::PosInfF() ? kFlagPosInf : 0u);
  if (((out.a.flags | out.b.flags) & kBadInput) == 0) {  // uniform over the CTA
    const float ninf = detail::NegInfF();
    // A fully masked side has m = -inf; shifting by 0 instead keeps its values at -inf (masked).
    const float sha = m[0] == ninf ? 0.0f : m[0];
    const float shb = m[1] == ninf ? 0.0f : m[1];
    // sums: s_a, w_a, s_b, w_b, c_ab, c_ba
    float acc[6] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    bool a_only = false, b_only = false;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float da = va[k] - sha;
      const float db = vb[k] - shb;
      const bool live_a = da > ninf;
      const bool live_b = db > ninf;
      a_only |= live_a && !live_b;
      b_only |= live_b && !live_a;
      const float dac = fmaxf(da, detail::kClampShift);
      const float dbc = fmaxf(db, detail::kClampShift);
      const float ea = detail::ExpNonPositive(dac);
      const float eb = detail::ExpNonPositive(dbc);
      acc[0] += ea;
      acc[1] = fmaf(ea, dac, acc[1]);
      acc[2] += eb;
      acc[3] = fmaf(eb, dbc, acc[3]);
      // Cross terms over tokens both sides support, with the unclamped shifts: a deep but finite
      // logit (b - m_b = -300) is underflow, not masking, and its KL term grows with it. A token
      // only one side supports raised a mismatch flag, which overrides that direction with +inf.
      const float diff = (live_a && live_b) ? da - db : 0.0f;
      acc[4] = fmaf(ea, diff, acc[4]);
      acc[5] = fmaf(-eb, diff, acc[5]);
    }
    detail::BlockSums<6>(acc, red_sum);
    if (__syncthreads_or(a_only)) out.a.flags |= kFlagASupportsBMasked;
    if (__syncthreads_or(b_only)) out.a.flags |= kFlagBSupportsAMasked;
    if (m[0] != ninf) {
      out.a.m = m[0];
      out.a.s = acc[0];
      out.a.w = acc[1];
      out.c_ab = acc[4];
    }
    if (m[1] != ninf) {
      out.b.m = m[1];
      out.b.s = acc[2];
      out.b.w = acc[3];
      out.c_ba = acc[5];
    }
  }
  if (threadIdx.x == 0) stats[row * stats_ld + stats_offset + blk] = out;
}

// The CPU's CpuJsdBlock: the mixture in linear space, m = beta p_t + (1 - beta) p_s floored at
// FLT_MIN, two exps and one log per token; masked tokens have p = exp(-200 clamp) = 0, so every
// product is finite times finite.
__global__ void __launch_bounds__(kBlockThreads)
    JsdPartialKernel(DeviceSource s, DeviceSource t, int64_t blocks, const RowStats* folded_s,
                     const RowStats* folded_t, float beta, float* partials, int64_t partials_ld,
                     int64_t partials_offset) {
  __shared__ float red_sum[2 * detail::kWarps];
  int64_t row, blk;
  BlockOf(blocks, &row, &blk);
  const RowStats rs = folded_s[row];
  const RowStats rt = folded_t[row];
  float* out = partials + row * partials_ld + partials_offset + blk;
  if (AllMasked(rs) || AllMasked(rt)) {  // uniform over the CTA
    if (threadIdx.x == 0) *out = 0.0f;
    return;
  }
  const RowNorm ns = NormOf(rs);
  const RowNorm nt = NormOf(rt);
  const int64_t c = blk * kVocabBlock + threadIdx.x * kElemsPerThread;
  float zs[8], zt[8];
  detail::Load8(s, row, c, zs);
  detail::Load8(t, row, c, zt);
  const float omb = 1.0f - beta;
  float acc[2] = {0.0f, 0.0f};  // teacher, student
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float lps = fmaxf((zs[k] - ns.m) - ns.log_s, detail::kClampShift);  // as in LogProb
    const float lpt = fmaxf((zt[k] - nt.m) - nt.log_s, detail::kClampShift);
    const float ps = detail::ExpNonPositive(fminf(lps, 0.0f));
    const float pt = detail::ExpNonPositive(fminf(lpt, 0.0f));
    const float mix = fmaxf(fmaf(beta, pt, omb * ps), FLT_MIN);
    const float log_m = logf(mix);
    acc[0] = fmaf(pt, lpt - log_m, acc[0]);
    acc[1] = fmaf(ps, lps - log_m, acc[1]);
  }
  detail::BlockSums<2>(acc, red_sum);
  if (threadIdx.x == 0) *out = beta * acc[0] + omb * acc[1];
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

}  // namespace

cudaError_t LaunchBlockStats(const LogitsSource& a, const LogitsSource* b, int64_t rows,
                             PairBlockStats* stats, int64_t stats_ld, int64_t stats_offset,
                             cudaStream_t stream) {
  const int64_t blocks = a.blocks();
  if (rows <= 0 || blocks <= 0) return cudaSuccess;
  if (GridTooLarge(rows, blocks)) return cudaErrorInvalidConfiguration;
  if (b != nullptr && (b->cols != a.cols || b->col0 != a.col0)) return cudaErrorInvalidValue;
  const unsigned grid = detail::GridFor(rows, blocks);
  if (b == nullptr) {
    SingleStatsKernel<<<grid, kBlockThreads, 0, stream>>>(detail::MakeDeviceSource(a), blocks,
                                                          stats, stats_ld, stats_offset);
  } else {
    PairStatsKernel<<<grid, kBlockThreads, 0, stream>>>(detail::MakeDeviceSource(a),
                                                        detail::MakeDeviceSource(*b), blocks, stats,
                                                        stats_ld, stats_offset);
  }
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
  JsdPartialKernel<<<detail::GridFor(rows, blocks), kBlockThreads, 0, stream>>>(
      detail::MakeDeviceSource(s), detail::MakeDeviceSource(t), blocks, folded_s, folded_t, beta,
      partials, partials_ld, partials_offset);
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
  return cudaFuncGetAttributes(&attr, SingleStatsKernel);
}

}  // namespace logitserve::kernels::cuda
