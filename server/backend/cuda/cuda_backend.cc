// CudaBackend (see cuda_backend.h for the algorithm and its promises). This file holds the
// orchestration: heads resident per device, one worker per rank per job, device workspaces, the
// collectives. The math is in kernels/cuda (launchers in cuda_kernels.h) and block_stats.h.
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
#include "logitserve/kernels/block_stats.h"
#include "logitserve/kernels/cuda_kernels.h"
#include "server/backend/communicator.h"
#include "server/backend/cuda/cuda_status.h"
#include "server/backend/cuda/cuda_tile_gemm.h"
#include "server/backend/cuda/device_resources.h"
#include "server/backend/cuda/nccl_communicator.h"
#include "server/backend/cuda/watchdog.h"
#include "server/backend/shard_layout.h"

#ifndef LOGITSERVE_CUDA_ARCHITECTURES
#define LOGITSERVE_CUDA_ARCHITECTURES "unknown"
#endif

namespace logitserve {
namespace {

namespace k = kernels;
namespace kc = kernels::cuda;

// Logits mode: most rows per tile (bounds the per-rank message, O(rows * (blocks + top_k))).
constexpr int64_t kMaxLogitsTileRows = 8192;
// first_bad_row's "no bad row" value (cudaMemset byte 0x7f).
constexpr int32_t kNoBadRow = 0x7f7f7f7f;

// Row tiles in flight per rank (tile_done events): the host waits for tile t - 2 before it queues
// tile t, so the GPU always has the next tile queued while stop checks and the watchdog stay
// within two tiles of the device.
constexpr int kTileEvents = 2;

int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
int64_t CeilDiv(int64_t x, int64_t m) { return (x + m - 1) / m; }

// A copy of `bytes` bytes from src to dst.
struct HostCopy {
  void* dst;
  const void* src;
  size_t bytes;
};

// Runs the copies, split over threads when large: one core copies ~10 GB/s, so the 4 MB of a
// top-k = 64 output for 8192 rows took as long on one as the top-k kernels (64 MB for k = 1024:
// ten times longer).
void CopyOut(const std::vector<HostCopy>& copies) {
  constexpr size_t kPerThread = size_t{1} << 20;
  size_t total = 0;
  for (const HostCopy& c : copies) total += c.bytes;
  const size_t most = std::clamp<size_t>(std::thread::hardware_concurrency() / 2, 1, 8);
  const size_t n = std::clamp<size_t>((total + kPerThread - 1) / kPerThread, 1, most);
  // Thread i copies bytes [i * share, (i + 1) * share) of the concatenated copies.
  const size_t share = (total + n - 1) / n;
  auto run = [&copies, share](size_t i) {
    size_t begin = i * share, end = begin + share, at = 0;
    for (const HostCopy& c : copies) {
      const size_t lo = std::max(begin, at), hi = std::min(end, at + c.bytes);
      if (lo < hi) {
        std::memcpy(static_cast<uint8_t*>(c.dst) + (lo - at),
                    static_cast<const uint8_t*>(c.src) + (lo - at), hi - lo);
      }
      at += c.bytes;
    }
  };
  std::vector<std::thread> threads;
  for (size_t i = 1; i < n; ++i) threads.emplace_back(run, i);
  run(0);
  for (std::thread& t : threads) t.join();
}

// Carves one device buffer into 256-byte aligned pieces.
class Carver {
 public:
  size_t Add(size_t bytes) {
    const size_t at = total_;
    total_ += (bytes + 255) / 256 * 256;
    return at;
  }
  size_t total() const { return total_; }

 private:
  size_t total_ = 0;
};

// cuBLASLt handle owner.
class LtHandle {
 public:
  LtHandle() = default;
  ~LtHandle() {
    if (handle_ != nullptr) cublasLtDestroy(handle_);
  }
  LtHandle(const LtHandle&) = delete;
  LtHandle& operator=(const LtHandle&) = delete;
  absl::Status Create() {
    LOGITSERVE_RETURN_IF_CUDA_ERROR(cublasLtCreate(&handle_));
    return absl::OkStatus();
  }
  cublasLtHandle_t get() const { return handle_; }

 private:
  cublasLtHandle_t handle_ = nullptr;
};

// Everything one rank (one vocabulary shard on one device) owns for the backend's lifetime.
// Used by the rank's worker thread during a job, under the backend's score mutex.
struct Rank {
  int index = 0;
  int device = 0;
  // `stream` (high priority) runs everything but hidden mode's GEMMs: statistics, collectives,
  // folds, copies. `gemm_stream` runs hidden mode's row-tile inputs and GEMMs, so the statistics
  // of chunk c overlap the GEMMs of chunk c + 1 (double-buffered logits slots, events below).
  CudaStream stream;
  CudaStream gemm_stream;
  std::array<CudaEvent, 2> slot_filled;  // gemm_stream: chunk g's logits are in slot g % 2
  std::array<CudaEvent, 2> slot_free;    // stream: chunk g's readers are done with slot g % 2
  CudaEvent slots_released;              // stream: JSD pass done with the tile's kept chunks
  CudaEvent gemm_idle;                   // joins gemm_stream into stream
  LtHandle lt;
  DeviceBuffer cublas_workspace;
  DeviceBuffer workspace;              // per-job scratch, grown on demand
  PinnedBuffer host_staging;           // hidden rows from pageable memory, two tiles per input
  PinnedBuffer host_io;                // target ids up, outputs down: asynchronous copies
  std::unique_ptr<Communicator> comm;  // null when the backend has one rank
  NcclCommunicator* nccl = nullptr;    // comm, when it is NCCL
  std::array<CudaEvent, kTileEvents> tile_done;  // tile t recorded in tile_done[t % kTileEvents]
  CudaEvent idle;                                // "everything queued so far is done"
  ~Rank() {
    comm.reset();  // before the stream it uses
    DeviceGuard guard(device);
    workspace.Free();
    cublas_workspace.Free();
  }
};

// A head resident on the backend's devices: each rank's vocabulary slice, split into exact bf16
// parts (1 for bf16 heads, 2 for fp16, 3 for fp32: values never change), padded with zero rows to
// whole GEMM chunks and with zero columns to a hidden size that is a multiple of 8, plus the bias.
class CudaHead final : public PreparedHead {
 public:
  struct Shard {
    int64_t begin = 0;  // vocabulary ids [begin, end)
    int64_t end = 0;
    int64_t padded_rows = 0;  // end - begin rounded up to kCudaVocabChunk
    DeviceBuffer weights;     // parts x [padded_rows][k_pad] bf16
    DeviceBuffer bias;        // [padded_rows] fp32, or empty
    std::shared_ptr<const CudaTileGemm> gemm;
  };

  CudaHead(std::shared_ptr<const HeadWeights> w, const void* owner)
      : PreparedHead(std::move(w)), owner(owner) {}

