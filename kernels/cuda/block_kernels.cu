// The per-(row, vocabulary block) kernels: block statistics (single and pair), the JSD partials
// of the second pass, and the target-logit gather.
//
// One warp reads one block of one row exactly once (cuda_kernels.h gives the element-to-lane map
// and the reduction order): the 64 values of each lane stay in registers between the max and the
// exp sums, so no per-element rescale (a second exp) is ever needed; blocks are combined later
// with scalar rescales (FoldBlock). A warp needs no shared memory and no barrier, and walks
// (row, block) items grid-stride, so the kernels are persistent: the grid size (which depends on
// the row count and the GPU) changes which warp computes an item, never how. The arithmetic mirrors
// kernels/cpu/cpu_kernels.cc operation for operation (same clamp, same flags, same cross-term
// signs); only the summation order inside a block differs, so CPU and GPU agree to rounding, not
// bit for bit.
#include <algorithm>
#include <cfloat>
#include <climits>
#include <map>
#include <mutex>
#include <utility>

#include <cuda_bf16.h>

#include "kernels/cuda/device_common.cuh"

namespace logitserve::kernels::cuda {
namespace {

using detail::DeviceSource;

constexpr uint32_t kBadInput = kFlagNaN | kFlagPosInf;
// Values each lane holds per block, in kWarpChunks chunks of 8 consecutive ids.
constexpr int kWarpChunks = kVocabBlock / (32 * 8);
static_assert(kWarpChunks * 32 * 8 == kVocabBlock, "a warp covers one block");
// Two warps per CTA, each on its own items: small CTAs let the register-heavy pair kernels fill
// an SM in fine steps (a 256-thread CTA at 186 registers would leave a third of the file idle).
constexpr int kStatsThreads = 64;
constexpr int kStatsWarps = kStatsThreads / 32;

// How a lane keeps its 64 values. kPackedBf16: raw bf16 bits, 8 per uint4 (32 registers), decoded
// exactly on every use; for bf16 sources without a transform, the logits-mode case. kFloat: the
// transformed fp32 values (64 registers); every other source. Both hold the same values, so the
// choice (a function of the input dtype) changes no bit.
enum class Store { kPackedBf16, kFloat };

constexpr uint32_t kBf16NegInfBits = 0xff80u;

__device__ __forceinline__ uint32_t Word(const uint4& u, int k) {
  return k == 0 ? u.x : (k == 1 ? u.y : (k == 2 ? u.z : u.w));
}

template <Store S>
struct LaneValues;

template <>
struct LaneValues<Store::kPackedBf16> {
  uint4 raw[kWarpChunks];
  // Element j of chunk i: column block_col + 256 i + 8 lane + j (the map of cuda_kernels.h).
  __device__ __forceinline__ void Load(const DeviceSource& s, int64_t row, int64_t block_col) {
    const uint16_t* base = static_cast<const uint16_t*>(s.data) + row * s.ld;
    const int64_t col = block_col + 8 * (threadIdx.x & 31);
    if (s.vectorized && block_col + kVocabBlock <= s.cols) {  // whole block (warp-uniform)
#pragma unroll
      for (int i = 0; i < kWarpChunks; ++i) {
        raw[i] = __ldg(reinterpret_cast<const uint4*>(base + col + 256 * i));
      }
      return;
    }
#pragma unroll
    for (int i = 0; i < kWarpChunks; ++i) {
      uint32_t w[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int64_t c = col + 256 * i + 2 * k;
        const uint32_t lo = c < s.cols ? base[c] : kBf16NegInfBits;
        const uint32_t hi = c + 1 < s.cols ? base[c + 1] : kBf16NegInfBits;
        w[k] = lo | (hi << 16);
      }
      raw[i] = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
  __device__ __forceinline__ float Get(int i, int j) const {
    const uint32_t w = Word(raw[i], j >> 1);
    return __uint_as_float((j & 1) ? (w & 0xffff0000u) : (w << 16));
  }
  // Max and NaN test on the packed bits (bf16x2 max, SIMD compares), so that the values are
  // decoded once, in the sum loop, and the 64 decoded floats are never all live at once.
  __device__ __forceinline__ float Max() const {
    __nv_bfloat162 m = Pair(raw[0].x);
#pragma unroll
    for (int i = 0; i < kWarpChunks; ++i) {
#pragma unroll
      for (int k = 0; k < 4; ++k) m = __hmax2(m, Pair(Word(raw[i], k)));
    }
    return fmaxf(__low2float(m), __high2float(m));
  }
  __device__ __forceinline__ bool AnyNaN() const {
    uint32_t nan = 0;  // a half is NaN when its magnitude bits exceed +inf's (0x7f80)
#pragma unroll
    for (int i = 0; i < kWarpChunks; ++i) {
#pragma unroll
      for (int k = 0; k < 4; ++k) nan |= __vcmpgtu2(Word(raw[i], k) & 0x7fff7fffu, 0x7f807f80u);
    }
    return nan != 0;
  }

 private:
  __device__ __forceinline__ static __nv_bfloat162 Pair(uint32_t w) {
    __nv_bfloat162 h;
    memcpy(&h, &w, sizeof(h));
    return h;
  }
};

template <>
struct LaneValues<Store::kFloat> {
  float v[kWarpChunks][8];
  __device__ __forceinline__ void Load(const DeviceSource& s, int64_t row, int64_t block_col) {
    const int64_t col = block_col + 8 * (threadIdx.x & 31);
#pragma unroll
    for (int i = 0; i < kWarpChunks; ++i) detail::Load8(s, row, col + 256 * i, v[i]);
  }
  __device__ __forceinline__ float Get(int i, int j) const { return v[i][j]; }
  __device__ __forceinline__ float Max() const {
    float m = detail::NegInfF();
#pragma unroll
    for (int i = 0; i < kWarpChunks; ++i) {
#pragma unroll
      for (int j = 0; j < 8; ++j) m = fmaxf(m, v[i][j]);
    }
    return m;
  }
  __device__ __forceinline__ bool AnyNaN() const {
    bool nan = false;
#pragma unroll
    for (int i = 0; i < kWarpChunks; ++i) {
#pragma unroll
      for (int j = 0; j < 8; ++j) nan |= v[i][j] != v[i][j];
    }
    return nan;
  }
};

bool Packable(const LogitsSource& s) {
  return s.type == FloatType::kBFloat16 && !s.transform.head && s.transform.temperature == 1.0f;
}

// The warp's item sequence: item = (row, block), blocks of a row adjacent.
struct WarpItems {
  int64_t first, stride;
  __device__ WarpItems()
      : first(static_cast<int64_t>(blockIdx.x) * kStatsWarps + (threadIdx.x >> 5)),
        stride(static_cast<int64_t>(gridDim.x) * kStatsWarps) {}
};

// The block max over the warp. Max is exact, so the two stores agree on every value except the
// sign of a zero max (bf16x2 and fp32 max may order -0 and +0 differently): adding +0 makes it +0
// in both, keeping the bits independent of the input dtype.
template <Store S>
__device__ __forceinline__ float WarpBlockMax(const LaneValues<S>& x) {
  return detail::WarpMax(x.Max()) + 0.0f;
}

template <Store S>
__device__ __forceinline__ bool WarpAnyNaN(const LaneValues<S>& x) {
  return __any_sync(detail::kFullMask, x.AnyNaN());
}

// In-block order (cuda_kernels.h): each lane adds its values chunk by chunk into two partial sums,
// even chunks and odd chunks (two independent chains hide the add latency), then even + odd, then
// the xor butterfly over the 32 lanes.
template <int N>
__device__ __forceinline__ void WarpSums(float (&even)[N], const float (&odd)[N]) {
#pragma unroll
  for (int n = 0; n < N; ++n) even[n] = detail::WarpSum(even[n] + odd[n]);
}

template <Store S>
__global__ void __launch_bounds__(kStatsThreads)
    SingleStatsKernel(DeviceSource a, int64_t blocks, int64_t items, PairBlockStats* stats,
                      int64_t stats_ld, int64_t stats_offset) {
  const int lane = threadIdx.x & 31;
  const WarpItems w;
  for (int64_t item = w.first; item < items; item += w.stride) {
    const int64_t row = item / blocks;
    const int64_t blk = item - row * blocks;
    LaneValues<S> x;
    x.Load(a, row, blk * kVocabBlock);
    const float m = WarpBlockMax(x);
    const bool nan = WarpAnyNaN(x);
    BlockStats out = EmptyBlockStats();
    out.flags = (nan ? kFlagNaN : 0u) | (m == detail::PosInfF() ? kFlagPosInf : 0u);
    if (out.flags == 0 && m != detail::NegInfF()) {  // uniform over the warp
      float acc[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};  // [chunk parity][s, w]
#pragma unroll
      for (int i = 0; i < kWarpChunks; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float dz = fmaxf(x.Get(i, j) - m, detail::kClampShift);  // <= 0; masked -> -200
          const float e = detail::ExpNonPositive(dz);
          acc[i & 1][0] += e;
          acc[i & 1][1] = fmaf(e, dz, acc[i & 1][1]);
        }
      }
      WarpSums<2>(acc[0], acc[1]);
      out.m = m;
      out.s = acc[0][0];
      out.w = acc[0][1];
    }
    if (lane == 0) {
      stats[row * stats_ld + stats_offset + blk] =
          PairBlockStats{out, EmptyBlockStats(), 0.0f, 0.0f};
    }
  }
}

template <Store SA, Store SB>
__global__ void __launch_bounds__(kStatsThreads)
    PairStatsKernel(DeviceSource a, DeviceSource b, int64_t blocks, int64_t items,
                    PairBlockStats* stats, int64_t stats_ld, int64_t stats_offset) {
  const int lane = threadIdx.x & 31;
  const WarpItems w;
  const float ninf = detail::NegInfF();
  for (int64_t item = w.first; item < items; item += w.stride) {
    const int64_t row = item / blocks;
    const int64_t blk = item - row * blocks;
    const int64_t col = blk * kVocabBlock;
    LaneValues<SA> xa;
    LaneValues<SB> xb;
    xa.Load(a, row, col);
    xb.Load(b, row, col);
    const float ma = WarpBlockMax(xa);
    const float mb = WarpBlockMax(xb);
    const bool nan_a = WarpAnyNaN(xa);
    const bool nan_b = WarpAnyNaN(xb);
    PairBlockStats out{EmptyBlockStats(), EmptyBlockStats(), 0.0f, 0.0f};
    out.a.flags = (nan_a ? kFlagNaN : 0u) | (ma == detail::PosInfF() ? kFlagPosInf : 0u);
    out.b.flags = (nan_b ? kFlagNaN : 0u) | (mb == detail::PosInfF() ? kFlagPosInf : 0u);
    if (((out.a.flags | out.b.flags) & kBadInput) == 0) {  // uniform over the warp
      // A fully masked side has m = -inf; shifting by 0 instead keeps its values at -inf.
      const float sha = ma == ninf ? 0.0f : ma;
      const float shb = mb == ninf ? 0.0f : mb;
      // [chunk parity][s_a, w_a, s_b, w_b, c_ab, c_ba]
      float acc[2][6] = {};
      bool a_only = false, b_only = false;
#pragma unroll
      for (int i = 0; i < kWarpChunks; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          float* p = acc[i & 1];
          const float da = xa.Get(i, j) - sha;
          const float db = xb.Get(i, j) - shb;
          const bool live_a = da > ninf;
          const bool live_b = db > ninf;
          a_only |= live_a && !live_b;
          b_only |= live_b && !live_a;
          const float dac = fmaxf(da, detail::kClampShift);
          const float dbc = fmaxf(db, detail::kClampShift);
          const float ea = detail::ExpNonPositive(dac);
          const float eb = detail::ExpNonPositive(dbc);
          p[0] += ea;
          p[1] = fmaf(ea, dac, p[1]);
          p[2] += eb;
          p[3] = fmaf(eb, dbc, p[3]);
          // Cross terms over tokens both sides support, with the unclamped shifts: a deep but
          // finite logit (b - m_b = -300) is underflow, not masking, and its KL term grows with
          // it. A token only one side supports raised a mismatch flag, which overrides that
          // direction with +inf.
          const float diff = (live_a && live_b) ? da - db : 0.0f;
          p[4] = fmaf(ea, diff, p[4]);
          p[5] = fmaf(-eb, diff, p[5]);
        }
      }
      WarpSums<6>(acc[0], acc[1]);
      if (__any_sync(detail::kFullMask, a_only)) out.a.flags |= kFlagASupportsBMasked;
      if (__any_sync(detail::kFullMask, b_only)) out.a.flags |= kFlagBSupportsAMasked;
      if (ma != ninf) {
        out.a.m = ma;
        out.a.s = acc[0][0];
        out.a.w = acc[0][1];
        out.c_ab = acc[0][4];
      }
      if (mb != ninf) {
        out.b.m = mb;
        out.b.s = acc[0][2];
        out.b.w = acc[0][3];
        out.c_ba = acc[0][5];
      }
    }
    if (lane == 0) stats[row * stats_ld + stats_offset + blk] = out;
  }
}

// The CPU's CpuJsdBlock: the mixture in linear space, m = beta p_t + (1 - beta) p_s floored at
// FLT_MIN, two exps and one log per token; masked tokens have p = exp(-200 clamp) = 0, so every
// product is finite times finite.
template <Store SS, Store ST>
__global__ void __launch_bounds__(kStatsThreads)
    JsdPartialKernel(DeviceSource s, DeviceSource t, int64_t blocks, int64_t items,
                     const RowStats* folded_s, const RowStats* folded_t, float beta,
                     float* partials, int64_t partials_ld, int64_t partials_offset) {
  const int lane = threadIdx.x & 31;
  const WarpItems w;
  const float omb = 1.0f - beta;
  for (int64_t item = w.first; item < items; item += w.stride) {
    const int64_t row = item / blocks;
    const int64_t blk = item - row * blocks;
    const RowStats rs = folded_s[row];
    const RowStats rt = folded_t[row];
    float* out = partials + row * partials_ld + partials_offset + blk;
    if (AllMasked(rs) || AllMasked(rt)) {  // uniform over the warp
      if (lane == 0) *out = 0.0f;
      continue;
    }
    const RowNorm ns = NormOf(rs);
    const RowNorm nt = NormOf(rt);
    const int64_t col = blk * kVocabBlock;
    LaneValues<SS> zs;
    LaneValues<ST> zt;
    zs.Load(s, row, col);
    zt.Load(t, row, col);
    float acc[2][2] = {};  // [chunk parity][teacher, student]
#pragma unroll
    for (int i = 0; i < kWarpChunks; ++i) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float* p = acc[i & 1];
        const float lps = fmaxf((zs.Get(i, j) - ns.m) - ns.log_s, detail::kClampShift);
        const float lpt = fmaxf((zt.Get(i, j) - nt.m) - nt.log_s, detail::kClampShift);
        const float ps = detail::ExpNonPositive(fminf(lps, 0.0f));
        const float pt = detail::ExpNonPositive(fminf(lpt, 0.0f));
        const float mix = fmaxf(fmaf(beta, pt, omb * ps), FLT_MIN);
        const float log_m = logf(mix);
        p[0] = fmaf(pt, lpt - log_m, p[0]);
        p[1] = fmaf(ps, lps - log_m, p[1]);
      }
    }
    WarpSums<2>(acc[0], acc[1]);
    if (lane == 0) *out = beta * acc[0][0] + omb * acc[0][1];
  }
}

