// CpuBackend: the always-built backend. Same algorithm, block structure and tile loop
// (server/backend/sharded_job.h) as the CUDA backend:
//
//   for each tile of kRowTile rows (kGemmRows for JSD in hidden mode, see tile_rows_):
//     each shard (a rank, in its own thread) computes per-block statistics of its vocabulary
//       blocks (OpenMP workers; logits mode: over rows, each row's blocks in order; hidden mode:
//       over items (block, kGemmRows rows of the tile), a block's items consecutive, each the
//       item's oneDNN GEMMs (cpu_hidden.h: bf16 parts or fp32) into a cache-sized logits tile,
//       transform applied, statistics read back while it is hot);
//     ranks all-gather the small per-block records through the Communicator;
//     every rank folds the records in global block order (identical bits on every rank);
//     JSD only: a second pass over the tile with the global normalisation, partials all-gathered
//       and summed in global block order.
//
// Nothing of size [N, V] is ever allocated: per rank the largest buffers are one row tile of
// logits (hidden mode with JSD) and the per-block records.
#include "server/backend/cpu/cpu_backend.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/base/status_macros.h"
#include "common/base/thread_name.h"
#include "logitserve/kernels/block_stats.h"
#include "logitserve/kernels/cpu_kernels.h"
#include "logitserve/kernels/row_finisher.h"
#include "logitserve/kernels/tile_message.h"
#include "server/backend/backend.h"
#include "server/backend/communicator.h"
#include "server/backend/cpu/cpu_hidden.h"
#include "server/backend/cpu/cpu_tile_gemm.h"
#include "server/backend/job_failure.h"
#include "server/backend/shard_layout.h"
#include "server/backend/sharded_job.h"

namespace logitserve {
namespace {

namespace k = kernels;

// Asks the caches for n floats at p. A row's block in logits mode is 8 KB of its own, 4 * V bytes
// from the previous row's: the hardware prefetchers restart at every row (and every page), and
// the statistics then wait for memory.
void Prefetch(const float* p, int64_t n) {
  constexpr int64_t kLine = 64 / sizeof(float);
  for (int64_t i = 0; i < n; i += kLine) __builtin_prefetch(p + i);
}

// What a work item needs besides its inputs, per OpenMP thread and kept across tiles and jobs
// (libgomp keeps its threads): logits of one GEMM's rows per distribution and the GEMMs' buffers.
// Grown on first use to a few MB a thread, never shrunk: allocating them per
// tile cost page faults and zeroing of 2-8 MB a tile, 5-15 % of a logits-mode job (perf).
struct ItemBuffers {
  std::vector<float> scratch_m, scratch_r;
  GemmBuffers gemm;

  static ItemBuffers& OfThisThread(bool pair) {
    thread_local ItemBuffers b;
    const size_t n = static_cast<size_t>(kGemmRows * k::kVocabBlock);
    b.scratch_m.resize(n);
    if (pair) b.scratch_r.resize(n);
    return b;
  }
};

// The calling thread's default OpenMP team size (the nthreads-var that oneDNN's own parallel
// regions take) while in scope; the caller's value comes back after. With one thread a rank
// (--threads 1, or as many shards as threads) the rank's regions run inactive, so oneDNN's inside
// them were the active level and started a team of every core each time: new threads for every
// GEMM (strace: 170 clone3 calls for 40 hidden-mode calls of 1024 rows with --threads 1 on 2
// cores), on cores the rank was not given.
class OmpTeamSize {
 public:
  explicit OmpTeamSize(int threads) : before_(omp_get_max_threads()) {
    omp_set_num_threads(threads);
  }
  ~OmpTeamSize() { omp_set_num_threads(before_); }
  OmpTeamSize(const OmpTeamSize&) = delete;
  OmpTeamSize& operator=(const OmpTeamSize&) = delete;

