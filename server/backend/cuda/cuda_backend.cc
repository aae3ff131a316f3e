// CudaBackend (see cuda_backend.h for the algorithm and its promises). This file holds the
// orchestration: preparing heads resident per device (cuda_head.h), planning a job (job_plan.h),
// starting one worker per rank per job (rank_worker.h) over each rank's device resources
// (rank.h), and the fatal-error path; injected test faults are cuda_test_fault.h. The math is in
// kernels/cuda (launchers in cuda_kernels.h) and block_stats.h.
#include "server/backend/cuda/cuda_backend.h"

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "common/base/status_macros.h"
#include "logitserve/kernels/block_stats.h"
#include "logitserve/kernels/cuda_kernels.h"
#include "server/backend/communicator.h"
#include "server/backend/cuda/cuda_head.h"
#include "server/backend/cuda/cuda_status.h"
#include "server/backend/cuda/cuda_test_fault.h"
#include "server/backend/cuda/cuda_tile_gemm.h"
#include "server/backend/cuda/device_resources.h"
#include "server/backend/cuda/job_plan.h"
#include "server/backend/cuda/job_trace.h"
#include "server/backend/cuda/nccl_communicator.h"
#include "server/backend/cuda/prestage.h"
#include "server/backend/cuda/rank.h"
#include "server/backend/cuda/rank_worker.h"
#include "server/backend/cuda/watchdog.h"
#include "server/backend/job_failure.h"
#include "server/backend/shard_layout.h"

#ifndef LOGITSERVE_CUDA_ARCHITECTURES
#define LOGITSERVE_CUDA_ARCHITECTURES "unknown"
#endif

namespace logitserve {
namespace {

namespace k = kernels;
namespace kc = kernels::cuda;
using cuda_internal::CeilDiv;
using cuda_internal::CopyPool;
using cuda_internal::CudaHead;
using cuda_internal::DeviceOf;
using cuda_internal::IsPageable;
using cuda_internal::JobPlan;
using cuda_internal::JobTrace;
using cuda_internal::JoinSideStreams;
using cuda_internal::kMaxLogitsTileRows;
using cuda_internal::kNoBadRow;
using cuda_internal::kTileEvents;
using cuda_internal::LtHandle;
using cuda_internal::ParseTestFault;
using cuda_internal::Prestager;
using cuda_internal::Rank;
using cuda_internal::RankWorker;
using cuda_internal::RoundUp;
using cuda_internal::TestFault;
using cuda_internal::TopKTileRows;

class CudaBackend final : public Backend {
 public:
  CudaBackend(const CudaBackendOptions& options, std::vector<std::unique_ptr<Rank>> ranks,
              TestFault fault, bool fused, std::optional<kc::HiddenCluster> cluster)
      : options_(options),
        fault_(fault),
        fused_(fused),
        fused_cluster_(cluster),
        ranks_(std::move(ranks)) {
    std::vector<int> devices;
    for (auto& r : ranks_) {
      if (r->nccl != nullptr) r->nccl->set_fatal_state(&fatal_);
      devices.push_back(r->device);
    }
    if (options_.prestage_bytes > 0) {  // a slot per job waiting for the ranks (two workers)
      prestager_ = std::make_unique<Prestager>(devices, 2, options_.prestage_bytes,
                                               cuda_internal::MaxCopyThreads());
    }
  }

  std::string name() const override { return "cuda"; }

  std::vector<ShardRange> ShardLayout(int64_t vocab) const override {
    return MakeShardLayout(vocab, static_cast<int>(ranks_.size()), options_.shard_weights);
  }

  absl::StatusOr<std::shared_ptr<const PreparedHead>> PrepareHead(
      std::shared_ptr<const HeadWeights> weights) override;

  absl::Status Score(const ScoreJob& job, ScoreResult* result) override;

  absl::Status Health() const override { return fatal_.status(); }

  // Per device: used = total - free (cudaMemGetInfo: every process's use of the device), total.
  // Zeros for a device that no longer answers.
  std::vector<MemoryInfo> MemoryUsage() const override;