  const uint16_t* Part(int rank, int part) const {
    const Shard& s = shards[static_cast<size_t>(rank)];
    return s.weights.as<uint16_t>(static_cast<size_t>(part) * static_cast<size_t>(s.padded_rows) *
                                  static_cast<size_t>(k_pad) * sizeof(uint16_t));
  }

  const void* owner;  // the backend that prepared it
  int64_t k_pad = 0;
  int parts = 1;
  std::vector<Shard> shards;  // one per rank
};

// Read-only description of one job, shared by the rank workers.
struct JobPlan {
  const ScoreJob* job = nullptr;
  std::vector<ShardRange> layout;
  kc::ShardBlocks shards;
  int64_t num_blocks = 0;
  int64_t max_blocks = 0;
  bool pair = false;
  bool jsd_pass = false;  // 0 < beta < 1: second pass
  int32_t jsd_endpoint = 0;
  bool any_hidden = false;
  // Hidden mode: the GEMMs run on the rank's second stream, overlapping the statistics of the
  // previous chunk (CudaBackendOptions::overlap_hidden_gemms); else both on one stream.
  bool overlap_gemms = false;
  int64_t tile_rows = 0;   // rows per tile (the last tile may hold fewer)
  int64_t chunk_cols = 0;  // vocabulary columns per statistics launch
  kc::TileMessage msg;
  std::vector<bool> model_zero_copy;  // per rank: the model logits already live on its device
  std::vector<bool> ref_zero_copy;
  // Some logits input lives in pageable host memory: its per-tile copy waits (in the driver,
  // without a time limit) for the rank's stream, so a rank lets only one tile run ahead of the
  // host. (Pageable hidden states are staged through pinned memory instead: no such wait.)
  bool pageable_logits = false;
  bool model_pageable_hidden = false;
  bool ref_pageable_hidden = false;
};

// CudaBackendOptions::test_fault, parsed.
struct TestFault {
  enum Kind { kNone, kSkipCollective, kStall, kStickyError };
  Kind kind = kNone;
  int rank = -1;
};

absl::StatusOr<TestFault> ParseTestFault(const std::string& text, int ranks) {
  TestFault f;
  if (text.empty()) return f;
  const size_t colon = text.find(':');
  const std::string kind = text.substr(0, colon);
  if (kind == "skip-collective") {
    f.kind = TestFault::kSkipCollective;
  } else if (kind == "stall") {
    f.kind = TestFault::kStall;
  } else if (kind == "sticky-error") {
    f.kind = TestFault::kStickyError;
  }
  int rank = -1;
  if (f.kind == TestFault::kNone || colon == std::string::npos ||
      !absl::SimpleAtoi(text.substr(colon + 1), &rank) || rank < 0 || rank >= ranks) {
    return absl::InvalidArgumentError(
        absl::StrCat("test fault '", text,
                     "': expected skip-collective:R, stall:R or sticky-error:R with R a "
                     "rank in [0, ",
                     ranks, ")"));
  }
  f.rank = rank;
  return f;
}

// The first failure of a job, shared by its rank threads so that every rank takes the same
// decision before each collective. Ranks meet at numbered checkpoints (the same sequence on every
// rank: one before each all-gather); a rank that failed since its previous checkpoint records the
// checkpoint's number, and after the barrier every rank compares the recorded number with its own:
// all stop at the same checkpoint, so none is left waiting in a collective its peers skipped.
// Later failures (a rank that has already passed checkpoint s failing before s + 1) cannot change
// the decision at s: they record s + 1 or later.
class JobFailure {
 public:
  explicit JobFailure(int ranks) : barrier_(ranks) {}
  // Every rank calls this at checkpoint `step` with its failure since the previous one. True:
  // some rank failed (at this checkpoint or before); every rank gets the same answer.
  bool Failed(int64_t step, int rank, bool failed_locally) {
    if (failed_locally) {
      absl::MutexLock lock(&mu_);
      if (step < step_ || (step == step_ && rank < rank_)) {
        step_ = step;
        rank_ = rank;
      }
    }
    if (barrier_.size() > 1) barrier_.Wait();
    absl::MutexLock lock(&mu_);
    return step_ <= step;
  }
  // Records a failure after the last checkpoint (nothing depends on it but the returned status).
  void Note(int rank) {
    absl::MutexLock lock(&mu_);
    if (rank_ < 0) rank_ = rank;
  }
  // The rank whose status the job returns, or -1.
  int rank() const {
    absl::MutexLock lock(&mu_);
    return rank_;
  }

 private:
  HostBarrier barrier_;
  mutable absl::Mutex mu_;
  int64_t step_ ABSL_GUARDED_BY(mu_) = std::numeric_limits<int64_t>::max();
  int rank_ ABSL_GUARDED_BY(mu_) = -1;
};

// What a rank reports when another rank failed: ABORTED, naming the shard whose own status the
// job returns.
absl::Status PeerFailed(int rank) {
  return absl::AbortedError(absl::StrCat("vocabulary shard ", rank, " failed"));
}

// Where a pointer lives: the device holding it, or -1 for host memory.
int DeviceOf(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();  // older drivers report unregistered host memory as an error
    return -1;
  }
  return attr.type == cudaMemoryTypeDevice ? attr.device : -1;
}

// Whether p is host memory that CUDA does not know (neither pinned nor managed nor device).
bool IsPageable(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();
    return true;
  }
  return attr.type == cudaMemoryTypeUnregistered;
}

k::PairBlockStats* StatsOf(uint8_t* msg, const kc::TileMessage& m) {
  return reinterpret_cast<k::PairBlockStats*>(msg + m.stats_offset);
}

// ---- One rank's part of one job --------------------------------------------------------------

class RankWorker {
 public:
  RankWorker(Rank& rank, const JobPlan& plan, int num_ranks, JobFailure& failure, FatalState& fatal,
             absl::Duration timeout, int64_t test_fail_step, TestFault fault)
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
        fault_(fault.rank == rank.index ? fault.kind : TestFault::kNone) {}