 private:
  const int before_;
};

// Everything a rank needs for one job.
struct RankContext {
  const ScoreJob* job;
  ScoreResult* result;  // written by rank 0 only
  Communicator* comm;
  JobFailure* failure;  // shared by the job's ranks
  const std::vector<ShardRange>* layout;
  int threads;
};

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const CpuBackendOptions& options) : options_(options) {
    if (options_.threads <= 0) {
      options_.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    }
    // oneDNN is called from inside our OpenMP workers: nested regions must run serially.
    omp_set_max_active_levels(1);
  }

  std::string name() const override { return "cpu"; }

  std::vector<ShardRange> ShardLayout(int64_t vocab) const override {
    return MakeShardLayout(vocab, options_.shards, options_.shard_weights);
  }

  absl::StatusOr<std::shared_ptr<const PreparedHead>> PrepareHead(
      std::shared_ptr<const HeadWeights> weights) override;

  absl::Status Score(const ScoreJob& job, ScoreResult* result) override;

 private:
  CpuBackendOptions options_;
};

absl::StatusOr<std::shared_ptr<const PreparedHead>> CpuBackend::PrepareHead(
    std::shared_ptr<const HeadWeights> weights) {
  const GemmPrecision precision = options_.gemm == CpuGemm::kAuto && CpuHasNativeBf16Gemm()
                                      ? GemmPrecision::kBf16
                                      : GemmPrecision::kFp32;
  const OmpTeamSize team(options_.threads);  // the weights' packing too, on --threads
  LOGITSERVE_ASSIGN_OR_RETURN(auto head,
                              PrepareCpuHead(std::move(weights), precision, options_.threads));
  return std::shared_ptr<const PreparedHead>(std::move(head));
}

// ---- One rank's work ---------------------------------------------------------------------

// One shard's part of a job, on its own thread: the tile loop's hooks (sharded_job.h).
class RankWorker final : public ShardedRank {
 public:
  explicit RankWorker(const RankContext& ctx)
      : ctx_(ctx),
        job_(*ctx.job),
        rank_(ctx.comm->rank()),
        shard_((*ctx.layout)[static_cast<size_t>(rank_)]),
        block_begin_(shard_.begin / k::kVocabBlock),
        num_blocks_((shard_.end - shard_.begin + k::kVocabBlock - 1) / k::kVocabBlock),
        with_ref_(job_.NeedsReference()),
        jsd_pass_(job_.jsd_beta.has_value() && *job_.jsd_beta > 0.0f && *job_.jsd_beta < 1.0f),
        keep_logits_(jsd_pass_ && (job_.model.hidden_mode() || job_.reference.hidden_mode())),
        tile_rows_(keep_logits_ ? kGemmRows : kRowTile),
        msg_(k::MakeTileMessage(tile_rows_, MaxBlocks(*ctx.layout), job_.top_k, job_.ids_per_row)) {
  }

  absl::Status Run();

 private:
  // Whether a tile of `rows` rows takes whole rows as its work items (each row's blocks in order
  // on one thread): when the rows go round the threads twice at least. A shorter tile (a short
  // request) takes items of one block, which spread its blocks over the threads.
  bool RowsGoRound(int64_t rows) const { return rows >= 2 * static_cast<int64_t>(ctx_.threads); }

  static int64_t MaxBlocks(const std::vector<ShardRange>& layout) {
    int64_t m = 0;
    for (const auto& s : layout)
      m = std::max(m, (s.end - s.begin + k::kVocabBlock - 1) / k::kVocabBlock);
    return m;
  }

