// Hidden mode's fused kernel (Hopper, sm_90a): the logits h . W^T of a row tile on the tensor
// cores, reduced to per-block statistics straight from the fp32 accumulators, so that logits never
// reach device memory (unless a caller asks for them: top-k and JSD read them again).
//
// Shape. A CTA owns 128 token rows and one vocabulary block (kVocabBlock = 2048 ids) of one head
// (the single form) or of both heads at once (the pair form: KL's cross terms need the model's and
// the reference's logit of the same token together). It walks the block in 16 subtiles of 128
// columns; for each, two consumer warpgroups (64 rows each) run the whole hidden dimension through
// wgmma m64n128k16 into 64 fp32 accumulators per head and thread, then turn them into the
// subtile's statistics and fold those into the block's record (block_stats.h's FoldBlock /
// FoldPairBlock, the fold every backend runs). A producer warp streams the operand tiles
// (hidden rows x 64 values, weight rows x 64 values, 128-byte swizzle) with the bulk tensor copy
// engine through a ring of shared-memory slots guarded by mbarriers. CTAs are persistent: each
// takes items (row tile, block) in a fixed, grid-independent order of groups of row tiles, so that
// the hidden rows of a group stay in L2 across the 16 subtiles of every block and a weight subtile
// is read once from device memory per group. Clusters of kCM x kCN CTAs (rows x blocks) share
// operand tiles with multicast copies: each CTA loads 1 / kCN of the hidden tile and 1 / kCM of the
// weight tile into every CTA of the cluster that needs it, so L2 delivers each byte once per
// cluster.
//
// Speed (docs/PERFORMANCE.md): CudaBackend's default for heads of H <= 2048
// (CudaBackendOptions::hidden_fused_max_hidden), where it beats cuBLASLt tiles + the statistics
// kernel; at H 4096 the tiles win. The main loop is bound by operand delivery from L2: a pair
// tile pulls 64 KB of operands per 4.2 MFLOP, and the consumers' epilogue (~1 / 3 of their time
// at H 1024) does not overlap the MMAs (no registers are left for a second accumulator set), so
// what the ring keeps in flight decides the speed. H100, H 1024, N 8192: three 64 KB stages of
// both heads 10.2 ms; six 32 KB slots of one head 9.2; without the producer's L2 prefetch (which
// doubled the L2 traffic of the tiles it touched) 8.55. Measured slower and dropped: 32-value
// stages x 6 (64-byte swizzle; H 1024 10.2 -> 12.9 ms), an L2 prefetch across subtiles and items
// (10.2 -> 12.1 ms), and the model's side of the epilogue run beside the reference's products
// (the model's k-steps first; 9.2 -> 9.5 ms: the held slots starved the loads).
//
// Semantics. A subtile's record is exactly what PairItem / SingleItem (block_items.cuh) compute
// for a block, over the subtile's 128 columns: NaN / +inf flags from a NaN-propagating maximum,
// masked tokens (-inf, or an overflowing shift) dropping out, support-mismatch flags, the clamp of
// shifted logits; columns past `cols` are masked. A block's record is the fold of its 16 subtile
// records in column order. The per-thread sums run first without masking (every shift finite);
// if any sum comes out NaN (0 * -inf: a masked token), the thread's quad recomputes the subtile
// with the masking rules (both ways give the same bits when nothing is masked).
//
// Determinism. Every number a record holds depends only on the row's hidden states, the head and
// the column range: the K order of an accumulator is the fixed loop over parts and 64-value steps
// and the tensor cores' fixed order inside a step (no split-K, nothing depends on the row count,
// the grid or the position of the row in its tile); the per-thread sums run over the thread's
// columns in a fixed order, quads combine with a fixed xor butterfly, subtiles fold in column
// order. Hidden states given as fp16 / fp32 arrive as two / three exact bf16 parts and heads as
// one to three parts (LaunchSplitToBf16); the K loop runs over every (hidden part, weight part)
// pair into the same accumulators, and a part that is zero adds exactly zero, so bf16, fp16 and
// fp32 inputs of equal value give the same bits. The model side of the pair form runs the very
// operations of the single form, so a job's model outputs do not depend on whether a reference is
// present.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <mutex>

