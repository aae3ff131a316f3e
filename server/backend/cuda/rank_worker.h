// RankWorker: one rank's part of one CudaBackend job, on that rank's host thread: prepare (the
// job's workspace, target ids), then every row tile through the shared tile loop
// (server/backend/sharded_job.h: stop check -> statistics of the shard's blocks, hidden mode
// behind the GEMMs -> all-gather -> fold -> optional JSD pass -> the tile's outputs back to pinned
// host memory), then finish (wait idle, rank 0 copies the outputs into the result: tiles the host
// waited for as it queued later ones, then the rest split over the rank's CopyPool). Created per
// job by CudaBackend::Score, one per rank. The ShardedRank hooks only queue work on the rank's
// streams; WaitTile / EndTile keep at most kTileEvents tiles queued ahead of the host.
//
// Logits mode runs the tiles as a software pipeline (Rank's stats_streams): tile t's statistics
// (message slot and lane maxima t % n, n = Rank::kMessageSlots) on stats_streams[t % 2], its
// tail on `stream`, its output slices on copy_stream, joined by events only: the host never waits
// for a tile to queue the next. What the tail of tile t reads and the statistics of tiles t + 1
// ... t + n - 1 would overwrite is n-buffered (the message, the lane maxima); what only the tail
// touches (gathered messages, folded rows, JSD partials) is single, the tail being one stream in
// tile order; the staging of copied logits is single too, its next copy waiting for the previous
// tail.
//
// Thread safety: one thread per worker; workers of one job meet only through JobFailure, the
// communicator and the shared read-only JobPlan.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "logitserve/kernels/block_stats.h"
#include "logitserve/kernels/cuda_kernels.h"
#include "server/backend/backend.h"
#include "server/backend/cuda/cuda_head.h"
#include "server/backend/cuda/cuda_test_fault.h"
#include "server/backend/cuda/job_plan.h"
#include "server/backend/cuda/rank.h"
#include "server/backend/cuda/watchdog.h"
#include "server/backend/job_failure.h"
#include "server/backend/sharded_job.h"

namespace logitserve::cuda_internal {

namespace k = kernels;
namespace kc = kernels::cuda;

// Where a pointer lives: the device holding it, or -1 for host memory.
inline int DeviceOf(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();  // older drivers report unregistered host memory as an error
    return -1;
  }
  return attr.type == cudaMemoryTypeDevice ? attr.device : -1;
}

// Whether p is host memory that CUDA does not know (neither pinned nor managed nor device).
inline bool IsPageable(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();
    return true;
  }
  return attr.type == cudaMemoryTypeUnregistered;
}

// Host threads of the output copy-back at most: half the cores, at most kOutputThreads.
inline size_t MaxCopyThreads() {
  return std::clamp<size_t>(std::thread::hardware_concurrency() / 2, 1, kOutputThreads);
}

// Host threads each of `ranks` ranks stages pageable hidden states on (RankWorker::BeginTile):
// every rank stages the same rows, so each gets its share of MaxCopyThreads.
inline size_t StagingThreads(int ranks) {
  return std::max<size_t>(1, MaxCopyThreads() / static_cast<size_t>(std::max(1, ranks)));
}

class RankWorker final : public ShardedRank {
 public:
  RankWorker(Rank& rank, const JobPlan& plan, int num_ranks, JobFailure& failure, FatalState& fatal,
             absl::Duration timeout, int64_t test_fail_step, TestFault fault, ScoreResult* result)
      : rank_(rank),
        plan_(plan),
        job_(*plan.job),
        num_ranks_(num_ranks),
        shard_(plan.layout[static_cast<size_t>(rank.index)]),
        shard_width_(shard_.end - shard_.begin),
        num_chunks_(shard_width_ > 0 ? CeilDiv(shard_width_, plan.chunk_cols) : 0),
        reports_(rank.index == 0),
        failure_(failure),
        fatal_(fatal),
        timeout_(timeout),
        test_fail_step_(test_fail_step),
        fault_(fault.rank == rank.index ? fault.kind : TestFault::kNone),
        num_tiles_(CeilDiv(plan.job->rows, plan.tile_rows)),
        result_(result) {}

  // Allocates the job's workspace and uploads the target ids. No collectives. `result` (the
  // constructor's) has every requested output sized (StartResult).
  absl::Status Prepare();
  // Every tile: RunShardedJob over this worker's hooks (below). Before each collective the ranks
  // agree (JobFailure) whether any of them failed; if so, all return there (the failing rank its
  // own status, the others PeerFailed). A stop (job.CheckStop(), before every tile) is such a
  // failure.
  absl::Status Run();
  // Every rank waits (watchdog) until its streams are idle, so nothing queued outlives the job;
  // then, when `copy` (the job succeeded), rank 0 copies the outputs not yet copied into the
  // result and the bad-row markers into first_bad. Every rank checks NCCL.
  absl::Status Finish(bool copy, int32_t* first_bad);
  ~RankWorker() override = default;