 private:
  // After a fatal error (every rank thread has returned): aborts the NCCL communicators so no
  // collective waits for ever, and lets the streams drain for a bounded time.
  void ShutDownAfterFatalError() ABSL_EXCLUSIVE_LOCKS_REQUIRED(score_mu_);
  absl::StatusOr<std::shared_ptr<const CudaTileGemm>> GemmFor(int device, int64_t k_pad);
  // Every tile GEMM's shape: HiddenRowTile() x the slot (hidden_slot_gemms) or kCudaVocabChunk
  // columns, into slots of hidden_stats_chunks chunks side by side.
  int64_t HiddenRowTile() const {
    return options_.hidden_row_tile > 0 ? options_.hidden_row_tile : kCudaRowTile;
  }
  int64_t SlotCols() const { return options_.hidden_stats_chunks * kCudaVocabChunk; }
  TileGemmShape SlotGemmShape(bool whole_slot, int device_sms, int64_t k_pad) const {
    TileGemmShape s{HiddenRowTile(), whole_slot ? SlotCols() : kCudaVocabChunk, SlotCols()};
    s.candidate = options_.hidden_gemm_candidate;
    s.sm_count = TileGemmSmCount(device_sms, HiddenStatsSms(options_.hidden_stats_sms, k_pad));
    return s;
  }
  absl::StatusOr<JobPlan> Plan(const ScoreJob& job) const;
  absl::Status CheckHead(const DistributionInput& in) const;

  const CudaBackendOptions options_;
  const TestFault fault_;
  // Every rank's device runs the fused hidden-mode kernel (JobPlan::fused: options_ say when).
  const bool fused_;
  const std::optional<kc::HiddenCluster> fused_cluster_;  // none: "auto"
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::unique_ptr<Prestager> prestager_;  // first tiles uploaded before a job takes the ranks
  FatalState fatal_;
  absl::Mutex score_mu_;  // one job at a time uses the ranks
  bool shut_down_ ABSL_GUARDED_BY(score_mu_) = false;
  absl::Mutex gemm_mu_;
  std::map<std::pair<int, int64_t>, std::shared_ptr<const CudaTileGemm>> gemms_
      ABSL_GUARDED_BY(gemm_mu_);
};

absl::StatusOr<std::shared_ptr<const CudaTileGemm>> CudaBackend::GemmFor(int device,
                                                                         int64_t k_pad) {
  absl::MutexLock lock(&gemm_mu_);
  auto it = gemms_.find({device, k_pad});
  if (it != gemms_.end()) return it->second;
  DeviceGuard guard(device);
  LOGITSERVE_RETURN_IF_ERROR(guard.status());
  int sms = 0;
  LOGITSERVE_RETURN_IF_CUDA_ERROR(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  LtHandle lt;  // its own handle: the ranks' handles may be busy in a concurrent Score
  LOGITSERVE_RETURN_IF_ERROR(lt.Create());
  absl::StatusOr<std::unique_ptr<CudaTileGemm>> gemm =
      CudaTileGemm::Create(lt.get(), k_pad, SlotGemmShape(options_.hidden_slot_gemms, sms, k_pad));
  if (!gemm.ok() && options_.hidden_slot_gemms &&
      absl::IsFailedPrecondition(gemm.status())) {  // no algorithm for every slot width
    gemm = CudaTileGemm::Create(lt.get(), k_pad, SlotGemmShape(false, sms, k_pad));
  }
  LOGITSERVE_RETURN_IF_ERROR(gemm.status());
  std::shared_ptr<const CudaTileGemm> shared = std::move(*gemm);
  gemms_.emplace(std::make_pair(device, k_pad), shared);
  return shared;
}

absl::StatusOr<std::shared_ptr<const PreparedHead>> CudaBackend::PrepareHead(
    std::shared_ptr<const HeadWeights> weights) {
  LOGITSERVE_RETURN_IF_ERROR(Health());
  const HeadWeights& w = *weights;
  const int64_t vocab = w.vocab_size, hidden = w.hidden_size;
  if (vocab < 1 || hidden < 1) return absl::InvalidArgumentError("head has an empty shape");
  const int64_t es = k::SizeOf(w.dtype);
  if (static_cast<int64_t>(w.weight.size()) != vocab * hidden * es) {
    return absl::InvalidArgumentError(absl::StrCat("head '", w.name, "': weight bytes mismatch"));
  }
  if (!w.bias.empty() && static_cast<int64_t>(w.bias.size()) != vocab) {
    return absl::InvalidArgumentError(absl::StrCat("head '", w.name, "': bias size mismatch"));
  }
  auto head = std::make_shared<CudaHead>(weights, this);
  head->k_pad = RoundUp(hidden, 8);
  head->parts = kc::PartsFor(w.dtype);
  const std::vector<ShardRange> layout = ShardLayout(vocab);
  head->shards.resize(ranks_.size());
  constexpr int64_t kPieceRows = 4096;  // upload and split the slice in pieces of this many rows
  for (size_t r = 0; r < ranks_.size(); ++r) {
    const Rank& rank = *ranks_[r];
    CudaHead::Shard& shard = head->shards[r];
    shard.begin = layout[r].begin;
    shard.end = layout[r].end;
    const int64_t width = shard.end - shard.begin;
    if (width == 0) continue;
    DeviceGuard guard(rank.device);
    LOGITSERVE_RETURN_IF_ERROR(guard.status());
    LOGITSERVE_ASSIGN_OR_RETURN(shard.gemm, GemmFor(rank.device, head->k_pad));
    shard.padded_rows = RoundUp(width, kCudaVocabChunk);
    const size_t part_elems = static_cast<size_t>(shard.padded_rows * head->k_pad);
    if (auto s = shard.weights.Reserve(
            rank.device, static_cast<size_t>(head->parts) * part_elems * sizeof(uint16_t));
        !s.ok()) {
      return s;
    }
    CudaStream stream;
    LOGITSERVE_RETURN_IF_ERROR(stream.Create(rank.device));
    DeviceBuffer piece;
    const int64_t piece_rows = std::min(width, kPieceRows);
    if (auto s = piece.Reserve(rank.device, static_cast<size_t>(piece_rows * hidden * es));
        !s.ok()) {
      return s;
    }
    LOGITSERVE_RETURN_IF_CUDA_ERROR(
        cudaMemsetAsync(shard.weights.data(), 0, shard.weights.size(), stream.get()));
    for (int64_t p0 = 0; p0 < width; p0 += piece_rows) {
      const int64_t n = std::min(piece_rows, width - p0);
      LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(
          piece.data(), w.weight.data() + (shard.begin + p0) * hidden * es,
          static_cast<size_t>(n * hidden * es), cudaMemcpyHostToDevice, stream.get()));
      LOGITSERVE_RETURN_IF_CUDA_ERROR(kc::LaunchSplitToBf16(
          w.dtype, piece.data(), hidden, n, hidden, head->parts,
          shard.weights.as<uint16_t>(static_cast<size_t>(p0 * head->k_pad) * sizeof(uint16_t)), n,
          head->k_pad, part_elems, stream.get()));
    }
    if (!w.bias.empty()) {
      if (auto s = shard.bias.Reserve(rank.device,
                                      static_cast<size_t>(shard.padded_rows) * sizeof(float));
          !s.ok()) {
        return s;
      }
      LOGITSERVE_RETURN_IF_CUDA_ERROR(
          cudaMemsetAsync(shard.bias.data(), 0, shard.bias.size(), stream.get()));
      LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(
          shard.bias.data(), w.bias.data() + shard.begin,
          static_cast<size_t>(width) * sizeof(float), cudaMemcpyHostToDevice, stream.get()));
    }
    LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream.get()));
  }
  return std::shared_ptr<const PreparedHead>(std::move(head));
}