  // Logits mode: block `block` of global row `row` as fp32, in place when it is fp32 without a
  // temperature, else converted into `scratch` (kVocabBlock floats).
  const float* RowBlock(const DistributionInput& in, int64_t row, int64_t block,
                        float* scratch) const;
  // fp32 logits of rows [row0 + g kGemmRows, + rows) (rows <= kGemmRows) of global block `block`
  // for one distribution, for the row tile starting at row0. Logits mode: pointers into the
  // request (fp32, temperature 1) or converted copies in `scratch`. Hidden mode: the GEMM into
  // `scratch` (ld = kVocabBlock) + transform.
  absl::Status BlockLogits(const DistributionInput& in, const HiddenTile& hidden_tile, int64_t row0,
                           int g, int64_t rows, int64_t block, float* scratch, GemmBuffers* gemm,
                           std::vector<const float*>* row_ptrs) const;
  void ConvertHiddenTile(const DistributionInput& in, int64_t row0, int64_t rows,
                         HiddenTile* tile) const {
    tile->Convert(in.hidden, static_cast<const CpuHead&>(*in.head).precision(), row0, rows,
                  ctx_.threads);
  }
  // ShardedRank.
  absl::Status ComputeTile(int64_t row0, int64_t rows) override;
  absl::Status Exchange(TileExchange what) override;
  absl::Status FoldTile(int64_t row0, int64_t rows) override;
  absl::Status JsdTile(int64_t row0, int64_t rows) override;
  absl::Status JsdFinish(int64_t row0, int64_t rows) override;

  const RankContext& ctx_;
  const ScoreJob& job_;
  const int rank_;
  const ShardRange shard_;
  const int64_t block_begin_;
  const int64_t num_blocks_;
  const bool with_ref_;
  const bool jsd_pass_;
  // JSD with a hidden-mode side: the tile's logits are kept for the second pass rather than
  // recomputed (one [tile_rows_, V_shard] buffer per distribution).
  const bool keep_logits_;
  // Rows of a tile: kRowTile, or one GEMM's when the tile's logits are kept (half the memory;
  // the GEMMs, and so the bits, are the same).
  const int64_t tile_rows_;
  const k::TileMessage msg_;  // what this rank sends per row tile (padded to the widest shard)

  std::vector<uint8_t> send_, recv_;
  // JSD partials [tile_rows_, max_blocks]: own, gathered.
  std::vector<float> partial_, partial_all_;
  HiddenTile hidden_model_, hidden_ref_;
  std::vector<float> keep_model_, keep_ref_;  // hidden mode + JSD: tile logits [rows, V_shard]
  std::vector<k::RowStats> model_rows_, ref_rows_;  // folded per row of the tile
  std::vector<k::PairRowStats> pair_rows_;
};

const float* RankWorker::RowBlock(const DistributionInput& in, int64_t row, int64_t block,
                                  float* scratch) const {
  const int64_t col0 = block * k::kVocabBlock;
  const int64_t es = k::SizeOf(in.logits.type);
  const uint8_t* src = static_cast<const uint8_t*>(in.logits.data) + (row * job_.vocab + col0) * es;
  if (in.logits.type == k::FloatType::kFloat32 && in.temperature == 1.0f) {
    return reinterpret_cast<const float*>(src);
  }
  k::CpuToFloat(in.logits.type, src, BlockWidth(job_.vocab, block), in.temperature, scratch);
  return scratch;
}

absl::Status RankWorker::BlockLogits(const DistributionInput& in, const HiddenTile& hidden_tile,
                                     int64_t row0, int g, int64_t rows, int64_t block,
                                     float* scratch, GemmBuffers* gemm,
                                     std::vector<const float*>* row_ptrs) const {
  const int64_t vocab = job_.vocab;
  const int64_t col0 = block * k::kVocabBlock;
  const int64_t n = BlockWidth(vocab, block);
  row_ptrs->resize(static_cast<size_t>(rows));
  if (!in.hidden_mode()) {
    for (int64_t r = 0; r < rows; ++r) {
      (*row_ptrs)[static_cast<size_t>(r)] =
          RowBlock(in, row0 + g * kGemmRows + r, block, scratch + r * k::kVocabBlock);
    }
    return absl::OkStatus();
  }
  const auto& head = static_cast<const CpuHead&>(*in.head);
  LOGITSERVE_RETURN_IF_ERROR(BlockGemm(head, hidden_tile, g, block, vocab, scratch, gemm));
  k::LogitTransform t = HeadLogitTransform(head.weights().transform, in.temperature);
  t.bias = head.bias.empty() ? nullptr : head.bias.data() + col0;
  for (int64_t r = 0; r < rows; ++r) {
    float* z = scratch + r * k::kVocabBlock;
    k::CpuApplyTransform(t, z, n);
    (*row_ptrs)[static_cast<size_t>(r)] = z;
  }
  return absl::OkStatus();
}