  // Allocates the job's workspace and uploads the target ids. No collectives.
  absl::Status Prepare();
  // Every tile. Before each collective the ranks agree (JobFailure) whether any of them failed;
  // if so, all return there (the failing rank its own status, the others PeerFailed). A stop
  // (job.CheckStop(), before every tile) is such a failure.
  absl::Status Run();
  // Every rank waits (watchdog) until its stream is idle, so nothing queued outlives the job;
  // then, when `copy` (the job succeeded), rank 0 copies the outputs into `result` and the
  // bad-row markers into first_bad. Every rank checks NCCL.
  absl::Status Finish(bool copy, ScoreResult* result, int32_t* first_bad);

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
    uint8_t* raw = nullptr;  // [tile_rows][H] of the input dtype
    // Pageable hidden states: two pinned host tiles [tile_rows][H] (tile t uses t % 2), filled by
    // the host thread while the GPU works on earlier tiles, then copied asynchronously.
    std::array<uint8_t*, 2> pinned{};
    uint16_t* x_parts = nullptr;  // hidden_parts x [kCudaRowTile][k_pad]
    float* slots = nullptr;       // n_slots x [kCudaRowTile][kCudaVocabChunk]
    int64_t n_slots = 0;
    kc::LoadTransform transform;
  };

  void SetUpDist(Dist& d, const DistributionInput& in, bool zero_copy, Carver& carver,
                 std::vector<std::pair<Dist*, std::array<size_t, 4>>>& offsets);
  absl::Status IssueUploads();
  absl::Status BeginTile(Dist& d, int64_t row0, int64_t rows);
  // The source for chunk c; hidden mode reads logits slot `slot` and runs its GEMMs into it first
  // (on gemm_stream) when `compute`.
  absl::StatusOr<kc::LogitsSource> Source(Dist& d, int64_t c, int64_t row0, bool compute,
                                          int64_t slot);
  absl::Status ComputeTile(int64_t row0, int64_t rows);
  absl::Status FoldTile(int64_t row0, int64_t rows);
  absl::Status JsdTile(int64_t row0, int64_t rows);
  absl::Status JsdGatherAndFinish(int64_t row0, int64_t rows);
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

  Dist model_, ref_;
  uint8_t* send_ = nullptr;
  uint8_t* recv_ = nullptr;
  float* partial_send_ = nullptr;
  float* topk_scratch_ = nullptr;  // the top-k kernels' lane maxima of one source
  float* partial_recv_ = nullptr;
  k::RowStats* folded_a_ = nullptr;
  k::RowStats* folded_b_ = nullptr;
  int32_t* first_bad_ = nullptr;
  int32_t* ids_ = nullptr;
  size_t io_outputs_at_ = 0;  // where the outputs start in rank_.host_io
  bool uploads_pending_ = false;
  kc::RowOutputs outputs_;
};

void RankWorker::SetUpDist(Dist& d, const DistributionInput& in, bool zero_copy, Carver& carver,
                           std::vector<std::pair<Dist*, std::array<size_t, 4>>>& offsets) {
  d.in = &in;
  d.hidden = in.hidden_mode();
  std::array<size_t, 4> off{};  // staging, raw, x_parts, slots
  const size_t rows = static_cast<size_t>(plan_.tile_rows);
  if (!d.hidden) {
    d.zero_copy = zero_copy;
    d.transform.temperature = in.temperature;
    if (!zero_copy && shard_width_ > 0) {
      d.staging_ld = RoundUp(shard_width_, 8);
      off[0] = carver.Add(rows * static_cast<size_t>(d.staging_ld * k::SizeOf(in.logits.type)));
    }
  } else {
    d.head = static_cast<const CudaHead*>(in.head.get());
    d.hidden_parts = kc::PartsFor(in.hidden.type);
    const HeadTransform& ht = d.head->weights().transform;
    d.transform.head = true;
    if (ht.logits_scaling != 1.0f) {  // the CPU backend's choice, kept identical
      d.transform.scale = ht.logits_scaling;
      d.transform.divide_by_scale = true;
    } else {
      d.transform.scale = ht.logit_scale;
    }
    d.transform.softcap = ht.softcap;
    d.transform.temperature = in.temperature;
    if (shard_width_ > 0) {
      const size_t h = static_cast<size_t>(in.hidden.cols);
      off[1] = carver.Add(rows * h * static_cast<size_t>(k::SizeOf(in.hidden.type)));
      off[2] = carver.Add(static_cast<size_t>(d.hidden_parts) * rows *
                          static_cast<size_t>(d.head->k_pad) * sizeof(uint16_t));
      // JSD's second pass reads the tile's logits again: keep every chunk rather than recompute.
      // Otherwise two slots: the GEMMs fill one while the statistics read the other.
      d.n_slots = plan_.jsd_pass ? num_chunks_ : 2;
      off[3] = carver.Add(static_cast<size_t>(d.n_slots) * rows *
                          static_cast<size_t>(kCudaVocabChunk) * sizeof(float));
    }
  }
  offsets.emplace_back(&d, off);
}