absl::Status CudaBackend::CheckHead(const DistributionInput& in) const {
  if (!in.hidden_mode()) return absl::OkStatus();
  const auto* head = dynamic_cast<const CudaHead*>(in.head.get());
  if (head == nullptr || head->owner != this || head->shards.size() != ranks_.size()) {
    return absl::FailedPreconditionError(absl::StrCat(in.field, ": head '", in.head->weights().name,
                                                      "' was not prepared by this CUDA backend"));
  }
  if (in.hidden.cols != head->weights().hidden_size) {
    return absl::InvalidArgumentError(absl::StrCat(in.field, " has ", in.hidden.cols,
                                                   " columns; head '", head->weights().name,
                                                   "' expects ", head->weights().hidden_size));
  }
  return absl::OkStatus();
}

absl::StatusOr<JobPlan> CudaBackend::Plan(const ScoreJob& job) const {
  JobPlan p;
  p.job = &job;
  p.layout = ShardLayout(job.vocab);
  const int ranks = static_cast<int>(ranks_.size());
  p.shards.ranks = ranks;
  for (int r = 0; r < ranks; ++r) {
    const ShardRange& range = p.layout[static_cast<size_t>(r)];
    // Rounded up: an empty trailing shard begins at `vocab`, which need not be a block boundary.
    p.shards.begin[r] = static_cast<int32_t>(CeilDiv(range.begin, k::kVocabBlock));
    p.max_blocks = std::max(p.max_blocks, CeilDiv(range.end - range.begin, k::kVocabBlock));
  }
  p.num_blocks = k::NumBlocks(job.vocab);
  p.shards.begin[ranks] = static_cast<int32_t>(p.num_blocks);
  p.pair = job.NeedsReference();
  if (job.jsd_beta) {
    p.jsd_endpoint = k::JsdEndpoint(/*has_beta=*/true, *job.jsd_beta);
    p.jsd_pass = p.jsd_endpoint == 0;
  }
  p.any_hidden = job.model.hidden_mode() || (p.pair && job.reference.hidden_mode());
  p.overlap_gemms = options_.overlap_hidden_gemms;
  p.hidden_slots = options_.hidden_slots;
  p.two_gemm_streams = p.overlap_gemms && options_.hidden_gemm_streams == 2 && p.pair &&
                       job.model.hidden_mode() && job.reference.hidden_mode();
  int64_t widest = 0;
  for (const ShardRange& s : p.layout) widest = std::max(widest, s.end - s.begin);
  p.chunk_cols = p.any_hidden ? SlotCols() : std::max<int64_t>(widest, 1);

  // Logits read in place where they already live on a rank's device.
  p.model_zero_copy.assign(static_cast<size_t>(ranks), false);
  p.ref_zero_copy.assign(static_cast<size_t>(ranks), false);
  const int model_dev = job.model.hidden_mode() ? -1 : DeviceOf(job.model.logits.data);
  const int ref_dev =
      (p.pair && !job.reference.hidden_mode()) ? DeviceOf(job.reference.logits.data) : -1;
  int64_t staging_per_row = 0;  // the largest over ranks
  for (int r = 0; r < ranks; ++r) {
    const int dev = ranks_[static_cast<size_t>(r)]->device;
    p.model_zero_copy[static_cast<size_t>(r)] = model_dev >= 0 && model_dev == dev;
    p.ref_zero_copy[static_cast<size_t>(r)] = ref_dev >= 0 && ref_dev == dev;
    const ShardRange& range = p.layout[static_cast<size_t>(r)];
    const int64_t width = RoundUp(range.end - range.begin, 8);
    int64_t bytes = 0;
    if (!job.model.hidden_mode() && !p.model_zero_copy[static_cast<size_t>(r)]) {
      bytes += width * k::SizeOf(job.model.logits.type);
    }
    if (p.pair && !job.reference.hidden_mode() && !p.ref_zero_copy[static_cast<size_t>(r)]) {
      bytes += width * k::SizeOf(job.reference.logits.type);
    }
    staging_per_row = std::max(staging_per_row, bytes);
  }
  p.pageable_logits =
      (!job.model.hidden_mode() && IsPageable(job.model.logits.data)) ||
      (p.pair && !job.reference.hidden_mode() && IsPageable(job.reference.logits.data));
  p.model_pageable_hidden = job.model.hidden_mode() && IsPageable(job.model.hidden.data);
  p.ref_pageable_hidden =
      p.pair && job.reference.hidden_mode() && IsPageable(job.reference.hidden.data);
  int64_t widest_hidden = job.model.hidden_mode() ? job.model.hidden.cols : 0;
  if (p.pair && job.reference.hidden_mode()) {
    widest_hidden = std::max(widest_hidden, job.reference.hidden.cols);
  }
  p.fused = fused_ && job.model.hidden_mode() && (!p.pair || job.reference.hidden_mode()) &&
            (options_.hidden_fused || widest_hidden <= options_.hidden_fused_max_hidden);
  if (p.fused) {
    p.fused_logits = job.top_k > 0 || p.jsd_pass;
    p.fused_cluster = fused_cluster_;
    p.overlap_gemms = false;
    p.two_gemm_streams = false;
    // One chunk: the widest shard (the logits slots, when kept, and the top-k / JSD sources).
    p.chunk_cols = RoundUp(std::max<int64_t>(widest, 1), 8);
    p.tile_rows = cuda_internal::FusedTileRows(options_.hidden_fused_tile_rows, job, p.fused_logits,
                                               p.chunk_cols);
  } else if (p.any_hidden) {
    // The GEMM's shape: the full row tile, or for a job of fewer rows the shortest short tile
    // that holds them and that every head's pinned GEMM runs (the same kernel: same bits).
    p.tile_rows = HiddenRowTile();
    for (const int64_t t : kCudaShortRowTiles) {
      if (t >= p.tile_rows || t < job.rows) continue;
      bool runs = true;
      for (const DistributionInput* in : {&job.model, p.pair ? &job.reference : nullptr}) {
        if (in == nullptr || !in->hidden_mode()) continue;
        for (const CudaHead::Shard& hs : static_cast<const CudaHead*>(in->head.get())->shards) {
          runs = runs && (hs.gemm == nullptr || hs.gemm->Runs(t));
        }
      }
      if (runs) {
        p.tile_rows = t;
        break;
      }
    }
  } else {
    // Any tile size gives the same bits in logits mode (rows are independent); this one bounds
    // the staging memory and the per-tile message.
    int64_t rows = options_.logits_tile_rows > 0
                       ? options_.logits_tile_rows
                       : (job.top_k > 0 ? TopKTileRows(job.top_k) : kMaxLogitsTileRows);
    if (staging_per_row > 0) {
      rows = std::min<int64_t>(
          rows, static_cast<int64_t>(options_.logits_staging_bytes) / staging_per_row);
    }
    // JSD re-reads the tile after the fold: a tile that fits in L2 (both distributions of the
    // widest shard) serves that second pass from L2 instead of HBM.
    if (p.jsd_pass && options_.jsd_tile_bytes > 0) {
      const int64_t row_bytes =
          widest * (k::SizeOf(job.model.logits.type) + k::SizeOf(job.reference.logits.type));
      rows = std::min<int64_t>(
          rows, static_cast<int64_t>(options_.jsd_tile_bytes) / std::max<int64_t>(row_bytes, 1));
    }
    p.tile_rows = std::clamp<int64_t>(std::min(rows, job.rows), 1, kMaxLogitsTileRows);
  }
  p.msg = kc::MakeTileMessage(p.tile_rows, p.max_blocks, job.top_k, job.ids_per_row);
  return p;
}

