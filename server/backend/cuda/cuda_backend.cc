// CudaBackend (see cuda_backend.h for the algorithm and its promises). This file holds the
// orchestration: heads resident per device, one worker per rank per job, device workspaces, the
// collectives. The math is in kernels/cuda (launchers in cuda_kernels.h) and block_stats.h.
#include "server/backend/cuda/cuda_backend.h"

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <limits>
#include <map>
#include <string>
#include <thread>
#include <utility>

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

int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
int64_t CeilDiv(int64_t x, int64_t m) { return (x + m - 1) / m; }

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
  CudaStream stream;
  LtHandle lt;
  DeviceBuffer cublas_workspace;
  DeviceBuffer workspace;              // per-job scratch, grown on demand
  std::unique_ptr<Communicator> comm;  // null when the backend has one rank
  NcclCommunicator* nccl = nullptr;    // comm, when it is NCCL
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
  int64_t tile_rows = 0;   // rows per tile (the last tile may hold fewer)
  int64_t chunk_cols = 0;  // vocabulary columns per statistics launch
  kc::TileMessage msg;
  std::vector<bool> model_zero_copy;  // per rank: the model logits already live on its device
  std::vector<bool> ref_zero_copy;
};

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

k::PairBlockStats* StatsOf(uint8_t* msg, const kc::TileMessage& m) {
  return reinterpret_cast<k::PairBlockStats*>(msg + m.stats_offset);
}

// ---- One rank's part of one job --------------------------------------------------------------

class RankWorker {
 public:
  RankWorker(Rank& rank, const JobPlan& plan, int num_ranks, JobFailure& failure,
             int64_t test_fail_step)
      : rank_(rank),
        plan_(plan),
        job_(*plan.job),
        num_ranks_(num_ranks),
        shard_(plan.layout[static_cast<size_t>(rank.index)]),
        shard_width_(shard_.end - shard_.begin),
        num_chunks_(shard_width_ > 0 ? CeilDiv(shard_width_, plan.chunk_cols) : 0),
        reports_(rank.index == 0),
        failure_(failure),
        test_fail_step_(test_fail_step) {}

  // Allocates the job's workspace and uploads the target ids. No collectives.
  absl::Status Prepare();
  // Every tile. Before each collective the ranks agree (JobFailure) whether any of them failed;
  // if so, all return there (the failing rank its own status, the others PeerFailed).
  absl::Status Run();
  // Rank 0: copies the outputs into `result` and the bad-row markers into first_bad. Every rank
  // waits for its stream and checks NCCL.
  absl::Status Finish(ScoreResult* result, int32_t* first_bad);

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
    uint8_t* raw = nullptr;       // [tile_rows][H] of the input dtype
    uint16_t* x_parts = nullptr;  // hidden_parts x [kCudaRowTile][k_pad]
    float* slots = nullptr;       // n_slots x [kCudaRowTile][kCudaVocabChunk]
    int64_t n_slots = 0;
    kc::LoadTransform transform;
  };

  void SetUpDist(Dist& d, const DistributionInput& in, bool zero_copy, Carver& carver,
                 std::vector<std::pair<Dist*, std::array<size_t, 4>>>& offsets);
  absl::Status BeginTile(Dist& d, int64_t row0, int64_t rows);
  // The source for chunk c; hidden mode runs its GEMMs first when `compute`.
  absl::StatusOr<kc::LogitsSource> Source(Dist& d, int64_t c, int64_t row0, bool compute);
  absl::Status ComputeTile(int64_t row0, int64_t rows);
  absl::Status FoldTile(int64_t row0, int64_t rows);
  absl::Status JsdTile(int64_t row0, int64_t rows);
  absl::Status JsdGatherAndFinish(int64_t row0, int64_t rows);
  cudaStream_t stream() const { return rank_.stream.get(); }

  Rank& rank_;
  const JobPlan& plan_;
  const ScoreJob& job_;
  const int num_ranks_;
  const ShardRange shard_;
  const int64_t shard_width_;
  const int64_t num_chunks_;
  const bool reports_;  // rank 0 writes the outputs
  JobFailure& failure_;
  const int64_t test_fail_step_;  // CudaBackendOptions::test_fail_step when this rank fails

  Dist model_, ref_;
  uint8_t* send_ = nullptr;
  uint8_t* recv_ = nullptr;
  float* partial_send_ = nullptr;
  float* partial_recv_ = nullptr;
  k::RowStats* folded_a_ = nullptr;
  k::RowStats* folded_b_ = nullptr;
  int32_t* first_bad_ = nullptr;
  int32_t* ids_ = nullptr;
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
      d.n_slots = plan_.jsd_pass ? num_chunks_ : 1;
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
  uint8_t* base = rank_.workspace.as<uint8_t>();
  send_ = base + send_at;
  recv_ = num_ranks_ > 1 ? base + recv_at : send_;
  partial_send_ = reinterpret_cast<float*>(base + psend_at);
  partial_recv_ = num_ranks_ > 1 ? reinterpret_cast<float*>(base + precv_at) : partial_send_;
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
  LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(first_bad_, 0x7f, 2 * sizeof(int32_t), stream()));
  if (ids_count > 0) {
    LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(
        ids_, job_.target_ids.data(), ids_count * sizeof(int32_t), cudaMemcpyDefault, stream()));
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
  LOGITSERVE_RETURN_IF_CUDA_ERROR(
      cudaMemcpyAsync(d.raw, static_cast<const uint8_t*>(h.data) + row0 * h.cols * es,
                      static_cast<size_t>(rows * h.cols * es), cudaMemcpyDefault, stream()));
  // Rows past `rows` become zeros: the GEMM always multiplies kCudaRowTile rows.
  LOGITSERVE_RETURN_IF_CUDA_ERROR(kc::LaunchSplitToBf16(
      h.type, d.raw, h.cols, rows, h.cols, d.hidden_parts, d.x_parts, kCudaRowTile, d.head->k_pad,
      static_cast<size_t>(kCudaRowTile * d.head->k_pad), stream()));
  return absl::OkStatus();
}