absl::Status RankWorker::Prepare() {
  DeviceGuard guard(rank_.device);
  if (auto s = guard.status(); !s.ok()) return s;
  const kc::TileMessage& m = plan_.msg;
  const size_t rows = static_cast<size_t>(plan_.tile_rows);
  const size_t n = static_cast<size_t>(job_.rows);
  Carver carver;
  const size_t send_at = carver.Add(m.bytes);
  const size_t recv_at = num_ranks_ > 1 ? carver.Add(m.bytes * static_cast<size_t>(num_ranks_)) : 0;
  const size_t partial_bytes = rows * static_cast<size_t>(plan_.max_blocks) * sizeof(float);
  const size_t psend_at = plan_.jsd_pass ? carver.Add(partial_bytes) : 0;
  const size_t precv_at = plan_.jsd_pass && num_ranks_ > 1
                              ? carver.Add(partial_bytes * static_cast<size_t>(num_ranks_))
                              : 0;
  const size_t topk_scratch_at =
      job_.top_k > 0 ? carver.Add(kc::TopKScratchBytes(plan_.tile_rows, plan_.max_blocks)) : 0;
  const size_t fa_at = carver.Add(rows * sizeof(k::RowStats));
  const size_t fb_at = carver.Add(rows * sizeof(k::RowStats));
  const size_t bad_at = carver.Add(2 * sizeof(int32_t));
  const size_t ids_count = n * static_cast<size_t>(job_.ids_per_row);
  const size_t ids_at = carver.Add(ids_count * sizeof(int32_t));
  // Outputs (rank 0 only).
  const size_t topk_count = n * static_cast<size_t>(job_.top_k);
  size_t out_at[8] = {};
  if (reports_) {
    out_at[0] = carver.Add(ids_count * sizeof(float));
    out_at[1] = carver.Add(topk_count * sizeof(int32_t));
    out_at[2] = carver.Add(topk_count * sizeof(float));
    for (int i = 3; i < 8; ++i) out_at[i] = carver.Add(n * sizeof(float));
  }
  std::vector<std::pair<Dist*, std::array<size_t, 4>>> dist_offsets;
  SetUpDist(model_, job_.model, plan_.model_zero_copy[static_cast<size_t>(rank_.index)], carver,
            dist_offsets);
  if (plan_.pair) {
    SetUpDist(ref_, job_.reference, plan_.ref_zero_copy[static_cast<size_t>(rank_.index)], carver,
              dist_offsets);
  }
  if (auto s = rank_.workspace.Reserve(rank_.device, carver.total()); !s.ok()) return s;
  // Pinned tiles for pageable hidden states.
  {
    std::vector<std::pair<Dist*, size_t>> pinned;
    size_t pinned_total = 0;
    auto want = [&](Dist& d, const DistributionInput& in, bool pageable) {
      d.pinned = {};
      if (!pageable || !in.hidden_mode() || shard_width_ == 0) return;
      const size_t bytes =
          static_cast<size_t>(plan_.tile_rows * in.hidden.cols * k::SizeOf(in.hidden.type));
      pinned.emplace_back(&d, bytes);
      pinned_total += 2 * ((bytes + 255) / 256 * 256);
    };
    want(model_, job_.model, plan_.model_pageable_hidden);
    if (plan_.pair) want(ref_, job_.reference, plan_.ref_pageable_hidden);
    if (auto s = rank_.host_staging.Reserve(pinned_total); !s.ok()) return s;
    size_t at = 0;
    for (auto& [d, bytes] : pinned) {
      for (uint8_t*& p : d->pinned) {
        p = rank_.host_staging.data() + at;
        at += (bytes + 255) / 256 * 256;
      }
    }
  }
  uint8_t* base = rank_.workspace.as<uint8_t>();
  send_ = base + send_at;
  recv_ = num_ranks_ > 1 ? base + recv_at : send_;
  partial_send_ = reinterpret_cast<float*>(base + psend_at);
  partial_recv_ = num_ranks_ > 1 ? reinterpret_cast<float*>(base + precv_at) : partial_send_;
  topk_scratch_ = reinterpret_cast<float*>(base + topk_scratch_at);
  folded_a_ = reinterpret_cast<k::RowStats*>(base + fa_at);
  folded_b_ = reinterpret_cast<k::RowStats*>(base + fb_at);
  first_bad_ = reinterpret_cast<int32_t*>(base + bad_at);
  ids_ = reinterpret_cast<int32_t*>(base + ids_at);
  for (auto& [d, off] : dist_offsets) {
    d->staging = base + off[0];
    d->raw = base + off[1];
    d->x_parts = reinterpret_cast<uint16_t*>(base + off[2]);
    d->slots = reinterpret_cast<float*>(base + off[3]);
  }
  if (reports_) {
    outputs_.target_ids = ids_;
    outputs_.ids_per_row = job_.ids_per_row;
    outputs_.ignore_index = job_.ignore_index;
    if (ids_count > 0) outputs_.target_logprobs = reinterpret_cast<float*>(base + out_at[0]);
    outputs_.top_k = job_.top_k;
    if (topk_count > 0) {
      outputs_.top_k_ids = reinterpret_cast<int32_t*>(base + out_at[1]);
      outputs_.top_k_logprobs = reinterpret_cast<float*>(base + out_at[2]);
    }
    if (job_.entropy) outputs_.entropy = reinterpret_cast<float*>(base + out_at[3]);
    if (job_.reference_entropy)
      outputs_.reference_entropy = reinterpret_cast<float*>(base + out_at[4]);
    if (job_.forward_kl) outputs_.forward_kl = reinterpret_cast<float*>(base + out_at[5]);
    if (job_.reverse_kl) outputs_.reverse_kl = reinterpret_cast<float*>(base + out_at[6]);
    if (job_.jsd_beta) outputs_.jsd = reinterpret_cast<float*>(base + out_at[7]);
    outputs_.jsd_endpoint = plan_.jsd_endpoint;
  }
  // Pinned staging for the small host <-> device copies: a copy from or to pageable memory is
  // staged by the driver and synchronous (~10 us each on the H200 machine); these are
  // asynchronous and the job waits once, at its end. Layout: ids, then each requested output.
  const auto align = [](size_t x) { return (x + 255) / 256 * 256; };
  size_t io_bytes = align(ids_count * sizeof(int32_t)) + align(2 * sizeof(int32_t));
  if (reports_) {
    io_bytes += align(ids_count * sizeof(float)) + 2 * align(topk_count * sizeof(float)) +
                5 * align(n * sizeof(float));
  }
  if (auto s = rank_.host_io.Reserve(io_bytes); !s.ok()) return s;
  if (ids_count > 0) {
    std::memcpy(rank_.host_io.data(), job_.target_ids.data(), ids_count * sizeof(int32_t));
  }
  io_outputs_at_ = align(ids_count * sizeof(int32_t));
  uploads_pending_ = true;  // queued behind the first statistics launch (IssueUploads)
  return absl::OkStatus();
}

// The job's small set-up copies (target ids up, the bad-row sentinel), queued on the stream
// after the first statistics kernel rather than before it: nothing before the gather and the
// fold reads them, and the statistics kernel then starts without waiting for them (a few us of
// copy latency each on the critical path otherwise).
absl::Status RankWorker::IssueUploads() {
  if (!uploads_pending_) return absl::OkStatus();
  uploads_pending_ = false;
  LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(first_bad_, 0x7f, 2 * sizeof(int32_t), stream()));
  const size_t ids_count = static_cast<size_t>(job_.rows) * static_cast<size_t>(job_.ids_per_row);
  if (ids_count > 0) {
    LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(
        ids_, rank_.host_io.data(), ids_count * sizeof(int32_t), cudaMemcpyHostToDevice, stream()));
  }
  return absl::OkStatus();
}

absl::Status RankWorker::BeginTile(Dist& d, int64_t row0, int64_t rows) {
  if (shard_width_ == 0) return absl::OkStatus();
  if (!d.hidden) {
    if (d.zero_copy) return absl::OkStatus();
    const int64_t es = k::SizeOf(d.in->logits.type);
    const auto* src =
        static_cast<const uint8_t*>(d.in->logits.data) + (row0 * job_.vocab + shard_.begin) * es;
    LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaMemcpy2DAsync(
        d.staging, static_cast<size_t>(d.staging_ld * es), src,
        static_cast<size_t>(job_.vocab * es), static_cast<size_t>(shard_width_ * es),
        static_cast<size_t>(rows), cudaMemcpyDefault, stream()));
    return absl::OkStatus();
  }
  const MatrixView& h = d.in->hidden;
  const int64_t es = k::SizeOf(h.type);
  const size_t bytes = static_cast<size_t>(rows * h.cols * es);
  const uint8_t* src = static_cast<const uint8_t*>(h.data) + row0 * h.cols * es;
  if (d.pinned[0] != nullptr) {
    // Run() has waited for tile t - 2, the last reader of this pinned tile.
    uint8_t* pinned = d.pinned[static_cast<size_t>((row0 / plan_.tile_rows) % 2)];
    std::memcpy(pinned, src, bytes);
    src = pinned;
  }
  // On gemm_stream, behind the previous tile's GEMMs (the only readers of raw and x_parts).
  LOGITSERVE_RETURN_IF_CUDA_ERROR(
      cudaMemcpyAsync(d.raw, src, bytes, cudaMemcpyDefault, gemm_stream()));
  // Rows past `rows` become zeros: the GEMM always multiplies kCudaRowTile rows.
  LOGITSERVE_RETURN_IF_CUDA_ERROR(kc::LaunchSplitToBf16(
      h.type, d.raw, h.cols, rows, h.cols, d.hidden_parts, d.x_parts, kCudaRowTile, d.head->k_pad,
      static_cast<size_t>(kCudaRowTile * d.head->k_pad), gemm_stream()));
  return absl::OkStatus();
}

