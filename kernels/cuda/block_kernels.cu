// The per-(row, vocabulary block) kernels: block statistics (single and pair), the JSD partials
// of the second pass, and the target-logit gather.
//
// One warp reads one block of one row exactly once (lane_block.cuh: the layout, the loads and
// why a warp): the values stay in registers between the max and the exp sums, so no per-element
// rescale (a second exp) is ever needed; blocks are combined later with scalar rescales
// (FoldBlock). The per-block statistics live in block_items.cuh (shared with the top-k kernels);
// their arithmetic mirrors kernels/cpu/cpu_kernels.cc operation for operation; only the summation
// order inside a block differs (cuda_kernels.h), so CPU and GPU agree to rounding, not bit for bit.
#include <cfloat>
#include <climits>
#include <type_traits>

#include "kernels/cuda/block_items.cuh"

namespace logitserve::kernels::cuda {
namespace {

using detail::DeviceSource;
using detail::DirectKernel;
using detail::GridTooLarge;
using detail::LaunchItems;
using detail::StatsOp;
using detail::Supported;
using detail::WithType;

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
  detail::WithTempers<TS, TT>(s, t, [&](auto tps, auto tpt) {
    // The loop, once per path (kClamped: some token is masked on a side, so log-probabilities are
    // clamped and capped at 0 as LogProb does; otherwise every log-probability is finite and <= 0
    // as computed, since z <= m and log s >= 0, and neither operation changes a bit). Nsight
    // Compute (H200, bf16): the first version, with logf and the clamp on every value, issued 55
    // instructions per value, its unrolled code missed the instruction cache and the kernel took
    // 1.86 ms; this one issues about 21.
    auto sum = [&](auto clamped) {
      constexpr bool kClamped = decltype(clamped)::value;
#pragma unroll
      for (int j = 0; j < detail::kLaneChunks; ++j) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          float lps = (detail::Z(tps, zs, j, e) - ns.m) - ns.log_s;  // as LogProb
          float lpt = (detail::Z(tpt, zt, j, e) - nt.m) - nt.log_s;
          if constexpr (kClamped) {
            lps = fmaxf(lps, detail::kClampShift);
            lpt = fmaxf(lpt, detail::kClampShift);
          }
          const float ps = detail::ExpShift(kClamped ? fminf(lps, 0.0f) : lps);
          const float pt = detail::ExpShift(kClamped ? fminf(lpt, 0.0f) : lpt);
          const float mix = fmaxf(fmaf(beta, pt, omb * ps), FLT_MIN);
          const float log_m = detail::LogApprox(mix);
          acc_t[e & 1] = fmaf(pt, lpt - log_m, acc_t[e & 1]);
          acc_s[e & 1] = fmaf(ps, lps - log_m, acc_s[e & 1]);
        }
      }
    };
    // Fast path: no masked token on either side (uniform over the warp).
    const float lo_s = (detail::WarpMin(detail::LaneMin(tps, zs)) - ns.m) - ns.log_s;
    const float lo_t = (detail::WarpMin(detail::LaneMin(tpt, zt)) - nt.m) - nt.log_s;
    if (lo_s > detail::NegInfF() && lo_t > detail::NegInfF()) {
      sum(std::false_type{});
    } else {
      sum(std::true_type{});
    }
  });
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

__global__ void GatherTargetsKernel(DeviceSource a, int64_t col0, int64_t count, const int32_t* ids,
                                    int32_t ids_per_row, float* targets) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const int64_t c = static_cast<int64_t>(ids[i]) - col0;
  if (c < 0 || c >= a.cols) return;  // another shard's (or ignore_index)
  targets[i] = detail::LoadOne(a, i / ids_per_row, c);
}

// Op over every (row, block) of a (and b, when not null: the pair form), dispatched on the types;
// kPairOnly for an op without a single form (b must not be null).
template <bool kPairOnly = false, typename Op>
cudaError_t LaunchOnSources(const LogitsSource& a, const LogitsSource* b, int64_t rows,
                            const Op& op, cudaStream_t stream) {
  const int64_t blocks = a.blocks();
  const int64_t pairs = rows * blocks;
  const DeviceSource da = detail::MakeDeviceSource(a);
  const DeviceSource db = b != nullptr ? detail::MakeDeviceSource(*b) : da;
  cudaError_t err = cudaSuccess;
  WithType(a.type, [&](auto ta) {
    constexpr FloatType TA = decltype(ta)::value;
    if constexpr (!kPairOnly) {
      if (b == nullptr) {
        err = LaunchItems<TA, TA, false>(da, db, blocks, pairs, op, stream);
        return;
      }
    }
    WithType(b->type, [&](auto tb) {
      err = LaunchItems<TA, decltype(tb)::value, true>(da, db, blocks, pairs, op, stream);
    });
  });
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchBlockStats(const LogitsSource& a, const LogitsSource* b, int64_t rows,
                             PairBlockStats* stats, int64_t stats_ld, int64_t stats_offset,
                             cudaStream_t stream, const TargetsOut& targets) {
  const int64_t blocks = a.blocks();
  if (rows <= 0 || blocks <= 0) return cudaSuccess;
  if (GridTooLarge(rows, blocks)) return cudaErrorInvalidConfiguration;
  if (b != nullptr && (b->cols != a.cols || b->col0 != a.col0)) {
    return cudaErrorInvalidValue;
  }
  if (!Supported(a) || (b != nullptr && !Supported(*b))) return cudaErrorInvalidValue;
  StatsOp op{stats, stats_ld, stats_offset, {}};
  if (targets.ids_per_row > 0 && a.cols > 0) {
    if (a.type != FloatType::kFloat32 || targets.ids == nullptr || targets.targets == nullptr) {
      return cudaErrorInvalidValue;
    }
    op.targets = detail::BlockTargets{targets.ids, targets.ids_per_row, targets.targets, a.col0};
  }
  return LaunchOnSources(a, b, rows, op, stream);
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
  const JsdOp op{folded_s, folded_t, beta, partials, partials_ld, partials_offset};
  return LaunchOnSources</*kPairOnly=*/true>(s, &t, rows, op, stream);
}

cudaError_t CheckKernelImage() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(
      &attr, DirectKernel<FloatType::kFloat32, FloatType::kFloat32, false, StatsOp>);
}

}  // namespace logitserve::kernels::cuda