#include "kernels/cuda/block_items.cuh"
#include "kernels/cuda/hidden_epilogue.cuh"
#include "kernels/cuda/sm90.cuh"

namespace logitserve::kernels::cuda {
namespace {

namespace sm = sm90;
using hidden::kTileCols;

constexpr int kTileRows = 128;  // rows per CTA: two consumer warpgroups of 64
constexpr int kStepK = 64;      // hidden values per stage: 128 bytes, the swizzle span
constexpr int kSubtiles = static_cast<int>(kVocabBlock) / kTileCols;
constexpr int kThreads = 384;                       // producer warpgroup + two consumers
constexpr int kTileBytes = kTileRows * kStepK * 2;  // one operand tile: 16 KB
constexpr int kGroupRows = 1024;                    // rows of a group of items (L2 reuse)
// Registers after setmaxnreg: the CTA starts with 168 a thread (65536 / 384, rounded down to 8),
// 64512 in all, and the consumers' increase waits until the producer's decrease has freed them:
// 128 x 40 + 256 x 232 = 64512 exactly (a larger sum never completes: the kernel hangs).
constexpr uint32_t kProducerRegs = 40;
constexpr uint32_t kConsumerRegs = 232;
static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= 384 * 168, "setmaxnreg pool");
static_assert(kSubtiles * kTileCols == kVocabBlock, "subtiles cover a block");

// The shared-memory ring: six slots of one head's operand tiles (the hidden tile and the weight
// tile of one 64-value k-step), as many as fit in the 227 KB a CTA may hold. The pair form's
// k-step fills two slots in turn (model, then reference), so that the consumers, which hold the
// slot under their running products and the one before it, leave four slots (128 KB) to loads in
// flight rather than one 64 KB stage of both heads (H100, H 1024: 8 % faster).
constexpr int kStages = 6;
constexpr int kStageBytes = 2 * kTileBytes;
// The ring, its barriers, and each row's running block record (PairRowStats: the fold of the
// block's subtile records so far, kept in shared memory rather than in the consumers' registers,
// which the accumulators fill), plus alignment slack.
constexpr int SmemBytes() {
  return kStages * kStageBytes + 2 * kStages * 8 +
         kTileRows * static_cast<int>(sizeof(PairRowStats)) + 1024;
}

struct Params {
  // The caller's arguments as given (logits_b cleared for the single form).
  HiddenStatsArgs args;
  int32_t w_row0 = 0;
  int32_t blocks = 0;
  int32_t row_units = 0;  // cluster row units (kCM row tiles each)
  int32_t block_units = 0;
  int32_t group_units = 0;  // row units per group
  int32_t items = 0;
  int32_t steps_a = 0, steps_b = 0;    // k-steps per subtile
  int32_t ksteps_a = 0, ksteps_b = 0;  // k-steps per (hidden part, weight part) segment
  int32_t wparts_a = 1, wparts_b = 1;
  LoadTransform ta, tb;
};

struct Item {
  int32_t row_tile;
  int32_t block;
  int32_t subtiles;  // the same for every CTA of the cluster
};

// Item i of the launch for cluster position (ri, ci): groups of group_units row units; inside a
// group, block units in order, row units fastest.
template <int kCM, int kCN>
__device__ __forceinline__ Item DecodeItem(const Params& p, int32_t i, int ri, int ci) {
  const int32_t per_group = p.group_units * p.block_units;
  const int32_t g = i / per_group;
  const int32_t in = i - g * per_group;
  const int32_t gu = min(p.group_units, p.row_units - g * p.group_units);
  const int32_t bu = in / gu;
  const int32_t ru = g * p.group_units + (in - bu * gu);
  Item it;
  it.row_tile = ru * kCM + ri;
  it.block = bu * kCN + ci;
  const int64_t left = p.args.cols - static_cast<int64_t>(bu) * kCN * kVocabBlock;  // first block's
  it.subtiles = static_cast<int32_t>(
      min(static_cast<int64_t>(kSubtiles), (left + kTileCols - 1) / kTileCols));
  return it;
}

// The k-steps of one side, in order: 64-value steps of the hidden dimension, within each (hidden
// part, weight part) segment, weight parts fastest. TMA coordinates (k, part of x, part of w); no
// division on the producer's path.
struct Cursor {
  int32_t k = 0, xpart = 0, wpart = 0;
  int32_t k_end = 0, wparts = 1;
  __device__ __forceinline__ void Next() {
    k += kStepK;
    if (k == k_end) {
      k = 0;
      if (++wpart == wparts) {
        wpart = 0;
        ++xpart;
      }
    }
  }
};

// ---- the kernel --------------------------------------------------------------------------------

template <bool kPair, bool kGeneral, int kCM, int kCN>
__global__ void __launch_bounds__(kThreads, 1)
    HiddenStatsKernel(const __grid_constant__ CUtensorMap xa,
                      const __grid_constant__ CUtensorMap wa,
                      const __grid_constant__ CUtensorMap xb,
                      const __grid_constant__ CUtensorMap wb, const Params p) {
#if LOGITSERVE_SM90A
  constexpr bool kCluster = kCM * kCN > 1;
  // CTAs that write into this CTA's stages (its hidden-tile sharers and weight-tile sharers, itself
  // once): each of their consumer warpgroups releases a stage here.
  constexpr int kWriters = kCM + kCN - 1;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  uint64_t* empty = full + kStages;
  PairRowStats* running = reinterpret_cast<PairRowStats*>(empty + kStages);  // [kTileRows]

  const int wg = threadIdx.x / 128;
  const uint32_t rank = kCluster ? sm::ClusterCtaRank() : 0u;
  const int ri = static_cast<int>(rank) % kCM;
  const int ci = static_cast<int>(rank) / kCM;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      sm::BarrierInit(&full[s], 1);
      sm::BarrierInit(&empty[s], 2 * kWriters);
    }
    sm::FenceBarrierInit();
  }
  if constexpr (kCluster) {
    sm::ClusterSync();
  } else {
    __syncthreads();
  }
  const int32_t cluster = kCluster ? static_cast<int32_t>(sm::ClusterId()) : blockIdx.x;
  const int32_t clusters = kCluster ? static_cast<int32_t>(sm::NumClusters()) : gridDim.x;

  if (wg == 0) {
    // Producer: one thread issues every copy.
    sm::RegDealloc<kProducerRegs>();
    if (threadIdx.x == 0) {
      sm::PrefetchTensorMap(&xa);
      sm::PrefetchTensorMap(&wa);
      if constexpr (kPair) {
        sm::PrefetchTensorMap(&xb);
        sm::PrefetchTensorMap(&wb);
      }
      // Multicast groups: CTAs with this CTA's rows (ranks ri + kCM c) share its hidden tile,
      // CTAs with its block (ranks r + kCM ci) its weight tile.
      uint16_t x_mask = 0, w_mask = 0;
      for (int c = 0; c < kCN; ++c) x_mask |= static_cast<uint16_t>(1u << (ri + kCM * c));
      for (int r = 0; r < kCM; ++r) w_mask |= static_cast<uint16_t>(1u << (r + kCM * ci));
      constexpr int kXRows = kTileRows / kCN;  // this CTA's share of the hidden tile
      constexpr int kWRows = kTileCols / kCM;  // and of the weight tile
      const int steps = kPair ? max(p.steps_a, p.steps_b) : p.steps_a;
      int stage = 0;
      uint32_t phase = 0;
      for (int32_t i = cluster; i < p.items; i += clusters) {
        const Item it = DecodeItem<kCM, kCN>(p, i, ri, ci);
        const int32_t x_row = it.row_tile * kTileRows + ci * kXRows;
        for (int t = 0; t < it.subtiles; ++t) {
          const int32_t w_row =
              p.w_row0 + it.block * static_cast<int32_t>(kVocabBlock) + t * kTileCols + ri * kWRows;
          Cursor ca, cb;
          ca.k_end = p.ksteps_a * kStepK;
          ca.wparts = p.wparts_a;
          cb.k_end = p.ksteps_b * kStepK;
          cb.wparts = p.wparts_b;
          for (int s = 0; s < steps; ++s) {
            // One head's k-step into the next slot of the ring.
            auto fill = [&](const CUtensorMap& xm, const CUtensorMap& wm, Cursor& k) {
              sm::Wait(&empty[stage], phase ^ 1u);
              sm::ArriveExpectTx(&full[stage], 2 * kTileBytes);
              uint8_t* st = smem + stage * kStageBytes;
              uint8_t* xd = st + ci * kXRows * 128;
              uint8_t* wd = st + kTileBytes + ri * kWRows * 128;
              if constexpr (kCN > 1) {
                sm::Load3dMulticast(&xm, &full[stage], xd, k.k, x_row, k.xpart, x_mask);
              } else {
                sm::Load3d(&xm, &full[stage], xd, k.k, x_row, k.xpart);
              }
              if constexpr (kCM > 1) {
                sm::Load3dMulticast(&wm, &full[stage], wd, k.k, w_row, k.wpart, w_mask);
              } else {
                sm::Load3d(&wm, &full[stage], wd, k.k, w_row, k.wpart);
              }
              k.Next();
              if (++stage == kStages) {
                stage = 0;
                phase ^= 1u;
              }
            };
            if (s < p.steps_a) fill(xa, wa, ca);
            if constexpr (kPair) {
              if (s < p.steps_b) fill(xb, wb, cb);
            }
          }
        }
      }
    }
  } else {
    sm::RegAlloc<kConsumerRegs>();
    const int cw = wg - 1;  // rows [64 cw, 64 cw + 64) of the tile
    const int t128 = threadIdx.x & 127;
    const int lane = threadIdx.x & 31;
    const int quad_col = 2 * (lane & 3);
    const int row_in_tile = cw * 64 + (t128 >> 5) * 16 + (lane >> 2);
    const int steps = kPair ? max(p.steps_a, p.steps_b) : p.steps_a;
    float acc_a[64], acc_b[64];
    // Descriptor address word of slot 0 and this warpgroup's row offset in an x tile.
    const uint32_t desc_lo = sm::SmemDescLo(sm::SmemAddr(smem));
    const uint32_t x_off = static_cast<uint32_t>(cw * (64 * 128)) >> 4;
    int stage = 0;
    uint32_t phase = 0;
    // Releases a stage to every CTA that writes into it: lane d of the warpgroup's first warp
    // signals writer d (this CTA's hidden-tile sharers, then its other weight-tile sharers).
    auto release = [&](int s) {
      if (t128 < kWriters) {
        const int d = t128;
        const uint32_t dst = d < kCN
                                 ? static_cast<uint32_t>(ri + kCM * d)
                                 : static_cast<uint32_t>(((ri + 1 + (d - kCN)) % kCM) + kCM * ci);
        if constexpr (kCluster) {
          sm::ArriveCluster(&empty[s], dst);
        } else {
          sm::Arrive(&empty[s]);
        }
      }
    };
    for (int32_t i = cluster; i < p.items; i += clusters) {
      const Item it = DecodeItem<kCM, kCN>(p, i, ri, ci);
      // Each row's running record lives in shared memory; lane 0 of the row's quad folds into it.
      const bool folds = (lane & 3) == 0;
      if (folds) {
        running[row_in_tile] = EmptyPairRowStats();
        running[row_in_tile + 8] = EmptyPairRowStats();
      }
      const int64_t row0 = static_cast<int64_t>(it.row_tile) * kTileRows + row_in_tile;
      for (int t = 0; t < it.subtiles; ++t) {
        int prev = -1;
        // One head's k-step s from the next slot: the warpgroup's 64 hidden rows of the slot's x
        // tile against its w tile, the k-th 16-value slice 32 bytes further (>> 4 in the
        // descriptor's address word). Once the products of the slot before are done, that slot
        // goes back to its writers.
        auto step = [&](float(&acc)[64], int s) {
          sm::Wait(&full[stage], phase);
          const uint32_t lo = desc_lo + static_cast<uint32_t>(stage) * (kStageBytes >> 4);
          sm::WgmmaFence();
#pragma unroll
          for (int kk = 0; kk < kStepK / 16; ++kk) {
            sm::WgmmaM64N128K16(acc, sm::SmemDesc(lo + x_off + 2 * kk),
                                sm::SmemDesc(lo + (kTileBytes >> 4) + 2 * kk),
                                (s > 0 || kk > 0) ? 1u : 0u);
          }
          sm::WgmmaCommit();
          sm::WgmmaWait<1>();
          if (prev >= 0) release(prev);
          prev = stage;
          if (++stage == kStages) {
            stage = 0;
            phase ^= 1u;
          }
        };
        for (int s = 0; s < steps; ++s) {
          if (s < p.steps_a) step(acc_a, s);
          if constexpr (kPair) {
            if (s < p.steps_b) step(acc_b, s);
          }
        }
        sm::WgmmaWait<0>();
        release(prev);
        sm::FenceOperands(acc_a);
        if constexpr (kPair) sm::FenceOperands(acc_b);

        // The subtile's columns: launch-local c_base + 8 j + quad_col + e.
        const int64_t c_base = static_cast<int64_t>(it.block) * kVocabBlock + t * kTileCols;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int64_t row = row0 + 8 * h;
          if (row < p.args.rows && c_base < p.args.cols) {
            if (p.args.logits_a != nullptr) {
              hidden::StoreLogits(p.args.logits_a, p.args.logits_ld, acc_a, row, h, c_base,
                                  quad_col, p.args.cols);
            }
            if constexpr (kPair) {
              if (p.args.logits_b != nullptr) {
                hidden::StoreLogits(p.args.logits_b, p.args.logits_ld, acc_b, row, h, c_base,
                                    quad_col, p.args.cols);
              }
            }
          }
        }
        if constexpr (kGeneral) {
          hidden::TransformAll(p.ta, c_base, quad_col, p.args.cols, acc_a);
          if constexpr (kPair) hidden::TransformAll(p.tb, c_base, quad_col, p.args.cols, acc_b);
        }
        if (c_base + kTileCols > p.args.cols) {
          hidden::MaskTail(c_base, quad_col, p.args.cols, acc_a);
          if constexpr (kPair) hidden::MaskTail(c_base, quad_col, p.args.cols, acc_b);
        }
        if (p.args.ids_per_row > 0) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int64_t row = row0 + 8 * h;
            if (row < p.args.rows && c_base < p.args.cols) {
              hidden::GatherTargets(hidden::Targets{p.args.ids, p.args.ids_per_row, p.args.targets,
                                                    p.args.col0, p.args.cols},
                                    acc_a, row, h, c_base, quad_col);
            }
          }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          PairRowStats& r = running[row_in_tile + 8 * h];
          if constexpr (kPair) {
            const PairBlockStats rec = hidden::PairRecord(acc_a, acc_b, h);
            if (folds) FoldPairBlock(r, rec);
          } else {
            const BlockStats rec = hidden::SingleRecord(acc_a, h);
            if (folds) FoldBlock(r.a, rec);
          }
        }
        __syncwarp();
      }
      // The block's records, one thread per row.
      if (folds && it.block < p.blocks) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int64_t row = row0 + 8 * h;
          if (row >= p.args.rows) continue;
          const PairRowStats& r = running[row_in_tile + 8 * h];
          PairBlockStats rec;
          rec.a = BlockStats{r.a.m, r.a.s, r.a.w, r.a.flags};
          if constexpr (kPair) {
            rec.b = BlockStats{r.b.m, r.b.s, r.b.w, r.b.flags};
            rec.c_ab = r.c_ab;
            rec.c_ba = r.c_ba;
          } else {
            rec.b = EmptyBlockStats();
            rec.c_ab = 0.0f;
            rec.c_ba = 0.0f;
          }
          p.args.stats[row * p.args.stats_ld + p.args.stats_offset + it.block] = rec;
        }
      }
    }
  }
  // No CTA leaves while a peer may still multicast into its stages or signal its barriers.
  if constexpr (kCluster) sm::ClusterSync();