absl::StatusOr<kc::LogitsSource> RankWorker::Source(Dist& d, int64_t c, int64_t row0, bool compute,
                                                    int64_t slot_index) {
  const int64_t cc0 = c * plan_.chunk_cols;  // shard-local first column of the chunk
  kc::LogitsSource src;
  src.col0 = shard_.begin + cc0;
  src.cols = std::min(plan_.chunk_cols, shard_width_ - cc0);
  src.transform = d.transform;
  if (!d.hidden) {
    src.type = d.in->logits.type;
    const int64_t es = k::SizeOf(src.type);
    if (d.zero_copy) {
      src.data = static_cast<const uint8_t*>(d.in->logits.data) +
                 (row0 * job_.vocab + shard_.begin + cc0) * es;
      src.ld = job_.vocab;
    } else {
      src.data = d.staging + cc0 * es;
      src.ld = d.staging_ld;
    }
    return src;
  }
  // Hidden mode: chunk c of the head shard (whole kCudaVocabChunk rows, zero-padded).
  float* slot = d.slots + slot_index * kCudaRowTile * kCudaVocabChunk;
  const CudaHead& head = *d.head;
  const CudaHead::Shard& hs = head.shards[static_cast<size_t>(rank_.index)];
  if (compute) {
    const size_t x_stride = static_cast<size_t>(kCudaRowTile * head.k_pad);
    for (int j = 0; j < d.hidden_parts; ++j) {
      for (int i = 0; i < head.parts; ++i) {
        const uint16_t* w = head.Part(rank_.index, i) + cc0 * head.k_pad;
        if (auto s = hs.gemm->Run(rank_.lt.get(), w, d.x_parts + j * x_stride, slot,
                                  /*accumulate=*/(i | j) != 0, rank_.cublas_workspace.data(),
                                  gemm_stream());
            !s.ok()) {
          return s;
        }
      }
    }
  }
  src.type = k::FloatType::kFloat32;
  src.data = slot;
  src.ld = kCudaVocabChunk;
  if (hs.bias.data() != nullptr) src.transform.bias = hs.bias.as<float>() + cc0;
  return src;
}

absl::Status RankWorker::ComputeTile(int64_t row0, int64_t rows) {
  const kc::TileMessage& m = plan_.msg;
  // Two streams in hidden mode (see Rank). Chunk g of the job (over all tiles) goes to slot g % 2:
  // its GEMMs wait until the statistics of chunk g - 2 are done with that slot, and its statistics
  // wait until its GEMMs are done. With a JSD pass every chunk of the tile keeps its own slot until
  // the pass, so the tile's GEMMs wait for the previous tile's pass instead. Both streams' order
  // and every kernel's inputs are those of one stream: the bits do not change.
  const bool split = plan_.any_hidden && plan_.overlap_gemms;
  auto wait = [](cudaStream_t waiter, const CudaEvent& e) {
    return CudaStatus(cudaStreamWaitEvent(waiter, e.get(), 0), "cudaStreamWaitEvent", __FILE__,
                      __LINE__);
  };
  auto record = [](const CudaEvent& e, cudaStream_t on) {
    return CudaStatus(cudaEventRecord(e.get(), on), "cudaEventRecord", __FILE__, __LINE__);
  };
  if (split && plan_.jsd_pass && row0 > 0) {
    if (auto s = wait(gemm_stream(), rank_.slots_released); !s.ok()) return s;
  }
  if (auto s = BeginTile(model_, row0, rows); !s.ok()) return s;
  if (plan_.pair) {
    if (auto s = BeginTile(ref_, row0, rows); !s.ok()) return s;
  }
  k::PairBlockStats* stats = StatsOf(send_, m);
  auto* lists = reinterpret_cast<k::TopKEntry*>(send_ + m.topk_offset);
  auto* counts = reinterpret_cast<int32_t*>(send_ + m.count_offset);
  auto* targets = reinterpret_cast<float*>(send_ + m.target_offset);
  bool cleared = false;  // the uploads are issued and the top-k counts cleared (below)
  for (int64_t c = 0; c < num_chunks_; ++c) {
    const int64_t g = chunk_seq_++;
    const size_t e = static_cast<size_t>(g % 2);
    const int64_t slot = plan_.jsd_pass ? c : g % 2;
    if (split && !plan_.jsd_pass && g >= 2) {
      if (auto s = wait(gemm_stream(), rank_.slot_free[e]); !s.ok()) return s;
    }
    absl::StatusOr<kc::LogitsSource> a = Source(model_, c, row0, /*compute=*/true, slot);
    if (!a.ok()) return a.status();
    absl::StatusOr<kc::LogitsSource> b;
    if (plan_.pair) {
      b = Source(ref_, c, row0, /*compute=*/true, slot);
      if (!b.ok()) return b.status();
    }
    if (split) {
      if (auto s = record(rank_.slot_filled[e], gemm_stream()); !s.ok()) return s;
      if (auto s = wait(stream(), rank_.slot_filled[e]); !s.ok()) return s;
    }
    const int64_t local_block = c * plan_.chunk_cols / k::kVocabBlock;
    const kc::LogitsSource* ref = plan_.pair ? &*b : nullptr;
    if (job_.top_k > 0) {
      // Only the top-k counts need a defined start: every statistics record and every target
      // logit the fold reads is written by this tile's kernels (a target id is read from the
      // rank whose columns hold it).
      if (c == 0) {
        LOGITSERVE_RETURN_IF_CUDA_ERROR(
            cudaMemsetAsync(counts, 0, sizeof(int32_t) * static_cast<size_t>(rows), stream()));
      }
      LOGITSERVE_RETURN_IF_CUDA_ERROR(kc::LaunchBlockStatsTopK(*a, ref, rows, stats, m.max_blocks,
                                                               local_block, job_.top_k, lists,
                                                               counts, topk_scratch_, stream()));
    } else {
      LOGITSERVE_RETURN_IF_CUDA_ERROR(
          kc::LaunchBlockStats(*a, ref, rows, stats, m.max_blocks, local_block, stream()));
    }
    if (c == 0) {
      cleared = true;
      if (auto s = IssueUploads(); !s.ok()) return s;
    }
    if (job_.ids_per_row > 0) {
      LOGITSERVE_RETURN_IF_CUDA_ERROR(kc::LaunchGatherTargets(
          *a, rows, ids_ + row0 * job_.ids_per_row, job_.ids_per_row, targets, stream()));
    }
    if (split && !plan_.jsd_pass) {
      if (auto s = record(rank_.slot_free[e], stream()); !s.ok()) return s;
    }
  }
  if (!cleared && job_.top_k > 0) {  // a shard without columns: empty lists
    LOGITSERVE_RETURN_IF_CUDA_ERROR(
        cudaMemsetAsync(counts, 0, sizeof(int32_t) * static_cast<size_t>(rows), stream()));
  }
  return absl::OkStatus();
}