absl::Status RankWorker::ComputeTile(int64_t row0, int64_t rows) {
  std::fill(send_.begin(), send_.end(), 0);
  auto* stats = reinterpret_cast<k::PairBlockStats*>(send_.data() + msg_.stats_offset);
  auto* topk = reinterpret_cast<k::TopKEntry*>(send_.data() + msg_.topk_offset);
  auto* counts = reinterpret_cast<int32_t*>(send_.data() + msg_.count_offset);
  auto* targets = reinterpret_cast<float*>(send_.data() + msg_.target_offset);
  for (int64_t i = 0; i < tile_rows_ * msg_.max_blocks; ++i) {
    stats[i] = k::PairBlockStats{k::EmptyBlockStats(), k::EmptyBlockStats(), 0.0f, 0.0f};
  }

  if (job_.model.hidden_mode()) ConvertHiddenTile(job_.model, row0, rows, &hidden_model_);
  if (with_ref_ && job_.reference.hidden_mode())
    ConvertHiddenTile(job_.reference, row0, rows, &hidden_ref_);

  const int64_t k_top = job_.top_k;
  const int64_t shard_width = shard_.end - shard_.begin;
  // Logits mode goes row by row (below) when the rows go round the threads; a shorter tile takes
  // the hidden-mode items.
  const bool by_rows = !job_.model.hidden_mode() && !(with_ref_ && job_.reference.hidden_mode()) &&
                       RowsGoRound(rows);
  // Per-block top-k lists, merged per row after the parallel loop. (Row by row, a row's blocks,
  // in order on one thread, go straight to the row's list.)
  const bool block_lists = k_top > 0 && !by_rows;
  std::vector<k::TopKEntry> block_topk(
      static_cast<size_t>(block_lists ? rows * num_blocks_ * k_top : 0));
  std::vector<int> block_counts(static_cast<size_t>(block_lists ? rows * num_blocks_ : 0), 0);

  // Everything of (tile row r, local block lb) given its fp32 logits a (and the reference's b).
  auto row_block = [&](int64_t r, int64_t lb, const float* a, const float* b) {
    const int64_t col0 = (block_begin_ + lb) * k::kVocabBlock;
    const int64_t n = BlockWidth(job_.vocab, block_begin_ + lb);
    k::PairBlockStats& st = stats[r * msg_.max_blocks + lb];
    if (with_ref_) {
      st = k::CpuPairBlockStats(a, b, n);
    } else {
      st.a = k::CpuBlockStats(a, n);
    }
    if (block_lists) {
      const size_t off = static_cast<size_t>((r * num_blocks_ + lb));
      k::CpuTopKBlock(a, n, static_cast<int32_t>(col0), static_cast<int>(k_top),
                      block_topk.data() + off * k_top, &block_counts[off]);
    } else if (k_top > 0) {
      k::CpuTopKBlock(a, n, static_cast<int32_t>(col0), static_cast<int>(k_top), topk + r * k_top,
                      &counts[r]);
    }
    for (int64_t j = 0; j < job_.ids_per_row; ++j) {
      const int32_t id = job_.target_ids[static_cast<size_t>((row0 + r) * job_.ids_per_row + j)];
      if (id >= col0 && id < col0 + n) targets[r * job_.ids_per_row + j] = a[id - col0];
    }
    if (keep_logits_) {
      std::memcpy(keep_model_.data() + r * shard_width + (col0 - shard_.begin), a,
                  n * sizeof(float));
      std::memcpy(keep_ref_.data() + r * shard_width + (col0 - shard_.begin), b, n * sizeof(float));
    }
  };

  if (by_rows) {
    // Logits mode: rows are the work items, each row's blocks in order. A row is V contiguous
    // values, so the hardware prefetchers stream it; 16-bit logits are converted a block at a
    // time into a per-thread scratch that stays in L1. Going block by block down 256 rows (the
    // GEMM items below) made every 8 KB block a fresh stream 4 V bytes from the last: the fp32
    // statistics of [2048 x 32000] took 14.4 ms against 10.5 row by row (2-core Zen 5, a
    // microbenchmark of CpuBlockStats in both orders). Top-k: the row's list sees its values in
    // order, so only values above the row's k-th best so far are inserted (a per-block list
    // starts empty in every block); the result is the same, Better being a strict total order.
#pragma omp parallel num_threads(ctx_.threads)
    {
      ItemBuffers& buf = ItemBuffers::OfThisThread(with_ref_);
#pragma omp for schedule(dynamic, 8)
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t lb = 0; lb < num_blocks_; ++lb) {
          const int64_t block = block_begin_ + lb;
          const float* a = RowBlock(job_.model, row0 + r, block, buf.scratch_m.data());
          const float* b =
              with_ref_ ? RowBlock(job_.reference, row0 + r, block, buf.scratch_r.data()) : nullptr;
          row_block(r, lb, a, b);
        }
      }
    }
  } else {
    // Work items (block, GEMM of kGemmRows rows), a block's items consecutive: in hidden mode
    // its weights, streamed from memory for the first, are in the cache for the others
    // (whichever thread takes them), and the items are small enough that the threads finish
    // the tile together.
    const int gemms = static_cast<int>((rows + kGemmRows - 1) / kGemmRows);
    const int64_t items = num_blocks_ * gemms;
    std::vector<absl::Status> status(static_cast<size_t>(items));
#pragma omp parallel num_threads(ctx_.threads)
    {
      ItemBuffers& buf = ItemBuffers::OfThisThread(with_ref_);
      std::vector<const float*> zm, zr;
#pragma omp for schedule(dynamic, 1)
      for (int64_t item = 0; item < items; ++item) {
        const int64_t lb = item / gemms;
        const int g = static_cast<int>(item % gemms);
        const int64_t block = block_begin_ + lb;
        const int64_t n = BlockWidth(job_.vocab, block);
        const int64_t r0 = g * kGemmRows;
        const int64_t g_rows = std::min(kGemmRows, rows - r0);
        auto run = [&](const DistributionInput& in, const HiddenTile& htile,
                       std::vector<float>& scratch, std::vector<const float*>& ptrs) {
          return BlockLogits(in, htile, row0, g, g_rows, block, scratch.data(), &buf.gemm, &ptrs);
        };
        absl::Status s = run(job_.model, hidden_model_, buf.scratch_m, zm);
        if (s.ok() && with_ref_) s = run(job_.reference, hidden_ref_, buf.scratch_r, zr);
        if (!s.ok()) {
          status[static_cast<size_t>(item)] = s;
          continue;
        }
        for (int64_t gr = 0; gr < g_rows; ++gr) {
          const auto i = static_cast<size_t>(gr);
          if (gr + 1 < g_rows) {  // a side in logits mode: the next row's block, from memory
            if (!job_.model.hidden_mode()) Prefetch(zm[i + 1], n);
            if (with_ref_ && !job_.reference.hidden_mode()) Prefetch(zr[i + 1], n);
          }
          row_block(r0 + gr, lb, zm[i], with_ref_ ? zr[i] : nullptr);
        }
      }
    }
    for (const auto& s : status) {
      if (!s.ok()) return s;
    }
  }
  if (block_lists) {
    for (int64_t r = 0; r < rows; ++r) {
      int count = 0;
      k::TopKEntry* list = topk + r * k_top;
      for (int64_t lb = 0; lb < num_blocks_; ++lb) {
        const size_t off = static_cast<size_t>(r * num_blocks_ + lb);
        k::TopKMerge(block_topk.data() + off * k_top, block_counts[off], static_cast<int>(k_top),
                     list, &count);
      }
      counts[r] = count;
    }
  }
  return absl::OkStatus();
}