#endif
}

// ---- host side ---------------------------------------------------------------------------------

PFN_cuTensorMapEncodeTiled_v12000 EncodeFn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// parts x [rows][k] bf16, boxes of box_rows x 64 values with the 128-byte swizzle. Reads past the
// tensor (rows, k) are zeros.
cudaError_t EncodeOperand(CUtensorMap* map, const uint16_t* data, int64_t k, int64_t rows,
                          int parts, int box_rows) {
  PFN_cuTensorMapEncodeTiled_v12000 encode = EncodeFn();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(parts)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(k) * 2,
                                 static_cast<cuuint64_t>(k) * 2 * static_cast<cuuint64_t>(rows)};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(kStepK), static_cast<cuuint32_t>(box_rows), 1};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r =
      encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<uint16_t*>(data), dims, strides,
             box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// The head transform is the identity up to the GEMM's zero sign (no bias, scale, softcap or
// temperature): the statistics run on the accumulators as they are.
bool Plain(const LoadTransform& t) {
  return t.bias == nullptr && t.scale == 1.0f && t.softcap <= 0.0f && t.temperature == 1.0f;
}

// A launch of `clusters` clusters of `size` CTAs: the occupancy probe (one cluster) and the launch
// use the same configuration.
struct ClusterLaunch {
  cudaLaunchAttribute attr{};
  cudaLaunchConfig_t cfg{};
  ClusterLaunch(int size, int clusters, int smem, cudaStream_t stream) {
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = static_cast<unsigned>(size);
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.gridDim = dim3(static_cast<unsigned>(clusters * size));
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = static_cast<size_t>(smem);
    cfg.stream = stream;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;  // cfg points at attr
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;
};

template <bool kPair, bool kGeneral, int kCM, int kCN>
cudaError_t Launch(const CUtensorMap (&maps)[4], Params p, cudaStream_t stream) {
  auto kernel = HiddenStatsKernel<kPair, kGeneral, kCM, kCN>;
  constexpr int kSmem = SmemBytes();
  constexpr int kClusterSize = kCM * kCN;
  // Once per instantiation and device: the shared-memory opt-in and the clusters that fit.
  constexpr int kMaxDevices = 64;
  static std::atomic<int> max_clusters[kMaxDevices];
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device >= kMaxDevices) return cudaErrorInvalidDevice;
  int fit = max_clusters[device].load(std::memory_order_relaxed);
  if (fit == 0) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (err != cudaSuccess) return err;
    if (kClusterSize > 1) {
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
      if (err != cudaSuccess) return err;
    }
    ClusterLaunch probe(kClusterSize, 1, kSmem, nullptr);
    err = cudaOccupancyMaxActiveClusters(&fit, kernel, &probe.cfg);
    if (err != cudaSuccess) return err;
    if (fit <= 0) return cudaErrorInvalidConfiguration;
    max_clusters[device].store(fit, std::memory_order_relaxed);
  }
  const int clusters = std::min(fit, p.items);
  ClusterLaunch launch(kClusterSize, clusters, kSmem, stream);
  err = cudaLaunchKernelEx(&launch.cfg, kernel, maps[0], maps[1], maps[2], maps[3], p);
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