absl::Status RankWorker::FoldTile(int64_t row0, int64_t rows) {
  if (auto s = IssueUploads(); !s.ok()) return s;  // a shard without columns launched nothing
  kc::GatheredTile tile;
  tile.messages = recv_;
  tile.layout = plan_.msg;
  tile.shards = plan_.shards;
  tile.num_blocks = plan_.num_blocks;
  tile.pair = plan_.pair;
  LOGITSERVE_RETURN_IF_CUDA_ERROR(
      kc::LaunchFoldRows(tile, rows, row0, kc::FoldedRows{folded_a_, folded_b_}, first_bad_,
                         reports_ ? &outputs_ : nullptr, stream()));
  return absl::OkStatus();
}

absl::Status RankWorker::JsdTile(int64_t row0, int64_t rows) {
  const size_t bytes = static_cast<size_t>(plan_.tile_rows * plan_.max_blocks) * sizeof(float);
  LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(partial_send_, 0, bytes, stream()));
  for (int64_t c = 0; c < num_chunks_; ++c) {
    // Logits mode reads the staged (or resident) tile again; hidden mode its kept chunks.
    absl::StatusOr<kc::LogitsSource> s = Source(model_, c, row0, /*compute=*/false, c);
    if (!s.ok()) return s.status();
    absl::StatusOr<kc::LogitsSource> t = Source(ref_, c, row0, /*compute=*/false, c);
    if (!t.ok()) return t.status();
    const int64_t local_block = c * plan_.chunk_cols / k::kVocabBlock;
    LOGITSERVE_RETURN_IF_CUDA_ERROR(kc::LaunchJsdPartials(*s, *t, rows, folded_a_, folded_b_,
                                                          *job_.jsd_beta, partial_send_,
                                                          plan_.max_blocks, local_block, stream()));
  }
  // The next tile's GEMMs may overwrite the kept chunks now.
  if (plan_.any_hidden) {
    LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaEventRecord(rank_.slots_released.get(), stream()));
  }
  return absl::OkStatus();
}

absl::Status RankWorker::JsdGatherAndFinish(int64_t row0, int64_t rows) {
  if (!reports_) return absl::OkStatus();
  LOGITSERVE_RETURN_IF_CUDA_ERROR(kc::LaunchJsdFinish(
      partial_recv_, static_cast<size_t>(plan_.tile_rows * plan_.max_blocks), plan_.max_blocks,
      plan_.shards, plan_.num_blocks, folded_a_, folded_b_, rows, row0, outputs_.jsd, stream()));
  return absl::OkStatus();
}

absl::Status RankWorker::WaitFor(cudaEvent_t event, const char* what) {
  return PollUntil(
      [&]() -> absl::StatusOr<bool> {
        const cudaError_t q = cudaEventQuery(event);
        if (q == cudaSuccess) return true;
        if (q != cudaErrorNotReady) return CudaStatus(q, "cudaEventQuery", __FILE__, __LINE__);
        if (rank_.nccl != nullptr) {
          if (absl::Status s = rank_.nccl->AsyncError(); !s.ok()) return s;
        }
        return false;
      },
      timeout_, &fatal_,
      absl::StrCat(what, " on GPU ", rank_.device, " (vocabulary shard ", rank_.index, ")"));
}

absl::Status RankWorker::WaitIdle(const char* what) {
  LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaEventRecord(rank_.gemm_idle.get(), gemm_stream()));
  LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(stream(), rank_.gemm_idle.get(), 0));
  LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaEventRecord(rank_.idle.get(), stream()));
  return WaitFor(rank_.idle.get(), what);
}

absl::Status RankWorker::InjectFault() {
  switch (fault_) {
    case TestFault::kStall:
      LOGITSERVE_RETURN_IF_CUDA_ERROR(kc::LaunchTestStall(
          static_cast<uint64_t>(absl::ToInt64Nanoseconds(3 * timeout_)), stream()));
      break;
    case TestFault::kStickyError:
      LOGITSERVE_RETURN_IF_CUDA_ERROR(kc::LaunchTestIllegalStore(nullptr, stream()));
      break;
    case TestFault::kSkipCollective:  // in Run
    case TestFault::kNone:
      break;
  }
  return absl::OkStatus();
}

absl::Status RankWorker::Run() {
  DeviceGuard guard(rank_.device);
  if (auto s = guard.status(); !s.ok()) return s;
  int64_t step = 0;
  absl::Status local = absl::OkStatus();  // the first failure since the previous checkpoint
  auto note = [&](absl::Status s) {
    if (s.ok()) return;
    if (IsFatalDeviceError(s)) fatal_.Fail(s);
    if (local.ok()) local = std::move(s);
  };
  // A checkpoint: true when the job stops here; `local` then holds this rank's status.
  auto stop = [&]() {
    if (step == test_fail_step_) note(absl::InternalError("injected failure (test_fail_step)"));
    const bool stop_here = failure_.Failed(step++, rank_.index, !local.ok());
    if (stop_here && local.ok()) local = PeerFailed(failure_.rank());
    return stop_here;
  };
  int64_t gathers = 0;
  auto gather = [&](const void* send, void* recv, size_t bytes) {
    if (num_ranks_ == 1) return;
    // Test fault: only the job's first gather (NCCL connections are up; the peers then wait on
    // the GPU for gathers that never come).
    if (fault_ == TestFault::kSkipCollective && gathers++ > 0) return;
    note(rank_.comm->AllGather(send, recv, bytes));
  };
  // At most `depth` tiles queued ahead of the host. Two keep the GPU busy while the host queues
  // the next tile; one where a pageable copy would wait for the stream inside the driver anyway.
  const int64_t depth = plan_.pageable_logits ? 1 : kTileEvents;
  for (int64_t t = 0, row0 = 0; row0 < job_.rows; ++t, row0 += plan_.tile_rows) {
    const int64_t rows = std::min(plan_.tile_rows, job_.rows - row0);
    if (local.ok() && t >= depth) {
      note(WaitFor(rank_.tile_done[static_cast<size_t>((t - depth) % kTileEvents)].get(),
                   "row tile"));
    }
    // A stop (cancelled / expired) travels like a failure: every rank ends at this tile, and
    // nothing of it has been queued.
    if (local.ok()) note(job_.CheckStop(rows));
    if (local.ok()) note(ComputeTile(row0, rows));
    if (stop()) return local;
    gather(send_, recv_, plan_.msg.bytes);
    if (local.ok()) note(FoldTile(row0, rows));
    if (plan_.jsd_pass) {
      if (local.ok()) note(JsdTile(row0, rows));
      if (stop()) return local;
      gather(partial_send_, partial_recv_,
             static_cast<size_t>(plan_.tile_rows * plan_.max_blocks) * sizeof(float));
      if (local.ok()) note(JsdGatherAndFinish(row0, rows));
    }
    // Test faults go after the first tile's work: the next tile's wait (or Finish's) meets them.
    if (local.ok() && t == 0) note(InjectFault());
    if (local.ok()) {
      note(CudaStatus(
          cudaEventRecord(rank_.tile_done[static_cast<size_t>(t % kTileEvents)].get(), stream()),
          "cudaEventRecord", __FILE__, __LINE__));
    }
  }
  // No collective follows: a failure after the last checkpoint only needs reporting.
  if (!local.ok()) failure_.Note(rank_.index);
  return local;
}