absl::Status CudaBackend::Score(const ScoreJob& job, ScoreResult* result) {
  JobTrace::Begin(static_cast<long>(job.rows));
  struct TraceEnd {
    ~TraceEnd() {
      JobTrace::Mark("Score returns");
      JobTrace::End();
    }
  } trace_end;
  LOGITSERVE_RETURN_IF_ERROR(Health());
  LOGITSERVE_RETURN_IF_ERROR(StartResult(job, result));
  if (job.rows == 0) return absl::OkStatus();
  LOGITSERVE_RETURN_IF_ERROR(CheckHead(job.model));
  if (job.NeedsReference()) {
    LOGITSERVE_RETURN_IF_ERROR(CheckHead(job.reference));
  }
  LOGITSERVE_ASSIGN_OR_RETURN(JobPlan plan, Plan(job));
  JobTrace::Mark("planned");
  // While an earlier job holds the ranks, this one's first tile goes up beside its kernels.
  const Prestager::Lease prestaged = prestager_ != nullptr
                                         ? prestager_->Stage(job, plan.pair, plan.tile_rows)
                                         : Prestager::Lease();
  plan.prestaged = prestaged.tile();
  JobTrace::Mark("prestaged");
  absl::MutexLock lock(&score_mu_);
  JobTrace::Mark("ranks taken", ranks_[0]->gemm_stream.get());
  if (absl::Status h = Health(); !h.ok()) return h;  // failed while this job waited
  const int ranks = static_cast<int>(ranks_.size());
  std::vector<absl::Status> status(static_cast<size_t>(ranks));
  int32_t first_bad[2] = {kNoBadRow, kNoBadRow};
  JobFailure failure(ranks);
  auto fatal_check = [this](const absl::Status& s) {
    if (IsFatalDeviceError(s)) fatal_.Fail(s);
  };
  auto run_rank = [&](int r) {
    RankWorker worker(*ranks_[static_cast<size_t>(r)], plan, ranks, failure, fatal_,
                      options_.collective_timeout,
                      r == options_.test_fail_rank ? options_.test_fail_step : -1, fault_, result);
    // Prepare only allocates and uploads; the ranks agree on it before the first collective.
    absl::Status s = worker.Prepare();
    if (r == 0) JobTrace::Mark("prepared");
    fatal_check(s);
    if (failure.Failed(-1, r, !s.ok())) {
      // Prepare's copy of the target ids may still be queued: let it finish.
      fatal_check(worker.Finish(/*copy=*/false, first_bad));
      status[static_cast<size_t>(r)] = s.ok() ? PeerFailed(failure.rank()) : s;
      return;
    }
    s = worker.Run();
    if (r == 0) JobTrace::Mark("run queued");
    absl::Status f = worker.Finish(/*copy=*/s.ok(), first_bad);
    fatal_check(f);
    if (s.ok() && !f.ok()) failure.Note(r);
    status[static_cast<size_t>(r)] = s.ok() ? f : s;
  };
  std::vector<std::thread> others;
  for (int r = 1; r < ranks; ++r) others.emplace_back(run_rank, r);
  run_rank(0);
  for (auto& t : others) t.join();
  // A fatal device error on any rank outranks everything else.
  if (fatal_.failed()) {
    ShutDownAfterFatalError();
    return fatal_.status();
  }
  // The failing rank's own status (the others report PeerFailed).
  const int failed_rank = failure.rank();
  if (failed_rank >= 0) return status[static_cast<size_t>(failed_rank)];
  for (const auto& s : status) {
    if (!s.ok()) return s;
  }
  // Input errors: the first row (in row order, model before reference) with NaN / +inf.
  const int32_t bad = std::min(first_bad[0], first_bad[1]);
  if (bad != kNoBadRow) {
    const DistributionInput& culprit = first_bad[0] == bad ? job.model : job.reference;
    const std::string what =
        culprit.hidden_mode() ? absl::StrCat("logits computed from ", culprit.field, " row ", bad,
                                             " with head '", culprit.head->weights().name, "'")
                              : absl::StrCat(culprit.field, " row ", bad);
    return absl::InvalidArgumentError(absl::StrCat(what, " contain NaN or +inf"));
  }
  return absl::OkStatus();
}