template <bool kPair, bool kGeneral>
cudaError_t LaunchCluster(HiddenCluster c, const CUtensorMap (&maps)[4], const Params& p,
                          cudaStream_t stream) {
  switch (c) {
    case HiddenCluster::k1x1:
      return Launch<kPair, kGeneral, 1, 1>(maps, p, stream);
    case HiddenCluster::k2x1:
      return Launch<kPair, kGeneral, 2, 1>(maps, p, stream);
    case HiddenCluster::k1x2:
      return Launch<kPair, kGeneral, 1, 2>(maps, p, stream);
    case HiddenCluster::k2x2:
      return Launch<kPair, kGeneral, 2, 2>(maps, p, stream);
  }
  return cudaErrorInvalidValue;
}

int ClusterRows(HiddenCluster c) {
  return c == HiddenCluster::k2x1 || c == HiddenCluster::k2x2 ? 2 : 1;
}
int ClusterBlocks(HiddenCluster c) {
  return c == HiddenCluster::k1x2 || c == HiddenCluster::k2x2 ? 2 : 1;
}

bool OperandOk(const HiddenOperand& o) {
  return o.x != nullptr && o.w != nullptr && o.k_pad > 0 && o.k_pad % 8 == 0 && o.x_parts >= 1 &&
         o.x_parts <= 3 && o.w_parts >= 1 && o.w_parts <= 3 && o.x_rows > 0 && o.w_rows > 0 &&
         reinterpret_cast<uintptr_t>(o.x) % 16 == 0 && reinterpret_cast<uintptr_t>(o.w) % 16 == 0 &&
         o.x_rows <= INT_MAX && o.w_rows <= INT_MAX;
}

}  // namespace