absl::StatusOr<kc::LogitsSource> RankWorker::Source(Dist& d, int64_t c, int64_t row0,
                                                    bool compute) {
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
  float* slot = d.slots + (d.n_slots > 1 ? c : 0) * kCudaRowTile * kCudaVocabChunk;
  const CudaHead& head = *d.head;
  const CudaHead::Shard& hs = head.shards[static_cast<size_t>(rank_.index)];
  if (compute) {
    const size_t x_stride = static_cast<size_t>(kCudaRowTile * head.k_pad);
    for (int j = 0; j < d.hidden_parts; ++j) {
      for (int i = 0; i < head.parts; ++i) {
        const uint16_t* w = head.Part(rank_.index, i) + cc0 * head.k_pad;
        if (auto s =
                hs.gemm->Run(rank_.lt.get(), w, d.x_parts + j * x_stride, slot,
                             /*accumulate=*/(i | j) != 0, rank_.cublas_workspace.data(), stream());
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
  LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(send_, 0, m.bytes, stream()));
  if (auto s = BeginTile(model_, row0, rows); !s.ok()) return s;
  if (plan_.pair) {
    if (auto s = BeginTile(ref_, row0, rows); !s.ok()) return s;
  }
  k::PairBlockStats* stats = StatsOf(send_, m);
  auto* lists = reinterpret_cast<k::TopKEntry*>(send_ + m.topk_offset);
  auto* counts = reinterpret_cast<int32_t*>(send_ + m.count_offset);
  auto* targets = reinterpret_cast<float*>(send_ + m.target_offset);
  for (int64_t c = 0; c < num_chunks_; ++c) {
    absl::StatusOr<kc::LogitsSource> a = Source(model_, c, row0, /*compute=*/true);
    if (!a.ok()) return a.status();
    absl::StatusOr<kc::LogitsSource> b;
    if (plan_.pair) {
      b = Source(ref_, c, row0, /*compute=*/true);
      if (!b.ok()) return b.status();
    }
    const int64_t local_block = c * plan_.chunk_cols / k::kVocabBlock;
    LOGITSERVE_RETURN_IF_CUDA_ERROR(kc::LaunchBlockStats(
        *a, plan_.pair ? &*b : nullptr, rows, stats, m.max_blocks, local_block, stream()));
    if (job_.ids_per_row > 0) {
      LOGITSERVE_RETURN_IF_CUDA_ERROR(kc::LaunchGatherTargets(
          *a, rows, ids_ + row0 * job_.ids_per_row, job_.ids_per_row, targets, stream()));
    }
    if (job_.top_k > 0) {
      LOGITSERVE_RETURN_IF_CUDA_ERROR(
          kc::LaunchTopKUpdate(*a, rows, job_.top_k, lists, counts, stream()));
    }
  }
  return absl::OkStatus();
}

absl::Status RankWorker::FoldTile(int64_t row0, int64_t rows) {
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
    absl::StatusOr<kc::LogitsSource> s = Source(model_, c, row0, /*compute=*/false);
    if (!s.ok()) return s.status();
    absl::StatusOr<kc::LogitsSource> t = Source(ref_, c, row0, /*compute=*/false);
    if (!t.ok()) return t.status();
    const int64_t local_block = c * plan_.chunk_cols / k::kVocabBlock;
    LOGITSERVE_RETURN_IF_CUDA_ERROR(kc::LaunchJsdPartials(*s, *t, rows, folded_a_, folded_b_,
                                                          *job_.jsd_beta, partial_send_,
                                                          plan_.max_blocks, local_block, stream()));
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

absl::Status RankWorker::Run() {
  DeviceGuard guard(rank_.device);
  if (auto s = guard.status(); !s.ok()) return s;
  int64_t step = 0;
  absl::Status local = absl::OkStatus();  // the first failure since the previous checkpoint
  auto note = [&local](absl::Status s) {
    if (local.ok() && !s.ok()) local = std::move(s);
  };
  // A checkpoint: true when the job stops here; `local` then holds this rank's status.
  auto stop = [&]() {
    if (step == test_fail_step_) note(absl::InternalError("injected failure (test_fail_step)"));
    const bool stop_here = failure_.Failed(step++, rank_.index, !local.ok());
    if (stop_here && local.ok()) local = PeerFailed(failure_.rank());
    return stop_here;
  };
  for (int64_t row0 = 0; row0 < job_.rows; row0 += plan_.tile_rows) {
    const int64_t rows = std::min(plan_.tile_rows, job_.rows - row0);
    note(ComputeTile(row0, rows));
    if (stop()) return local;
    if (num_ranks_ > 1) note(rank_.comm->AllGather(send_, recv_, plan_.msg.bytes));
    if (local.ok()) note(FoldTile(row0, rows));
    if (!plan_.jsd_pass) continue;
    if (local.ok()) note(JsdTile(row0, rows));
    if (stop()) return local;
    if (num_ranks_ > 1) {
      const size_t bytes = static_cast<size_t>(plan_.tile_rows * plan_.max_blocks) * sizeof(float);
      note(rank_.comm->AllGather(partial_send_, partial_recv_, bytes));
    }
    if (local.ok()) note(JsdGatherAndFinish(row0, rows));
  }
  // No collective follows: a failure after the last checkpoint only needs reporting.
  if (!local.ok()) failure_.Note(rank_.index);
  return local;
}

absl::Status RankWorker::Finish(ScoreResult* result, int32_t* first_bad) {
  DeviceGuard guard(rank_.device);
  if (auto s = guard.status(); !s.ok()) return s;
  if (reports_) {
    auto copy = [&](auto& vec, const void* dev) -> absl::Status {
      if (vec.empty() || dev == nullptr) return absl::OkStatus();
      LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(vec.data(), dev, vec.size() * sizeof(vec[0]),
                                                      cudaMemcpyDeviceToHost, stream()));
      return absl::OkStatus();
    };
    for (absl::Status s :
         {copy(result->target_logprobs, outputs_.target_logprobs),
          copy(result->top_k_ids, outputs_.top_k_ids),
          copy(result->top_k_logprobs, outputs_.top_k_logprobs),
          copy(result->entropy, outputs_.entropy),
          copy(result->reference_entropy, outputs_.reference_entropy),
          copy(result->forward_kl, outputs_.forward_kl),
          copy(result->reverse_kl, outputs_.reverse_kl), copy(result->jsd, outputs_.jsd)}) {
      if (!s.ok()) return s;
    }
    LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(first_bad, first_bad_, 2 * sizeof(int32_t),
                                                    cudaMemcpyDeviceToHost, stream()));
  }
  LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream()));
  if (rank_.nccl != nullptr) return rank_.nccl->AsyncError();
  return absl::OkStatus();
}