void CudaBackend::ShutDownAfterFatalError() {
  if (shut_down_) return;
  shut_down_ = true;
  std::vector<NcclCommunicator*> nccl;
  for (auto& r : ranks_) {
    if (r->nccl != nullptr) nccl.push_back(r->nccl);
  }
  // Bounded: the job's caller is waiting, and the process is about to exit anyway.
  const absl::Duration bound = std::min(options_.collective_timeout, absl::Seconds(10));
  AbortNcclCommunicators(nccl, bound);
  // What the aborted collectives held up may now finish; wait a little (`bound`) for it (a sticky
  // error answers at once), since the request's memory is released when Score returns.
  for (auto& r : ranks_) {
    DeviceGuard guard(r->device);
    if (!guard.status().ok() || !JoinSideStreams(*r, /*with_copies=*/true).ok() ||
        cudaEventRecord(r->idle.get(), r->stream.get()) != cudaSuccess) {
      continue;
    }
    (void)PollUntil(
        [&]() -> absl::StatusOr<bool> {
          const cudaError_t q = cudaEventQuery(r->idle.get());
          if (q == cudaErrorNotReady) return false;
          return true;  // done, or an error: either way nothing more to wait for
        },
        bound, nullptr, "drain");
  }
}

std::vector<Backend::MemoryInfo> CudaBackend::MemoryUsage() const {
  std::vector<MemoryInfo> out;
  std::set<int> seen;
  for (const auto& r : ranks_) {
    if (!seen.insert(r->device).second) continue;
    MemoryInfo info;
    info.device = absl::StrCat("cuda:", r->device);
    DeviceGuard guard(r->device);
    size_t free_bytes = 0, total_bytes = 0;
    if (guard.status().ok() && cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
      info.used_bytes = static_cast<int64_t>(total_bytes - free_bytes);
      info.total_bytes = static_cast<int64_t>(total_bytes);
    } else {
      cudaGetLastError();
    }
    out.push_back(std::move(info));
  }
  return out;
}

}  // namespace