 private:
  struct Dist {
    const DistributionInput* in = nullptr;
    bool hidden = false;
    // Logits mode.
    bool zero_copy = false;
    uint8_t* staging = nullptr;
    int64_t staging_ld = 0;
    // Hidden mode.
    const CudaHead* head = nullptr;
    int hidden_parts = 0;
    int index = 0;           // 0: the model, 1: the reference
    uint8_t* raw = nullptr;  // two [tile_rows][H] of the input dtype, raw_bytes apart (t % 2)
    // Pageable hidden states: two pinned host tiles [tile_rows][H] (tile t uses t % 2), filled by
    // the host thread while the GPU works on earlier tiles, then copied asynchronously.
    std::array<uint8_t*, 2> pinned{};
    uint16_t* x_parts = nullptr;  // hidden_parts x [tile_rows][k_pad] (fused: two, x_elems apart)
    size_t raw_bytes = 0;
    size_t x_elems = 0;
    // Fused: the hidden states already live on this rank's device; the split reads them in place
    // and `raw` is not used.
    bool direct = false;
    float* slots = nullptr;  // n_slots x [tile_rows][JobPlan::chunk_cols]
    int64_t n_slots = 0;
    kc::LoadTransform transform;
  };

  void SetUpDist(Dist& d, const DistributionInput& in, bool zero_copy, Carver& carver,
                 std::vector<std::pair<Dist*, std::array<size_t, 4>>>& offsets);
  // The job's set-up copies (target ids up, the bad-row sentinel) on gemm_stream, then the
  // `uploaded` event. Hidden mode issues them in Prepare (before the first GEMM); logits mode
  // after its first statistics launch, so that their host-side calls (~2-3 us each) do not delay
  // that kernel. IssueUploads issues them if nothing has, and makes `stream` wait for them.
  absl::Status IssueSetUpCopies();
  absl::Status IssueUploads();
  // One tile without top-k: its statistics run on `stream` itself (there is no previous tile's
  // tail to overlap), and with the model's logits read in place its target gather runs on
  // gemm_stream beside them (it reads only those logits and the ids), off the tail's critical
  // path.
  bool single_logits_tile() const { return pipelined() && num_tiles_ == 1 && job_.top_k == 0; }
  // The tile's input copies: logits staging on `logits_stream`; hidden rows up on upload_stream
  // and split on the GEMM stream (fused hidden mode: both on `logits_stream`, into the tile's
  // buffer pair of raw rows and parts).
  absl::Status BeginTile(Dist& d, int64_t row0, int64_t rows, cudaStream_t logits_stream);
  // Fused hidden mode: the tile's statistics, target logits (and, for top-k / JSD, its logits in
  // slot `slot_`) with one LaunchHiddenStats on `on`.
  absl::Status LaunchFused(int64_t row0, int64_t rows, uint8_t* msg, cudaStream_t on);
  absl::Status ComputeHiddenTile(int64_t row0, int64_t rows);
  absl::Status ComputeLogitsTile(int64_t row0, int64_t rows);
  // Reporting rank: tile t's output slices from the device block to host_io on copy_stream, then
  // tile_done; the last tile also brings the bad-row markers.
  absl::Status CopyTileOutputs(int64_t tile);
  // Reporting rank: the host copies of tile t's output slices, host_io -> result.
  std::vector<HostCopy> TileHostCopies(int64_t tile) const;
  int64_t TileRows(int64_t tile) const {
    return std::min(plan_.tile_rows, job_.rows - tile * plan_.tile_rows);
  }
  // Tiles the host may queue ahead of the GPU (WaitTile).
  int64_t Depth() const;
  bool pipelined() const { return !plan_.any_hidden || plan_.fused; }
  uint8_t* Gathered() const { return num_ranks_ > 1 ? recv_ : send_[slot_]; }
  // Hidden mode: logits slot i of d ([tile_rows][chunk_cols]), and the bias of d's head shard on
  // this rank (null when the head has none).
  float* Slot(const Dist& d, int64_t i) const {
    return d.slots + i * plan_.tile_rows * plan_.chunk_cols;
  }
  const float* ShardBias(const Dist& d) const {
    const CudaHead::Shard& hs = d.head->shards[static_cast<size_t>(rank_.index)];
    return hs.bias.data() != nullptr ? hs.bias.as<float>() : nullptr;
  }
  // The source for chunk c; hidden mode reads logits slot `slot` and runs its GEMMs into it first
  // (on gemm_stream) when `compute`.
  absl::StatusOr<kc::LogitsSource> Source(Dist& d, int64_t c, int64_t row0, bool compute,
                                          int64_t slot);
  // ShardedRank: the tile loop's hooks, called by RunShardedJob in Run.
  // Waits (watchdog) for tile - depth: at most `depth` tiles queued ahead of the host; the
  // reporting rank then copies that tile's outputs into the result.
  absl::Status WaitTile(int64_t tile) override;
  absl::Status ComputeTile(int64_t row0, int64_t rows) override;
  // One all-gather on the rank's communicator; nothing on one rank (FoldTile reads the send
  // buffer's bytes through recv_ == send_, see Prepare).
  absl::Status Exchange(TileExchange what) override;
  absl::Status FoldTile(int64_t row0, int64_t rows) override;
  absl::Status JsdTile(int64_t row0, int64_t rows) override;
  absl::Status JsdFinish(int64_t row0, int64_t rows) override {
    return JsdGatherAndFinish(row0, rows);
  }
  absl::Status JsdGatherAndFinish(int64_t row0, int64_t rows);
  // The first tile: the test fault (InjectFault); every tile: records tile_done.
  absl::Status EndTile(int64_t tile) override;
  // A fatal device error is reported to FatalState at once (other ranks' waits give up).
  void OnFailure(const absl::Status& status) override;
  // Polls `event` until it completes (watchdog: collective_timeout; NCCL errors; a fatal error on
  // another rank abandons the wait).
  absl::Status WaitFor(cudaEvent_t event, const char* what);
  absl::Status WaitIdle(const char* what);
  // CudaBackendOptions::test_fault on this rank, at the end of the job's first tile.
  absl::Status InjectFault();
  cudaStream_t stream() const { return rank_.stream.get(); }
  cudaStream_t gemm_stream() const {
    return plan_.overlap_gemms ? rank_.gemm_stream.get() : rank_.stream.get();
  }
  // The stream of d's row-tile inputs and GEMMs, and its cuBLASLt workspace.
  bool OnStreamB(const Dist& d) const { return plan_.two_gemm_streams && &d == &ref_; }
  cudaStream_t GemmStreamOf(const Dist& d) const {
    return OnStreamB(d) ? rank_.gemm_stream_b.get() : gemm_stream();
  }