// CTAs to launch for `items` warp items: enough to fill the device once (persistent), never more
// than there are items. The count depends on the GPU and the row count; results do not.
template <typename Kernel>
unsigned PersistentGrid(Kernel kernel, int64_t items) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int64_t> resident;  // (kernel, device) -> CTAs
  int device = 0;
  cudaGetDevice(&device);
  int64_t ctas = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    const auto key = std::make_pair(reinterpret_cast<const void*>(kernel), device);
    auto it = resident.find(key);
    if (it == resident.end()) {
      int sms = 0, per_sm = 0;
      if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kStatsThreads, 0) !=
              cudaSuccess) {
        cudaGetLastError();
        sms = 1, per_sm = 1;
      }
      it = resident.emplace(key, static_cast<int64_t>(sms) * std::max(per_sm, 1)).first;
    }
    ctas = it->second;
  }
  const int64_t needed = (items + kStatsWarps - 1) / kStatsWarps;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(ctas, needed)));
}

__global__ void GatherTargetsKernel(DeviceSource a, int64_t col0, int64_t count, const int32_t* ids,
                                    int32_t ids_per_row, float* targets) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const int64_t c = static_cast<int64_t>(ids[i]) - col0;
  if (c < 0 || c >= a.cols) return;  // another shard's (or ignore_index)
  targets[i] = detail::LoadOne(a, i / ids_per_row, c);
}

}  // namespace