cudaError_t LaunchHiddenStats(const HiddenOperand& a, const HiddenOperand* b,
                              const HiddenStatsArgs& args, cudaStream_t stream) {
  if (args.rows <= 0 || args.cols <= 0) return cudaSuccess;
  if (!OperandOk(a) || (b != nullptr && !OperandOk(*b))) return cudaErrorInvalidValue;
  if (args.w_row0 % kVocabBlock != 0 || args.col0 % kVocabBlock != 0 || args.w_row0 < 0 ||
      args.w_row0 + args.cols > INT_MAX) {
    return cudaErrorInvalidValue;
  }
  if (args.rows > a.x_rows || (b != nullptr && args.rows > b->x_rows)) {
    return cudaErrorInvalidValue;
  }
  const int cm = ClusterRows(args.cluster), cn = ClusterBlocks(args.cluster);
  Params p;
  p.args = args;
  if (b == nullptr) p.args.logits_b = nullptr;
  p.w_row0 = static_cast<int32_t>(args.w_row0);
  const int64_t blocks = (args.cols + kVocabBlock - 1) / kVocabBlock;
  const int64_t row_tiles = (args.rows + kTileRows - 1) / kTileRows;
  const int64_t row_units = (row_tiles + cm - 1) / cm;
  const int64_t block_units = (blocks + cn - 1) / cn;
  if (row_units * block_units > INT_MAX) return cudaErrorInvalidConfiguration;
  p.blocks = static_cast<int32_t>(blocks);
  p.row_units = static_cast<int32_t>(row_units);
  p.block_units = static_cast<int32_t>(block_units);
  p.group_units = std::max(1, kGroupRows / (kTileRows * cm));
  p.items = static_cast<int32_t>(row_units * block_units);
  auto steps = [](const HiddenOperand& o, int32_t* ksteps) {
    *ksteps = static_cast<int32_t>((o.k_pad + kStepK - 1) / kStepK);
    return *ksteps * o.x_parts * o.w_parts;
  };
  p.steps_a = steps(a, &p.ksteps_a);
  p.wparts_a = a.w_parts;
  p.ta = a.transform;
  if (b != nullptr) {
    p.steps_b = steps(*b, &p.ksteps_b);
    p.wparts_b = b->w_parts;
    p.tb = b->transform;
  }
  if (args.stats == nullptr ||
      (args.ids_per_row > 0 && (args.ids == nullptr || args.targets == nullptr))) {
    return cudaErrorInvalidValue;
  }

  CUtensorMap maps[4];
  cudaError_t err = EncodeOperand(&maps[0], a.x, a.k_pad, a.x_rows, a.x_parts, kTileRows / cn);
  if (err == cudaSuccess) {
    err = EncodeOperand(&maps[1], a.w, a.k_pad, a.w_rows, a.w_parts, kTileCols / cm);
  }
  if (err == cudaSuccess && b != nullptr) {
    err = EncodeOperand(&maps[2], b->x, b->k_pad, b->x_rows, b->x_parts, kTileRows / cn);
    if (err == cudaSuccess) {
      err = EncodeOperand(&maps[3], b->w, b->k_pad, b->w_rows, b->w_parts, kTileCols / cm);
    }
  } else if (err == cudaSuccess) {
    maps[2] = maps[0];
    maps[3] = maps[1];
  }
  if (err != cudaSuccess) return err;
  const bool general = !Plain(a.transform) || (b != nullptr && !Plain(b->transform));
  if (b != nullptr) {
    return general ? LaunchCluster<true, true>(args.cluster, maps, p, stream)
                   : LaunchCluster<true, false>(args.cluster, maps, p, stream);
  }
  return general ? LaunchCluster<false, true>(args.cluster, maps, p, stream)
                 : LaunchCluster<false, false>(args.cluster, maps, p, stream);
}

bool HiddenStatsSupported() {
#if defined(LOGITSERVE_HAVE_SM90A)
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    return false;
  }
  if (major != 9 || minor != 0 || EncodeFn() == nullptr) return false;
  cudaFuncAttributes attr;
  if (cudaFuncGetAttributes(&attr, HiddenStatsKernel<true, false, 1, 1>) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return true;
#else
  return false;  // the build has no sm_90a code
#endif
}

}  // namespace logitserve::kernels::cuda