// ---- The backend -----------------------------------------------------------------------------

class CudaBackend final : public Backend {
 public:
  CudaBackend(const CudaBackendOptions& options, std::vector<std::unique_ptr<Rank>> ranks)
      : options_(options), ranks_(std::move(ranks)) {}

  std::string name() const override { return "cuda"; }

  std::vector<ShardRange> ShardLayout(int64_t vocab) const override {
    return MakeShardLayout(vocab, static_cast<int>(ranks_.size()), options_.shard_weights);
  }

  absl::StatusOr<std::shared_ptr<const PreparedHead>> PrepareHead(
      std::shared_ptr<const HeadWeights> weights) override;

  absl::Status Score(const ScoreJob& job, ScoreResult* result) override;

 private:
  absl::StatusOr<std::shared_ptr<const CudaTileGemm>> GemmFor(int device, int64_t k_pad);
  absl::StatusOr<JobPlan> Plan(const ScoreJob& job) const;
  absl::Status CheckHead(const DistributionInput& in) const;

  const CudaBackendOptions options_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  absl::Mutex score_mu_;  // one job at a time uses the ranks
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
  if (absl::Status s = StartResult(job, result); !s.ok()) return s;
  if (job.rows == 0) return absl::OkStatus();
  if (auto s = CheckHead(job.model); !s.ok()) return s;
  if (job.NeedsReference()) {
    if (auto s = CheckHead(job.reference); !s.ok()) return s;
  }
  absl::StatusOr<JobPlan> plan = Plan(job);
  if (!plan.ok()) return plan.status();