cudaError_t LaunchBlockStats(const LogitsSource& a, const LogitsSource* b, int64_t rows,
                             PairBlockStats* stats, int64_t stats_ld, int64_t stats_offset,
                             cudaStream_t stream) {
  const int64_t blocks = a.blocks();
  if (rows <= 0 || blocks <= 0) return cudaSuccess;
  if (b != nullptr && (b->cols != a.cols || b->col0 != a.col0)) return cudaErrorInvalidValue;
  const int64_t items = rows * blocks;
  const DeviceSource da = detail::MakeDeviceSource(a);
  constexpr Store kP = Store::kPackedBf16, kF = Store::kFloat;
  const bool pa = Packable(a);
  auto go = [&](auto kernel, auto... args) {
    kernel<<<PersistentGrid(kernel, items), kStatsThreads, 0, stream>>>(args...);
    return cudaGetLastError();
  };
  if (b == nullptr) {
    return pa ? go(SingleStatsKernel<kP>, da, blocks, items, stats, stats_ld, stats_offset)
              : go(SingleStatsKernel<kF>, da, blocks, items, stats, stats_ld, stats_offset);
  }
  const DeviceSource db = detail::MakeDeviceSource(*b);
  const bool pb = Packable(*b);
  if (pa && pb) return go(PairStatsKernel<kP, kP>, da, db, blocks, items, stats, stats_ld, stats_offset);
  if (pa) return go(PairStatsKernel<kP, kF>, da, db, blocks, items, stats, stats_ld, stats_offset);
  if (pb) return go(PairStatsKernel<kF, kP>, da, db, blocks, items, stats, stats_ld, stats_offset);
  return go(PairStatsKernel<kF, kF>, da, db, blocks, items, stats, stats_ld, stats_offset);
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
  if (t.cols != s.cols || t.col0 != s.col0) return cudaErrorInvalidValue;
  const int64_t items = rows * blocks;
  const DeviceSource ds = detail::MakeDeviceSource(s);
  const DeviceSource dt = detail::MakeDeviceSource(t);
  constexpr Store kP = Store::kPackedBf16, kF = Store::kFloat;
  auto go = [&](auto kernel) {
    kernel<<<PersistentGrid(kernel, items), kStatsThreads, 0, stream>>>(
        ds, dt, blocks, items, folded_s, folded_t, beta, partials, partials_ld, partials_offset);
    return cudaGetLastError();
  };
  const bool ps = Packable(s), pt = Packable(t);
  if (ps && pt) return go(JsdPartialKernel<kP, kP>);
  if (ps) return go(JsdPartialKernel<kP, kF>);
  if (pt) return go(JsdPartialKernel<kF, kP>);
  return go(JsdPartialKernel<kF, kF>);
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
  return cudaFuncGetAttributes(&attr, SingleStatsKernel<Store::kFloat>);
}

}  // namespace logitserve::kernels::cuda