absl::Status RankWorker::FoldTile(int64_t row0, int64_t rows) {
  const auto& layout = *ctx_.layout;
  const int64_t nb_total = k::NumBlocks(job_.vocab);
  auto record = [&](int rank) { return recv_.data() + static_cast<size_t>(rank) * msg_.bytes; };
  const std::vector<int> owner = BlockOwners(layout, job_.vocab);
  model_rows_.assign(static_cast<size_t>(rows), k::EmptyRowStats());
  ref_rows_.assign(static_cast<size_t>(rows), k::EmptyRowStats());
  pair_rows_.assign(static_cast<size_t>(rows), k::EmptyPairRowStats());
  // Rows are independent: folded by the job's threads (each row in global block order).
#pragma omp parallel for num_threads(ctx_.threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nb_total; ++b) {
      const int o = owner[static_cast<size_t>(b)];
      const int64_t lb = b - layout[static_cast<size_t>(o)].begin / k::kVocabBlock;
      const auto* st = reinterpret_cast<const k::PairBlockStats*>(record(o) + msg_.stats_offset) +
                       r * msg_.max_blocks + lb;
      if (with_ref_) {
        k::FoldPairBlock(pair_rows_[static_cast<size_t>(r)], *st);
      } else {
        k::FoldBlock(model_rows_[static_cast<size_t>(r)], st->a);
      }
    }
    if (with_ref_) {
      model_rows_[static_cast<size_t>(r)] = pair_rows_[static_cast<size_t>(r)].a;
      ref_rows_[static_cast<size_t>(r)] = pair_rows_[static_cast<size_t>(r)].b;
    }
  }
  // Input errors: every rank sees the same folded flags, so every rank stops at the same row.
  for (int64_t r = 0; r < rows; ++r) {
    const uint32_t bad = k::kFlagNaN | k::kFlagPosInf;
    const DistributionInput* culprit = nullptr;
    if (model_rows_[static_cast<size_t>(r)].flags & bad) {
      culprit = &job_.model;
    } else if (with_ref_ && (ref_rows_[static_cast<size_t>(r)].flags & bad)) {
      culprit = &job_.reference;
    }
    if (culprit != nullptr) {
      const std::string what =
          culprit->hidden_mode()
              ? absl::StrCat("logits computed from ", culprit->field, " row ", row0 + r,
                             " with head '", culprit->head->weights().name, "'")
              : absl::StrCat(culprit->field, " row ", row0 + r);
      return absl::InvalidArgumentError(absl::StrCat(what, " contain NaN or +inf"));
    }
  }
  if (rank_ != 0) return absl::OkStatus();

  ScoreResult& out = *ctx_.result;
  k::RowOutputs outputs;
  outputs.target_ids = job_.target_ids.data();
  outputs.ids_per_row = static_cast<int32_t>(job_.ids_per_row);
  outputs.ignore_index = job_.ignore_index;
  if (job_.ids_per_row > 0) outputs.target_logprobs = out.target_logprobs.data();
  outputs.top_k = static_cast<int32_t>(job_.top_k);
  if (job_.top_k > 0) {
    outputs.top_k_ids = out.top_k_ids.data();
    outputs.top_k_logprobs = out.top_k_logprobs.data();
  }
  if (job_.entropy) outputs.entropy = out.entropy.data();
  if (job_.reference_entropy) outputs.reference_entropy = out.reference_entropy.data();
  if (job_.forward_kl) outputs.forward_kl = out.forward_kl.data();
  if (job_.reverse_kl) outputs.reverse_kl = out.reverse_kl.data();
  if (job_.jsd_beta) outputs.jsd = out.jsd.data();
  outputs.jsd_endpoint = k::JsdEndpoint(job_.jsd_beta.has_value(), job_.jsd_beta.value_or(0.0f));