  absl::MutexLock lock(&score_mu_);
  const int ranks = static_cast<int>(ranks_.size());
  std::vector<absl::Status> status(static_cast<size_t>(ranks));
  int32_t first_bad[2] = {kNoBadRow, kNoBadRow};
  JobFailure failure(ranks);
  auto run_rank = [&](int r) {
    RankWorker worker(*ranks_[static_cast<size_t>(r)], *plan, ranks, failure,
                      r == options_.test_fail_rank ? options_.test_fail_step : -1);
    // Prepare only allocates and uploads; the ranks agree on it before the first collective.
    absl::Status s = worker.Prepare();
    if (failure.Failed(-1, r, !s.ok())) {
      status[static_cast<size_t>(r)] = s.ok() ? PeerFailed(failure.rank()) : s;
      return;
    }
    s = worker.Run();
    absl::Status f = worker.Finish(result, first_bad);
    if (s.ok() && !f.ok()) failure.Note(r);
    status[static_cast<size_t>(r)] = s.ok() ? f : s;
  };
  std::vector<std::thread> others;
  for (int r = 1; r < ranks; ++r) others.emplace_back(run_rank, r);
  run_rank(0);
  for (auto& t : others) t.join();
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
  std::vector<std::unique_ptr<Rank>> ranks;
  std::vector<int> rank_devices;
  std::vector<cudaStream_t> streams;
  for (int r = 0; r < shards; ++r) {
    auto rank = std::make_unique<Rank>();
    rank->index = r;
    rank->device = devices[static_cast<size_t>(r) % devices.size()];
    DeviceGuard guard(rank->device);
    if (auto s = guard.status(); !s.ok()) return s;
    if (auto s = rank->stream.Create(rank->device); !s.ok()) return s;
    if (auto s = rank->lt.Create(); !s.ok()) return s;
    if (auto s = rank->cublas_workspace.Reserve(rank->device, kCublasWorkspaceBytes); !s.ok()) {
      return s;
    }
    rank_devices.push_back(rank->device);
    streams.push_back(rank->stream.get());
    ranks.push_back(std::move(rank));
  }
  if (shards > 1) {
    const bool distinct = shards <= static_cast<int>(devices.size());
    absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> comms =
        distinct ? CreateNcclCommunicators(rank_devices, streams)
                 : CreateDeviceCopyCommunicators(rank_devices, streams);
    if (!comms.ok()) return comms.status();
    for (int r = 0; r < shards; ++r) {
      Rank& rank = *ranks[static_cast<size_t>(r)];
      rank.comm = std::move((*comms)[static_cast<size_t>(r)]);
      rank.nccl = distinct ? static_cast<NcclCommunicator*>(rank.comm.get()) : nullptr;
    }
  }
  return std::unique_ptr<Backend>(new CudaBackend(options, std::move(ranks)));
}

}  // namespace logitserve