  Rank& rank_;
  const JobPlan& plan_;
  const ScoreJob& job_;
  const int num_ranks_;
  const ShardRange shard_;
  const int64_t shard_width_;
  const int64_t num_chunks_;
  const bool reports_;  // rank 0 writes the outputs
  JobFailure& failure_;
  FatalState& fatal_;
  const absl::Duration timeout_;
  const int64_t test_fail_step_;  // CudaBackendOptions::test_fail_step when this rank fails
  const TestFault::Kind fault_;   // CudaBackendOptions::test_fault when it names this rank
  int64_t chunk_seq_ = 0;         // hidden mode: chunks computed so far in this job (all tiles)
  int64_t gathers_ = 0;  // all-gathers issued so far in this job (the skip-collective fault)
  const int64_t num_tiles_;
  ScoreResult* const result_;
  int64_t copied_ = 0;  // reporting rank: tiles [0, copied_) are in result_
  int slot_ = 0;  // the tile's message slot (logits mode: tile % kMessageSlots; hidden mode: 0)

  Dist model_, ref_;
  std::array<uint8_t*, Rank::kMessageSlots> send_{};  // this rank's message, per slot
  uint8_t* recv_ = nullptr;                           // every rank's message (more than one rank)
  float* partial_send_ = nullptr;
  // The top-k kernels' lane maxima of one source, per message slot.
  std::array<float*, Rank::kMessageSlots> topk_scratch_{};
  float* partial_recv_ = nullptr;
  k::RowStats* folded_a_ = nullptr;
  k::RowStats* folded_b_ = nullptr;
  int32_t* first_bad_ = nullptr;
  int32_t* ids_ = nullptr;
  // The output block: first_bad_ at 0, then output i (target logprobs, top-k ids, top-k
  // logprobs, entropy, reference entropy, forward KL, reverse KL, JSD) at out_at_[i] when
  // out_bytes_[i] > 0 (requested, reporting rank).
  uint8_t* out_block_ = nullptr;
  size_t out_block_bytes_ = 0;
  std::array<size_t, 8> out_bytes_{};
  std::array<size_t, 8> out_at_{};
  std::array<void*, 8> out_dst_{};  // where output i goes in result_
  size_t io_outputs_at_ = 0;        // where the output block's staging starts in rank_.host_io
  // The job's set-up copies (IssueSetUpCopies) and `stream`'s wait for them (IssueUploads), in
  // this order.
  enum class SetUp {
    kNotLaidOut,  // Prepare has not laid out the workspace: nothing may be copied yet
    kReady,       // laid out; the copies are not issued
    kIssuing,     // IssueSetUpCopies started (and may have failed part-way): never again
    kPending,     // issued and `uploaded` recorded; `stream` has not waited for them yet
    kJoined,      // `stream` waits for them
  };
  SetUp setup_ = SetUp::kNotLaidOut;
  kc::RowOutputs outputs_;
};

}  // namespace logitserve::cuda_internal