const char* CudaArchitecturesBuilt() { return LOGITSERVE_CUDA_ARCHITECTURES; }

absl::Status CheckCudaDevices(const std::vector<int>& devices) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("no usable CUDA device: cudaGetDeviceCount: ", cudaGetErrorName(e), " (",
                     cudaGetErrorString(e), ")"));
  }
  if (count == 0) return absl::FailedPreconditionError("no CUDA device is visible");
  std::vector<int> list = devices;
  if (list.empty()) {
    for (int d = 0; d < count; ++d) list.push_back(d);
  }
  for (int d : list) {
    if (d < 0 || d >= count) {
      return absl::InvalidArgumentError(
          absl::StrCat("CUDA device ", d, " does not exist (", count, " visible)"));
    }
    DeviceGuard guard(d);
    LOGITSERVE_RETURN_IF_ERROR(guard.status());
    cudaDeviceProp prop{};
    LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaGetDeviceProperties(&prop, d));
    const cudaError_t image = kc::CheckKernelImage();
    if (image != cudaSuccess) {
      cudaGetLastError();
      return absl::FailedPreconditionError(absl::StrCat(
          "GPU ", d, " (", prop.name, ", compute capability ", prop.major, ".", prop.minor,
          ") cannot run this build of logitserve, compiled for CUDA architectures ",
          CudaArchitecturesBuilt(), " (", cudaGetErrorName(image),
          "); rebuild with -DCMAKE_CUDA_ARCHITECTURES=", prop.major, prop.minor));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(const CudaBackendOptions& options) {
  LOGITSERVE_RETURN_IF_ERROR(CheckCudaDevices(options.devices));
  std::vector<int> devices = options.devices;
  if (devices.empty()) {
    int count = 0;
    LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaGetDeviceCount(&count));
    for (int d = 0; d < count; ++d) devices.push_back(d);
  }
  {
    std::vector<int> sorted = devices;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("CUDA devices listed twice: ", absl::StrJoin(devices, ",")));
    }
  }
  const int shards = options.shards > 0 ? options.shards : static_cast<int>(devices.size());
  if (shards > kc::kMaxRanks) {
    return absl::InvalidArgumentError(
        absl::StrCat("at most ", kc::kMaxRanks, " vocabulary shards (asked for ", shards, ")"));
  }
  if (!options.shard_weights.empty() && static_cast<int>(options.shard_weights.size()) != shards) {
    return absl::InvalidArgumentError("shard_weights must have one entry per shard");
  }
  for (int64_t w : options.shard_weights) {
    if (w < 0) return absl::InvalidArgumentError("shard_weights must be >= 0");
  }
  // The numeric options: the first out of range is named.
  const int64_t row_tile = options.hidden_row_tile, fused_rows = options.hidden_fused_tile_rows;
  const std::pair<bool, const char*> ranges[] = {
      {options.logits_tile_rows < 0, "logits_tile_rows must be >= 0"},
      {row_tile < 0 || row_tile > 8192 || row_tile % 64 != 0,
       "hidden_row_tile must be 0 or a multiple of 64 <= 8192"},
      {options.hidden_stats_chunks < 1 || options.hidden_stats_chunks > 64,
       "hidden_stats_chunks must be in [1, 64]"},
      {options.hidden_gemm_streams != 1 && options.hidden_gemm_streams != 2,
       "hidden_gemm_streams must be 1 or 2"},
      {options.hidden_slots < 1 || options.hidden_slots > cuda_internal::Rank::kMaxHiddenSlots,
       "hidden_slots must be in [1, 4]"},
      {options.hidden_stats_sms < -1, "hidden_stats_sms must be >= -1"},
      {options.hidden_gemm_candidate < -1 || options.hidden_gemm_candidate > 31,
       "hidden_gemm_candidate must be in [-1, 31]"},
      {options.collective_timeout <= absl::ZeroDuration(), "collective_timeout must be > 0"},
      {fused_rows < 0 || fused_rows % 128 != 0 || fused_rows > 65536,
       "hidden_fused_tile_rows must be 0 or a multiple of 128 <= 65536"},
  };
  for (const auto& [bad, message] : ranges) {
    if (bad) return absl::InvalidArgumentError(message);
  }
  std::optional<kc::HiddenCluster> fused_cluster;
  if (options.hidden_fused_cluster != "auto") {
    const std::pair<const char*, kc::HiddenCluster> names[] = {{"1x1", kc::HiddenCluster::k1x1},
                                                               {"2x1", kc::HiddenCluster::k2x1},
                                                               {"1x2", kc::HiddenCluster::k1x2},
                                                               {"2x2", kc::HiddenCluster::k2x2}};
    for (const auto& [name, c] : names) {
      if (options.hidden_fused_cluster == name) fused_cluster = c;
    }
    if (!fused_cluster.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat("hidden_fused_cluster '",
                                                     options.hidden_fused_cluster,
                                                     "' is not one of auto, 1x1, 2x1, 1x2, 2x2"));
    }
  }
  LOGITSERVE_ASSIGN_OR_RETURN(TestFault fault, ParseTestFault(options.test_fault, shards));
  if (fault.kind == TestFault::kSkipCollective && shards > static_cast<int>(devices.size())) {
    return absl::InvalidArgumentError(
        "test fault skip-collective needs one vocabulary shard per GPU (NCCL)");
  }
  if (fault.kind == TestFault::kSkipCollective && shards < 2) {
    return absl::InvalidArgumentError("test fault skip-collective needs two or more shards");
  }
  std::vector<std::unique_ptr<Rank>> ranks;
  std::vector<int> rank_devices;
  std::vector<cudaStream_t> streams;
  bool fused = options.hidden_fused || options.hidden_fused_max_hidden > 0;
  for (int r = 0; r < shards; ++r) {
    auto rank = std::make_unique<Rank>();
    rank->index = r;
    rank->device = devices[static_cast<size_t>(r) % devices.size()];
    DeviceGuard guard(rank->device);
    LOGITSERVE_RETURN_IF_ERROR(guard.status());
    int least_priority = 0, greatest_priority = 0;
    LOGITSERVE_RETURN_IF_CUDA_ERROR(
        cudaDeviceGetStreamPriorityRange(&least_priority, &greatest_priority));
    // Statistics first (short kernels take SMs as GEMM blocks retire); GEMMs with hidden_stats_sms.
    const bool gemms_first =
        options.hidden_stats_sms != 0 && least_priority > greatest_priority + 1;
    const int gemm_priority = gemms_first ? greatest_priority : 0;
    const int stats_priority = gemms_first ? greatest_priority + 1 : greatest_priority;
    LOGITSERVE_RETURN_IF_ERROR(rank->stream.Create(rank->device, stats_priority));
    LOGITSERVE_RETURN_IF_ERROR(rank->gemm_stream.Create(rank->device, gemm_priority));
    LOGITSERVE_RETURN_IF_ERROR(rank->gemm_stream_b.Create(rank->device, gemm_priority));
    for (CudaStream& s : rank->stats_streams) {
      LOGITSERVE_RETURN_IF_ERROR(s.Create(rank->device, least_priority));
    }
    LOGITSERVE_RETURN_IF_ERROR(rank->copy_stream.Create(rank->device, greatest_priority));
    LOGITSERVE_RETURN_IF_ERROR(rank->upload_stream.Create(rank->device));
    // Every event of the rank, arrays and single ones alike.
    auto one = [](CudaEvent& e) { return absl::MakeSpan(&e, 1); };
    for (absl::Span<CudaEvent> events :
         {absl::MakeSpan(rank->stats_done), absl::MakeSpan(rank->message_free),
          absl::MakeSpan(rank->side_idle), absl::MakeSpan(rank->slot_filled),
          absl::MakeSpan(rank->slot_free), absl::MakeSpan(rank->slot_filled_b),
          absl::MakeSpan(rank->raw_ready), absl::MakeSpan(rank->raw_free),
          absl::MakeSpan(rank->tile_done), one(rank->upload_idle), one(rank->outputs_ready),
          one(rank->slots_released), one(rank->gemm_idle), one(rank->gemm_idle_b),
          one(rank->uploaded), one(rank->idle)}) {
      for (CudaEvent& e : events) {
        LOGITSERVE_RETURN_IF_ERROR(e.Create(rank->device));
      }
    }
    LOGITSERVE_RETURN_IF_ERROR(rank->lt.Create());
    if (auto s = rank->cublas_workspace.Reserve(rank->device, kCublasWorkspaceBytes); !s.ok()) {
      return s;
    }
    if (options.hidden_gemm_streams == 2) {
      LOGITSERVE_RETURN_IF_ERROR(
          rank->cublas_workspace_b.Reserve(rank->device, kCublasWorkspaceBytes));
    }
    fused = fused && kc::HiddenStatsSupported();
    const size_t copy_threads =  // with the worker's; rank 0 also copies the outputs back
        r == 0 ? cuda_internal::MaxCopyThreads() : cuda_internal::StagingThreads(shards);
    if (copy_threads > 1) rank->copy_pool = std::make_unique<CopyPool>(copy_threads - 1);
    rank_devices.push_back(rank->device);
    streams.push_back(rank->stream.get());
    ranks.push_back(std::move(rank));
  }
  if (shards > 1) {
    const bool distinct = shards <= static_cast<int>(devices.size());
    LOGITSERVE_ASSIGN_OR_RETURN(
        std::vector<std::unique_ptr<Communicator>> comms,
        distinct ? CreateNcclCommunicators(rank_devices, streams, options.collective_timeout)
                 : CreateDeviceCopyCommunicators(rank_devices, streams));
    for (int r = 0; r < shards; ++r) {
      Rank& rank = *ranks[static_cast<size_t>(r)];
      rank.comm = std::move(comms[static_cast<size_t>(r)]);
      rank.nccl = distinct ? static_cast<NcclCommunicator*>(rank.comm.get()) : nullptr;
    }
  }
  return std::unique_ptr<Backend>(
      new CudaBackend(options, std::move(ranks), fault, fused, fused_cluster));
}

}  // namespace logitserve