absl::Status RankWorker::Finish(bool copy, ScoreResult* result, int32_t* first_bad) {
  DeviceGuard guard(rank_.device);
  if (auto s = guard.status(); !s.ok()) return s;
  if (copy) {
    if (auto s = IssueUploads(); !s.ok()) return s;
  }
  // Work still queued reads the request's memory and this rank's workspace: it must be done
  // before Score returns. The reporting rank's output copies go to pinned memory (asynchronous,
  // queued behind that work), so one wait after them covers both; every other rank waits here.
  if (!(copy && reports_)) {
    if (absl::Status s = WaitIdle("job end"); !s.ok()) return s;
  }
  if (copy && reports_) {
    // Asynchronous copies into the pinned staging (see Prepare), one wait, then host copies.
    uint8_t* io = rank_.host_io.data();
    size_t at = io_outputs_at_;
    std::vector<std::pair<std::pair<void*, size_t>, size_t>> back;  // (dst, bytes), staging at
    auto copy_out = [&](auto& vec, const void* dev) -> absl::Status {
      if (vec.empty() || dev == nullptr) return absl::OkStatus();
      const size_t bytes = vec.size() * sizeof(vec[0]);
      LOGITSERVE_RETURN_IF_CUDA_ERROR(
          cudaMemcpyAsync(io + at, dev, bytes, cudaMemcpyDeviceToHost, stream()));
      back.push_back({{vec.data(), bytes}, at});
      at += (bytes + 255) / 256 * 256;
      return absl::OkStatus();
    };
    for (absl::Status s :
         {copy_out(result->target_logprobs, outputs_.target_logprobs),
          copy_out(result->top_k_ids, outputs_.top_k_ids),
          copy_out(result->top_k_logprobs, outputs_.top_k_logprobs),
          copy_out(result->entropy, outputs_.entropy),
          copy_out(result->reference_entropy, outputs_.reference_entropy),
          copy_out(result->forward_kl, outputs_.forward_kl),
          copy_out(result->reverse_kl, outputs_.reverse_kl), copy_out(result->jsd, outputs_.jsd)}) {
      if (!s.ok()) return s;
    }
    LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(io + at, first_bad_, 2 * sizeof(int32_t),
                                                    cudaMemcpyDeviceToHost, stream()));
    if (absl::Status s = WaitIdle("output copy"); !s.ok()) return s;
    std::vector<HostCopy> copies;
    for (const auto& [dst, from] : back) copies.push_back({dst.first, io + from, dst.second});
    CopyOut(copies);
    std::memcpy(first_bad, io + at, 2 * sizeof(int32_t));
  }
  if (rank_.nccl != nullptr) return rank_.nccl->AsyncError();
  return absl::OkStatus();
}

// ---- The backend -----------------------------------------------------------------------------

