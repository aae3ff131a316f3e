// Backend: the compute engine behind the service (CpuBackend always; CudaBackend with CUDA).
//
// The service validates a request completely (shapes, dtypes, ids, options) and hands the backend
// a ScoreJob whose views point into the request's bytes. The backend only reports what it alone
// can see: NaN / +inf logits (input logits or logits computed from hidden states).
//
// Thread safety: PrepareHead and Score may be called concurrently from any thread. A
// PreparedHead is immutable and may be shared by concurrent jobs.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "logitserve/kernels/dtype.h"
#include "logitserve/kernels/logit_transform.h"
#include "server/heads/head_weights.h"
#include "server/heads/prepared_head.h"

namespace logitserve {

// A row-major [rows, cols] matrix of floats in request memory (not owned).
struct MatrixView {
  kernels::FloatType type = kernels::FloatType::kFloat32;
  int64_t rows = 0;
  int64_t cols = 0;
  const void* data = nullptr;
  bool empty() const { return data == nullptr; }
};

// One distribution's input: hidden states times a head (hidden mode), or raw logits.
struct DistributionInput {
  std::shared_ptr<const PreparedHead> head;  // set in hidden mode
  MatrixView hidden;                         // [N, H] in hidden mode
  MatrixView logits;                         // [N, V] in logits mode
  float temperature = 1.0f;
  // Request field names, for error messages ("logits", "reference_hidden", ...).
  std::string field;
  bool present() const { return head != nullptr || !logits.empty(); }
  bool hidden_mode() const { return head != nullptr; }
};

struct ScoreJob {
  int64_t rows = 0;   // N
  int64_t vocab = 0;  // V (model and reference agree)
  DistributionInput model;
  DistributionInput reference;  // present iff a reference output is requested
  // Target ids, int32 [rows * ids_per_row]; each is ignore_index or in [0, vocab).
  std::vector<int32_t> target_ids;
  int32_t ids_per_row = 0;
  int32_t ignore_index = -100;
  int32_t top_k = 0;  // <= vocab
  bool entropy = false;
  bool reference_entropy = false;
  bool forward_kl = false;  // KL(reference || model)
  bool reverse_kl = false;  // KL(model || reference)
  std::optional<float> jsd_beta;
  // Optional: called before every row tile on every rank (concurrently: it must be thread-safe)
  // with the tile's row count; a non-OK status (CANCELLED, DEADLINE_EXCEEDED) stops the job on
  // every rank at that tile and Score returns it. The scheduler uses it so that cancelled or
  // expired work stops launching tiles; tile sizes differ by backend (CPU 64 rows; CUDA 512 in
  // hidden mode, up to 8192 in logits mode).
  std::function<absl::Status(int64_t tile_rows)> stop;
  absl::Status CheckStop(int64_t tile_rows) const {
    return stop ? stop(tile_rows) : absl::OkStatus();
  }
  bool NeedsReference() const {
    return reference_entropy || forward_kl || reverse_kl || jsd_beta.has_value();
  }
};

// Outputs, fp32, nats; a vector is empty when its output was not requested.
struct ScoreResult {
  std::vector<float> target_logprobs;  // [rows * ids_per_row]
  std::vector<int32_t> top_k_ids;      // [rows * top_k]
  std::vector<float> top_k_logprobs;   // [rows * top_k]
  std::vector<float> entropy;          // [rows]
  std::vector<float> reference_entropy;
  std::vector<float> forward_kl;
  std::vector<float> reverse_kl;
  std::vector<float> jsd;
};

// A shard's vocabulary range [begin, end).
struct ShardRange {
  int32_t shard = 0;
  int64_t begin = 0;
  int64_t end = 0;
};

// Sizes every requested output of `result` for `job` (the others empty; a reused result's values
// are left as they were, for the backend to overwrite every one), and checks the limits
// every backend shares (top_k <= vocab and <= kernels::kMaxTopK). Backends call it first.
absl::Status StartResult(const ScoreJob& job, ScoreResult* result);

// A head's transform and a distribution's temperature as the kernels apply them (hidden mode);
// the bias is left for the backend to point at its copy. Granite's divisor wins over Cohere's
// multiplier when a config sets both (every backend makes this same choice).
inline kernels::LogitTransform HeadLogitTransform(const HeadTransform& ht, float temperature) {
  kernels::LogitTransform t;
  t.head = true;
  if (ht.logits_scaling != 1.0f) {
    t.scale = ht.logits_scaling;
    t.divide_by_scale = true;
  } else {
    t.scale = ht.logit_scale;
  }
  t.softcap = ht.softcap;
  t.temperature = temperature;
  return t;
}

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  // Vocabulary layout over this backend's shards for a head of `vocab` ids (block-aligned).
  virtual std::vector<ShardRange> ShardLayout(int64_t vocab) const = 0;
  // Converts / shards / uploads a head. Fails with a clear status (e.g. out of memory).
  virtual absl::StatusOr<std::shared_ptr<const PreparedHead>> PrepareHead(
      std::shared_ptr<const HeadWeights> weights) = 0;
  // Computes the job. INVALID_ARGUMENT names the field and first row with NaN / +inf logits.
  virtual absl::Status Score(const ScoreJob& job, ScoreResult* result) = 0;
  // OK while the backend can compute. After a fatal device error (a sticky CUDA error, an NCCL
  // error, a collective past the watchdog timeout) it returns that error for good: the service
  // then reports NOT_SERVING, fails in-flight work and the process exits non-zero.
  virtual absl::Status Health() const { return absl::OkStatus(); }
  // Device memory per device ("cuda:0", "cpu") for metrics and admission: bytes in use by this
  // backend and the device total (0 when unknown).
  struct MemoryInfo {
    std::string device;
    int64_t used_bytes = 0;
    int64_t total_bytes = 0;
  };
  virtual std::vector<MemoryInfo> MemoryUsage() const { return {}; }
};

}  // namespace logitserve