#pragma omp parallel num_threads(ctx_.threads)
  {
    std::vector<k::TopKEntry> list(static_cast<size_t>(job_.top_k));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = row0 + r;
      const k::RowStats& m = model_rows_[static_cast<size_t>(r)];
      // The row finisher (row_finisher.h, shared with the CUDA fold kernel); this backend's part is
      // finding a target's logit in its owner's message and the top-k merge.
      k::FinishRow(outputs, row, m, ref_rows_[static_cast<size_t>(r)],
                   pair_rows_[static_cast<size_t>(r)], [&](int32_t j, int32_t id) {
                     const int holder = owner[static_cast<size_t>(id / k::kVocabBlock)];
                     return reinterpret_cast<const float*>(
                         record(holder) + msg_.target_offset)[r * job_.ids_per_row + j];
                   });
      if (job_.top_k > 0) {
        int count = 0;
        for (int o = 0; o < ctx_.comm->size(); ++o) {
          const auto* l =
              reinterpret_cast<const k::TopKEntry*>(record(o) + msg_.topk_offset) + r * job_.top_k;
          const int c = reinterpret_cast<const int32_t*>(record(o) + msg_.count_offset)[r];
          k::TopKMerge(l, c, job_.top_k, list.data(), &count);
        }
        for (int32_t j = 0; j < outputs.top_k; ++j) {
          k::FinishTopKEntry(outputs, row, j, j < count ? &list[static_cast<size_t>(j)] : nullptr,
                             m);
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status RankWorker::JsdTile(int64_t row0, int64_t rows) {
  const float beta = *job_.jsd_beta;
  const int64_t shard_width = shard_.end - shard_.begin;
  std::fill(partial_.begin(), partial_.end(), 0.0f);
  // Items (row, block), a row's blocks consecutive (ComputeTile's logits-mode order); a chunk is
  // a whole row when the rows go round the threads, else one block. Hidden mode reads the logits
  // it kept, logits mode the request's (no GEMM either way).
  const int64_t chunk = RowsGoRound(rows) ? num_blocks_ : 1;
#pragma omp parallel num_threads(ctx_.threads)
  {
    ItemBuffers& buf = ItemBuffers::OfThisThread(/*pair=*/true);
#pragma omp for schedule(dynamic, chunk)
    for (int64_t item = 0; item < rows * num_blocks_; ++item) {
      const int64_t r = item / num_blocks_;
      const int64_t lb = item - r * num_blocks_;
      const k::RowStats& ms = model_rows_[static_cast<size_t>(r)];
      const k::RowStats& rs = ref_rows_[static_cast<size_t>(r)];
      if (k::AllMasked(ms) || k::AllMasked(rs)) continue;
      const int64_t block = block_begin_ + lb;
      const int64_t col0 = block * k::kVocabBlock;
      const float* zm;
      const float* zr;
      if (keep_logits_) {
        const int64_t at = r * shard_width + (col0 - shard_.begin);
        zm = keep_model_.data() + at;
        zr = keep_ref_.data() + at;
      } else {
        zm = RowBlock(job_.model, row0 + r, block, buf.scratch_m.data());
        zr = RowBlock(job_.reference, row0 + r, block, buf.scratch_r.data());
      }
      partial_[static_cast<size_t>(r * msg_.max_blocks + lb)] =
          k::CpuJsdBlock(zm, zr, BlockWidth(job_.vocab, block), k::NormOf(ms), k::NormOf(rs), beta);
    }
  }
  return absl::OkStatus();
}

absl::Status RankWorker::Exchange(TileExchange what) {
  if (what == TileExchange::kStatistics) {
    return ctx_.comm->AllGather(send_.data(), recv_.data(), msg_.bytes);
  }
  return ctx_.comm->AllGather(partial_.data(), partial_all_.data(),
                              partial_.size() * sizeof(float));
}

absl::Status RankWorker::JsdFinish(int64_t row0, int64_t rows) {
  if (rank_ != 0) return absl::OkStatus();
  const auto& layout = *ctx_.layout;
  for (int64_t r = 0; r < rows; ++r) {
    float sum = 0.0f;
    for (const auto& s : layout) {  // shards are contiguous and ordered: global block order
      const int64_t nb = (s.end - s.begin + k::kVocabBlock - 1) / k::kVocabBlock;
      for (int64_t lb = 0; lb < nb; ++lb) {
        sum += partial_all_[static_cast<size_t>(s.shard) * partial_.size() +
                            static_cast<size_t>(r * msg_.max_blocks + lb)];
      }
    }
    const bool masked = k::AllMasked(model_rows_[static_cast<size_t>(r)]) ||
                        k::AllMasked(ref_rows_[static_cast<size_t>(r)]);
    ctx_.result->jsd[static_cast<size_t>(row0 + r)] = masked ? k::QuietNaN() : sum;
  }
  return absl::OkStatus();
}

absl::Status RankWorker::Run() {
  send_.assign(msg_.bytes, 0);
  recv_.assign(msg_.bytes * static_cast<size_t>(ctx_.comm->size()), 0);
  if (jsd_pass_) {
    partial_.assign(static_cast<size_t>(tile_rows_ * msg_.max_blocks), 0.0f);
    partial_all_.assign(partial_.size() * static_cast<size_t>(ctx_.comm->size()), 0.0f);
  }
  if (keep_logits_) {  // a job shorter than a tile keeps only its rows
    const size_t n =
        static_cast<size_t>(std::min(tile_rows_, job_.rows) * (shard_.end - shard_.begin));
    keep_model_.assign(n, 0.0f);
    keep_ref_.assign(n, 0.0f);
  }
  ShardedJobPlan tiles;
  tiles.tile_rows = tile_rows_;
  tiles.jsd_pass = jsd_pass_;
  tiles.rank = rank_;
  return RunShardedJob(job_, tiles, *ctx_.failure, *this);
}

absl::Status CpuBackend::Score(const ScoreJob& job, ScoreResult* result) {
  LOGITSERVE_RETURN_IF_ERROR(StartResult(job, result));
  if (job.rows == 0) return absl::OkStatus();

  const std::vector<ShardRange> layout = ShardLayout(job.vocab);
  const int shards = static_cast<int>(layout.size());
  LOGITSERVE_ASSIGN_OR_RETURN(auto comms, CreateInProcessCommunicators(shards));
  const int threads = std::max(1, options_.threads / shards);
  std::vector<absl::Status> status(static_cast<size_t>(shards));
  JobFailure failure(shards);
  auto run_rank = [&](int r) {
    if (r > 0) NameThisThread("ls-cpu-rank");  // rank 0 runs on the caller's thread
    const OmpTeamSize team(threads);
    RankContext ctx{&job, result, comms[static_cast<size_t>(r)].get(), &failure, &layout, threads};
    status[static_cast<size_t>(r)] = RankWorker(ctx).Run();
  };
  std::vector<std::thread> others;
  for (int r = 1; r < shards; ++r) others.emplace_back(run_rank, r);
  run_rank(0);
  for (auto& t : others) t.join();
  // The failing rank's own status first; ABORTED only says "another shard failed".
  for (const auto& s : status) {
    if (!s.ok() && !absl::IsAborted(s)) return s;
  }
  for (const auto& s : status) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(const CpuBackendOptions& options) {
  if (options.shards < 1) return absl::InvalidArgumentError("--shards must be >= 1");
  if (!options.shard_weights.empty() &&
      static_cast<int>(options.shard_weights.size()) != options.shards) {
    return absl::InvalidArgumentError("shard_weights must have one entry per shard");
  }
  for (int64_t w : options.shard_weights) {
    if (w < 0) return absl::InvalidArgumentError("shard_weights must be >= 0");
  }
  return std::unique_ptr<Backend>(new CpuBackend(options));
}

}  // namespace logitserve
