// CUDA kernels: host launchers only. Every pointer is device memory on the current device unless
// a comment says otherwise; the caller owns all memory (these functions never allocate) and
// passes the stream. Each launcher returns the launch's cudaError_t (errors of the kernel itself
// surface at the next synchronisation, as usual in CUDA).
//
// The math is block_stats.h's: per (row, vocabulary block of kVocabBlock ids) a statistics record
// laid out exactly as the CPU's (BlockStats / PairBlockStats), folded in global block order with
// FoldBlock / FoldPairBlock, finished with LogProb / Entropy / KlAB / KlBA.
//
// Determinism: every reduction has a fixed shape. The statistics and JSD kernels give one warp
// one block of one row: element e of chunk j of lane l is id j * 256 + 8 l + e of the block, each
// lane adds its 64 values in (j, e) order into two accumulators (even / odd e), and lanes combine
// with a fixed xor butterfly (kernels/cuda/lane_block.cuh); the fused statistics + top-k kernel
// computes its records with the same functions, so they have the same bits. Nothing depends on the
// grid size, the row count, the shard layout or the input dtype (every input is converted exactly
// to fp32 first). Top-k uses a strict total order (Better), so its result is unique whatever order
// candidates are seen in.
//
// Exponentials: ex2.approx.ftz(x * log2(e)) on clamped, non-positive x: the instruction behind
// exp2f, accurate to 2 ulp (CUDA C Programming Guide, "Mathematical Functions"), flushing results
// below 2^-126 (terms 2^-126 of the block maximum's weight 1); the pre-scale rounds the argument by
// |x| u, which moves a term exp(x) by |x| exp(x) u <= u / e relative to the block maximum's weight,
// far inside the fp32 sum's own rounding. __expf / -use_fast_math are not used: their error grows
// with |x|. Logarithms are logf (1 ulp). The build compiles these kernels with --fmad=false, so no
// multiply-add is contracted behind the source's back (the CPU build uses -ffp-contract=off for the
// same reason); fused multiply-adds are written as fmaf where wanted.
//
// Thread safety: launchers are stateless; concurrent calls on different streams are fine.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "logitserve/kernels/block_stats.h"
#include "logitserve/kernels/cpu_kernels.h"  // TopKEntry, Better, kMaxTopK (shared definitions)
#include "logitserve/kernels/dtype.h"
#include "logitserve/kernels/logit_transform.h"
#include "logitserve/kernels/row_finisher.h"
#include "logitserve/kernels/tile_message.h"