class CudaBackend final : public Backend {
 public:
  CudaBackend(const CudaBackendOptions& options, std::vector<std::unique_ptr<Rank>> ranks,
              TestFault fault)
      : options_(options), fault_(fault), ranks_(std::move(ranks)) {
    for (auto& r : ranks_) {
      if (r->nccl != nullptr) r->nccl->set_fatal_state(&fatal_);
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
  absl::StatusOr<JobPlan> Plan(const ScoreJob& job) const;
  absl::Status CheckHead(const DistributionInput& in) const;

  const CudaBackendOptions options_;
  const TestFault fault_;
  std::vector<std::unique_ptr<Rank>> ranks_;
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
  if (auto s = guard.status(); !s.ok()) return s;
  LtHandle lt;  // its own handle: the ranks' handles may be busy in a concurrent Score
  if (auto s = lt.Create(); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<CudaTileGemm>> g = CudaTileGemm::Create(lt.get(), k_pad);
  if (!g.ok()) return g.status();
  std::shared_ptr<const CudaTileGemm> shared = *std::move(g);
  gemms_.emplace(std::make_pair(device, k_pad), shared);
  return shared;
}

absl::StatusOr<std::shared_ptr<const PreparedHead>> CudaBackend::PrepareHead(
    std::shared_ptr<const HeadWeights> weights) {
  if (absl::Status h = Health(); !h.ok()) return h;
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
    if (auto s = guard.status(); !s.ok()) return s;
    absl::StatusOr<std::shared_ptr<const CudaTileGemm>> gemm = GemmFor(rank.device, head->k_pad);
    if (!gemm.ok()) return gemm.status();
    shard.gemm = *std::move(gemm);
    shard.padded_rows = RoundUp(width, kCudaVocabChunk);
    const size_t part_elems = static_cast<size_t>(shard.padded_rows * head->k_pad);
    if (auto s = shard.weights.Reserve(
            rank.device, static_cast<size_t>(head->parts) * part_elems * sizeof(uint16_t));
        !s.ok()) {
      return s;
    }
    CudaStream stream;
    if (auto s = stream.Create(rank.device); !s.ok()) return s;
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
    // Rounded up: an empty trailing shard begins at `vocab`, which need not be a block boundary.
    p.shards.begin[r] =
        static_cast<int32_t>(CeilDiv(p.layout[static_cast<size_t>(r)].begin, k::kVocabBlock));
    p.max_blocks = std::max(p.max_blocks, CeilDiv(p.layout[static_cast<size_t>(r)].end -
                                                      p.layout[static_cast<size_t>(r)].begin,
                                                  k::kVocabBlock));
  }
  p.num_blocks = k::NumBlocks(job.vocab);
  p.shards.begin[ranks] = static_cast<int32_t>(p.num_blocks);
  p.pair = job.NeedsReference();
  if (job.jsd_beta) {
    const float beta = *job.jsd_beta;
    p.jsd_endpoint = beta == 0.0f ? 1 : (beta == 1.0f ? 2 : 0);
    p.jsd_pass = p.jsd_endpoint == 0;
  }
  p.any_hidden = job.model.hidden_mode() || (p.pair && job.reference.hidden_mode());
  p.overlap_gemms = options_.overlap_hidden_gemms;
  int64_t widest = 0;
  for (const ShardRange& s : p.layout) widest = std::max(widest, s.end - s.begin);
  p.chunk_cols = p.any_hidden ? kCudaVocabChunk : std::max<int64_t>(widest, 1);

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
    const int64_t width =
        RoundUp(p.layout[static_cast<size_t>(r)].end - p.layout[static_cast<size_t>(r)].begin, 8);
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
  if (p.any_hidden) {
    p.tile_rows = kCudaRowTile;  // the GEMM's shape: fixed, whatever N
  } else {
    // Any tile size gives the same bits in logits mode (rows are independent); this one bounds
    // the staging memory and the per-tile message.
    int64_t rows = kMaxLogitsTileRows;
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
  if (absl::Status h = Health(); !h.ok()) return h;
  if (absl::Status s = StartResult(job, result); !s.ok()) return s;
  if (job.rows == 0) return absl::OkStatus();
  if (auto s = CheckHead(job.model); !s.ok()) return s;
  if (job.NeedsReference()) {
    if (auto s = CheckHead(job.reference); !s.ok()) return s;
  }
  absl::StatusOr<JobPlan> plan = Plan(job);
  if (!plan.ok()) return plan.status();

  absl::MutexLock lock(&score_mu_);
  if (absl::Status h = Health(); !h.ok()) return h;  // failed while this job waited
  const int ranks = static_cast<int>(ranks_.size());
  std::vector<absl::Status> status(static_cast<size_t>(ranks));
  int32_t first_bad[2] = {kNoBadRow, kNoBadRow};
  JobFailure failure(ranks);
  auto fatal_check = [this](const absl::Status& s) {
    if (IsFatalDeviceError(s)) fatal_.Fail(s);
  };
  auto run_rank = [&](int r) {
    RankWorker worker(*ranks_[static_cast<size_t>(r)], *plan, ranks, failure, fatal_,
                      options_.collective_timeout,
                      r == options_.test_fail_rank ? options_.test_fail_step : -1, fault_);
    // Prepare only allocates and uploads; the ranks agree on it before the first collective.
    absl::Status s = worker.Prepare();
    fatal_check(s);
    if (failure.Failed(-1, r, !s.ok())) {
      // Prepare's copy of the target ids may still be queued: let it finish.
      fatal_check(worker.Finish(/*copy=*/false, result, first_bad));
      status[static_cast<size_t>(r)] = s.ok() ? PeerFailed(failure.rank()) : s;
      return;
    }
    s = worker.Run();
    absl::Status f = worker.Finish(/*copy=*/s.ok(), result, first_bad);
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
  if (const int culprit = failure.rank(); culprit >= 0) {
    return status[static_cast<size_t>(culprit)];
  }
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
  // What the aborted collectives held up may now finish; wait a little for it (a sticky error
  // answers at once), since the request's memory is released when Score returns.
  const absl::Duration drain = bound;
  for (auto& r : ranks_) {
    DeviceGuard guard(r->device);
    if (!guard.status().ok() ||
        cudaEventRecord(r->gemm_idle.get(), r->gemm_stream.get()) != cudaSuccess ||
        cudaStreamWaitEvent(r->stream.get(), r->gemm_idle.get(), 0) != cudaSuccess ||
        cudaEventRecord(r->idle.get(), r->stream.get()) != cudaSuccess) {
      continue;
    }
    (void)PollUntil(
        [&]() -> absl::StatusOr<bool> {
          const cudaError_t q = cudaEventQuery(r->idle.get());
          if (q == cudaErrorNotReady) return false;
          return true;  // done, or an error: either way nothing more to wait for
        },
        drain, nullptr, "drain");
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
    if (auto s = guard.status(); !s.ok()) return s;
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
  if (auto s = CheckCudaDevices(options.devices); !s.ok()) return s;
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
  if (options.collective_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("collective_timeout must be > 0");
  }
  absl::StatusOr<TestFault> fault = ParseTestFault(options.test_fault, shards);
  if (!fault.ok()) return fault.status();
  if (fault->kind == TestFault::kSkipCollective && shards > static_cast<int>(devices.size())) {
    return absl::InvalidArgumentError(
        "test fault skip-collective needs one vocabulary shard per GPU (NCCL)");
  }
  if (fault->kind == TestFault::kSkipCollective && shards < 2) {
    return absl::InvalidArgumentError("test fault skip-collective needs two or more shards");
  }
  std::vector<std::unique_ptr<Rank>> ranks;
  std::vector<int> rank_devices;
  std::vector<cudaStream_t> streams;
  for (int r = 0; r < shards; ++r) {
    auto rank = std::make_unique<Rank>();
    rank->index = r;
    rank->device = devices[static_cast<size_t>(r) % devices.size()];
    DeviceGuard guard(rank->device);
    if (auto s = guard.status(); !s.ok()) return s;
    int least_priority = 0, greatest_priority = 0;
    LOGITSERVE_RETURN_IF_CUDA_ERROR(
        cudaDeviceGetStreamPriorityRange(&least_priority, &greatest_priority));
    // The statistics stream first: its short kernels take SMs as GEMM blocks retire.
    if (auto s = rank->stream.Create(rank->device, greatest_priority); !s.ok()) return s;
    if (auto s = rank->gemm_stream.Create(rank->device); !s.ok()) return s;
    for (auto* events : {&rank->slot_filled, &rank->slot_free}) {
      for (CudaEvent& e : *events) {
        if (auto s = e.Create(rank->device); !s.ok()) return s;
      }
    }
    if (auto s = rank->slots_released.Create(rank->device); !s.ok()) return s;
    if (auto s = rank->gemm_idle.Create(rank->device); !s.ok()) return s;
    if (auto s = rank->lt.Create(); !s.ok()) return s;
    if (auto s = rank->cublas_workspace.Reserve(rank->device, kCublasWorkspaceBytes); !s.ok()) {
      return s;
    }
    for (CudaEvent& e : rank->tile_done) {
      if (auto s = e.Create(rank->device); !s.ok()) return s;
    }
    if (auto s = rank->idle.Create(rank->device); !s.ok()) return s;
    rank_devices.push_back(rank->device);
    streams.push_back(rank->stream.get());
    ranks.push_back(std::move(rank));
  }
  if (shards > 1) {
    const bool distinct = shards <= static_cast<int>(devices.size());
    absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> comms =
        distinct ? CreateNcclCommunicators(rank_devices, streams, options.collective_timeout)
                 : CreateDeviceCopyCommunicators(rank_devices, streams);
    if (!comms.ok()) return comms.status();
    for (int r = 0; r < shards; ++r) {
      Rank& rank = *ranks[static_cast<size_t>(r)];
      rank.comm = std::move((*comms)[static_cast<size_t>(r)]);
      rank.nccl = distinct ? static_cast<NcclCommunicator*>(rank.comm.get()) : nullptr;
    }
  }
  return std::unique_ptr<Backend>(new CudaBackend(options, std::move(ranks), *fault));
}

}  // namespace logitserve