namespace logitserve::kernels::cuda {

// One CTA reads one vocabulary block: kBlockThreads threads x kElemsPerThread elements.
inline constexpr int kBlockThreads = 256;
inline constexpr int kElemsPerThread = 8;
static_assert(kBlockThreads * kElemsPerThread == kVocabBlock, "one CTA covers one block");

// Most ranks (vocabulary shards) a fold can combine.
inline constexpr int kMaxRanks = 16;

// The logit transform applied while loading (logit_transform.h). LoadTransform is the name the
// CUDA loaders use for it.
using LoadTransform = ::logitserve::kernels::LogitTransform;

// One distribution's logits for a range of vocabulary ids, as the kernels read them: element
// (r, c) of `data` is the logit of row r (tile-local) and vocabulary id col0 + c. Columns past
// `cols` read as -inf (masked). 16-byte vector loads are used when data and ld allow them.
struct LogitsSource {
  FloatType type = FloatType::kFloat32;
  const void* data = nullptr;
  int64_t ld = 0;    // elements between consecutive rows
  int64_t col0 = 0;  // global vocabulary id of column 0: a multiple of kVocabBlock
  int64_t cols = 0;  // valid columns
  LoadTransform transform;
  int64_t blocks() const { return (cols + kVocabBlock - 1) / kVocabBlock; }
};

// Target ids whose logits a statistics launch also writes (LaunchGatherTargets's outputs, from
// the values it loads anyway). `ids` are tile-local, as for LaunchGatherTargets.
struct TargetsOut {
  const int32_t* ids = nullptr;
  int32_t ids_per_row = 0;
  float* targets = nullptr;
};

// Block statistics of `rows` rows over every block of `a` (and `b`, when not null: the pair
// statistics with KL cross terms and support-mismatch flags, both distributions over the same
// ids). Record of (row r, source block j) goes to stats[r * stats_ld + stats_offset + j].
// Single mode writes b = EmptyBlockStats() and zero cross terms. With `targets` (fp32 sources
// only, e.g. hidden mode's GEMM output), also what LaunchGatherTargets(a, rows, ...) writes, bit
// for bit, without its launch.
cudaError_t LaunchBlockStats(const LogitsSource& a, const LogitsSource* b, int64_t rows,
                             PairBlockStats* stats, int64_t stats_ld, int64_t stats_offset,
                             cudaStream_t stream, const TargetsOut& targets = {});

// For every row r < rows and j < ids_per_row whose id = ids[r * ids_per_row + j] lies in the
// source's columns: targets[r * ids_per_row + j] = the logit z (after the transform). Other
// entries are left untouched. `ids` are tile-local (the caller offsets the pointer).
cudaError_t LaunchGatherTargets(const LogitsSource& a, int64_t rows, const int32_t* ids,
                                int32_t ids_per_row, float* targets, cudaStream_t stream);

// Offers every column of `a` to each row's running top-k list: lists[r * k .. r * k + k) holds
// counts[r] entries, best first (Better); zero counts start empty lists. k <= kMaxTopK. `scratch`
// holds TopKScratchBytes(rows, a.blocks()) bytes of device memory (the lanes' maxima).
cudaError_t LaunchTopKUpdate(const LogitsSource& a, int64_t rows, int32_t k, TopKEntry* lists,
                             int32_t* counts, float* scratch, cudaStream_t stream);
size_t TopKScratchBytes(int64_t rows, int64_t blocks);

// LaunchBlockStats(a, b, ...) and LaunchTopKUpdate(a, ...) together; a single source (b null) is
// read once for both (topk_kernel.cu), with the records' bits of LaunchBlockStats.
cudaError_t LaunchBlockStatsTopK(const LogitsSource& a, const LogitsSource* b, int64_t rows,
                                 PairBlockStats* stats, int64_t stats_ld, int64_t stats_offset,
                                 int32_t k, TopKEntry* lists, int32_t* counts, float* scratch,
                                 cudaStream_t stream);

// LaunchBlockStatsTopK in its two halves, for a caller that runs them on different streams (the
// CUDA backend's row-tile pipeline: the second half of tile t runs while the first half of tile
// t + 1 reads the logits). LaunchTopKLaneMax writes the statistics (when `stats` is not null; of
// the pair when b is not null) and the lane maxima of `a` into `scratch`; LaunchTopKSelect, queued
// after it (and after counts are set as for LaunchTopKUpdate), reads `scratch` and `a` again and
// updates the lists. Together they give LaunchBlockStatsTopK's results, bit for bit (they are its
// body). `scratch` must stay untouched between the two.
cudaError_t LaunchTopKLaneMax(const LogitsSource& a, const LogitsSource* b, int64_t rows,
                              PairBlockStats* stats, int64_t stats_ld, int64_t stats_offset,
                              int32_t k, float* scratch, cudaStream_t stream);
cudaError_t LaunchTopKSelect(const LogitsSource& a, int64_t rows, int32_t k, TopKEntry* lists,
                             int32_t* counts, const float* scratch, cudaStream_t stream);

// What one rank contributes per row tile (tile_message.h, shared with the CPU backend).
using ::logitserve::kernels::MakeTileMessage;
using ::logitserve::kernels::TileMessage;

// The vocabulary layout in blocks: rank r owns global blocks [begin[r], begin[r + 1]), ranks in
// order, contiguous (a rank may own none).
struct ShardBlocks {
  int32_t ranks = 1;
  int32_t begin[kMaxRanks + 1] = {};
};

// The gathered messages of every rank for one row tile.
struct GatheredTile {
  const uint8_t* messages = nullptr;
  TileMessage layout;
  ShardBlocks shards;
  int64_t num_blocks = 0;  // global
  bool pair = false;       // records hold pair statistics (a reference distribution is present)
};

// Folded statistics per tile row, for the JSD pass: a = model, b = reference (b unused unless
// pair). Either may be null.
struct FoldedRows {
  RowStats* a = nullptr;
  RowStats* b = nullptr;
};

// Job-wide outputs (row_finisher.h), device memory, indexed by global row (tile row + row0).
using ::logitserve::kernels::RowOutputs;

// One thread per row: folds the gathered records in global block order (FoldBlock /
// FoldPairBlock), stores the folded rows, records the first global row whose model (index 0) or
// reference (index 1) distribution holds NaN / +inf with atomicMin into first_bad_row, and, when
// `outputs` is not null, writes every requested output (top-k merged across ranks).
cudaError_t LaunchFoldRows(const GatheredTile& tile, int64_t rows, int64_t row0, FoldedRows folded,
                           int32_t* first_bad_row, const RowOutputs* outputs, cudaStream_t stream);

// JSD second pass, 0 < beta < 1: for each (row, block of s / t), the sum of the JSD_beta terms of
// student s and teacher t normalised by their folded rows (the CPU's CpuJsdBlock formula).
// partial of (row r, source block j) goes to partials[r * partials_ld + partials_offset + j];
// rows where either side is all-masked get 0.
cudaError_t LaunchJsdPartials(const LogitsSource& s, const LogitsSource& t, int64_t rows,
                              const RowStats* folded_s, const RowStats* folded_t, float beta,
                              float* partials, int64_t partials_ld, int64_t partials_offset,
                              cudaStream_t stream);

// Sums each row's gathered JSD partials (rank r's at partials + r * rank_stride, laid out as
// above with partials_ld) in global block order into jsd[row0 + r]; NaN where either side is
// all-masked.
cudaError_t LaunchJsdFinish(const float* partials, size_t rank_stride, int64_t partials_ld,
                            const ShardBlocks& shards, int64_t num_blocks, const RowStats* folded_s,
                            const RowStats* folded_t, int64_t rows, int64_t row0, float* jsd,
                            cudaStream_t stream);

// ---- bf16 splitting (the hidden-mode GEMM's exact inputs) -----------------------------------
//
// An fp32 value x is split as x = hi + mid + lo, each a bf16 (8 significant bits): hi = x with its
// low 16 bits cleared (truncation never overflows), mid = the same of x - hi (exact in fp32), lo =
// x - hi - mid (at most 8 significant bits left: exact in bf16). bf16 values need one part, fp16
// values two (11 significant bits), fp32 three. Products of bf16 parts are exact in the tensor
// cores, so a GEMM over parts computes the same dot product as an fp32 GEMM on the exact values.
// A value that needs fewer parts than given has zero trailing parts; adding those GEMMs changes no
// bit, which is what makes hidden mode give the same bits for bf16, fp16 and fp32 inputs of equal
// value. Non-finite values go into hi alone (NaN stays NaN, inf stays inf).
inline constexpr int PartsFor(FloatType t) {
  return t == FloatType::kBFloat16 ? 1 : (t == FloatType::kFloat16 ? 2 : 3);
}

// dst part p, element (r, c) at dst[p * part_stride + r * dst_ld + c], for r < dst_rows, c <
// dst_ld: the split of src (r, c) (element at src_ld * r + c, of `type`) when r < rows and c <
// cols, else 0. `parts` <= 3 (parts < PartsFor(type) drops the low parts: only for exact inputs).
cudaError_t LaunchSplitToBf16(FloatType type, const void* src, int64_t src_ld, int64_t rows,
                              int64_t cols, int parts, uint16_t* dst, int64_t dst_rows,
                              int64_t dst_ld, size_t part_stride, cudaStream_t stream);

// ---- Hidden mode on Hopper: the GEMM with the statistics in its epilogue ---------------------
//
// logits = x . W^T on the tensor cores (sm_90a: wgmma, bulk tensor copies), reduced to the block
// records of LaunchBlockStats straight from the fp32 accumulators (hidden_stats_kernel.cu says how
// and why the bits are batch-, layout- and dtype-invariant). The records are the same statistics
// as LaunchBlockStats over the GEMM's output, summed in another order (so they agree to rounding,
// not bit for bit); a backend uses one or the other for every hidden-mode job, never both.

// One distribution's operands: hidden states and head shard as exact bf16 parts
// (LaunchSplitToBf16's layout), zero-padded to k_pad columns. The launch reads x rows [0, rows)
// and weight rows [w_row0, w_row0 + cols); reads past x_rows / w_rows are zeros.
struct HiddenOperand {
  const uint16_t* x = nullptr;  // x_parts x [x_rows][k_pad], 16-byte aligned
  int x_parts = 1;
  int64_t x_rows = 0;
  const uint16_t* w = nullptr;  // w_parts x [w_rows][k_pad]: weight row = vocabulary column
  int w_parts = 1;
  int64_t w_rows = 0;
  int64_t k_pad = 0;  // a multiple of 8
  // The head transform and temperature; its bias is indexed from the launch's first column.
  LoadTransform transform;
};

// CTAs per cluster sharing operand tiles by multicast: rows x blocks.
enum class HiddenCluster { k1x1, k2x1, k1x2, k2x2 };

struct HiddenStatsArgs {
  int64_t rows = 0;    // token rows
  int64_t w_row0 = 0;  // first weight row of the launch, a multiple of kVocabBlock
  int64_t col0 = 0;    // its global vocabulary id, a multiple of kVocabBlock
  int64_t cols = 0;    // columns; those past it (to the end of the last block) are masked
  // Record of (row r, launch block j) at stats[r * stats_ld + stats_offset + j] (the pair form's
  // a = model, b = reference; the single form writes b = EmptyBlockStats()).
  PairBlockStats* stats = nullptr;
  int64_t stats_ld = 0;
  int64_t stats_offset = 0;
  // As LaunchGatherTargets: targets[r * ids_per_row + q] = z of global id ids[r * ids_per_row + q]
  // when the launch's columns hold it (after the model's transform); other entries untouched.
  const int32_t* ids = nullptr;
  int32_t ids_per_row = 0;
  float* targets = nullptr;
  // Optional: the raw products (before the transform) of valid rows and columns, for a pass that
  // reads the logits again (top-k, JSD): element (r, c) at logits[r * logits_ld + c]; logits_ld
  // even, pointers 8-byte aligned.
  float* logits_a = nullptr;
  float* logits_b = nullptr;
  int64_t logits_ld = 0;
  HiddenCluster cluster = HiddenCluster::k2x2;
};

// The pair form when b is not null (a = model, b = reference, the same columns), else the single
// form of a.
cudaError_t LaunchHiddenStats(const HiddenOperand& a, const HiddenOperand* b,
                              const HiddenStatsArgs& args, cudaStream_t stream);

// True when the current device runs LaunchHiddenStats (compute capability 9.0, the binary built
// with its sm_90a code, the driver's tensor-map encoder present).
bool HiddenStatsSupported();

// ---- Utilities -------------------------------------------------------------------------------

// Reads `bytes` (a multiple of 16, 16-byte aligned) once with 16-byte loads and writes one word
// per CTA to `sink` (>= 1024 words) so the reads cannot be optimised away: the read floor that
// benchmarks compare with.
cudaError_t LaunchReadFloor(const void* data, size_t bytes, uint32_t* sink, cudaStream_t stream);

// cudaSuccess when the current device can run these kernels; cudaErrorNoKernelImageForDevice (or
// cudaErrorInvalidDeviceFunction) when the binary holds no code for its architecture.
cudaError_t CheckKernelImage();

// ---- Fault injection (tests of the backend's fatal-error paths only) -------------------------

// One thread busy-waits on the device for `nanoseconds` (%globaltimer): a stream that makes no
// progress for that long, as a collective waiting for a peer that never comes would.
cudaError_t LaunchTestStall(uint64_t nanoseconds, cudaStream_t stream);
// One thread stores through `target` (tests pass nullptr): a real cudaErrorIllegalAddress, a
// sticky error that leaves the device's context unusable for the rest of the process.
cudaError_t LaunchTestIllegalStore(int* target, cudaStream_t stream);

}  // namespace logitserve::kernels::cuda
