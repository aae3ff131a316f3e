// Test support for the backend suites: matrices in the backend's float types, random inputs,
// ScoreJobs that own the memory their views point into, heads, and backend factories.
//
// Thread safety: plain values; use each object from one thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "logitserve/kernels/dtype.h"
#include "server/backend/backend.h"
#include "server/heads/head_weights.h"

namespace logitserve::testing {

using kernels::FloatType;

// fp32 -> `type` -> fp32: the value a backend reads when `f` is sent as `type` (round to nearest
// even: kernels::FloatToBFloat16, kernels::FloatToFloat16).
float RoundTo(FloatType type, float f);

// "fp32", "bf16", "fp16" (kernels::FloatTypeName, as a std::string for test names).
inline std::string DTypeName(FloatType type) { return std::string(kernels::FloatTypeName(type)); }

// A row-major [rows, cols] matrix owned by the test, encoded in one of the float types.
struct HostMatrix {
  FloatType type = FloatType::kFloat32;
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<uint8_t> bytes;

  // A view for a ScoreJob. data is non-null even for 0 rows, so the view is never "empty".
  MatrixView view() const;
  // Element (r, c) decoded exactly to fp32.
  float at(int64_t r, int64_t c) const;
};

// Encodes fp32 values (row-major, rows * cols of them) as `type`, rounding to nearest even.
HostMatrix Encode(FloatType type, int64_t rows, int64_t cols, const std::vector<float>& values);

// Random logits, normal(0, stddev) per element: realistic LM-head output scale for stddev ~3.
std::vector<float> RandomNormal(std::mt19937_64& rng, int64_t count, double stddev);

// Sets row `row` of a [rows, cols] fp32 matrix to -inf at a random `fraction` of its tokens, but
// always leaves at least one token unmasked.
void MaskRandomTokens(std::mt19937_64& rng, std::vector<float>& values, int64_t cols, int64_t row,
                      double fraction);

// Target ids [rows * per_row]: uniform in [0, vocab), with about `ignore_fraction` of them set to
// `ignore_index`.
std::vector<int32_t> RandomTargets(std::mt19937_64& rng, int64_t rows, int32_t per_row,
                                   int64_t vocab, int32_t ignore_index, double ignore_fraction);

// Shares a matrix between jobs (a ScoreJob's views point into it; it must outlive them).
using SharedMatrix = std::shared_ptr<const HostMatrix>;
SharedMatrix Share(HostMatrix m);

// Model and reference logits for n rows, normal(0, stddev). Even rows: the reference is the model
// plus normal(0, 1) noise (a reference close to the policy); odd rows: independent. Masks by
// row % 8: 5 = the same tokens masked in both, 6 = the model masks tokens the reference keeps
// (forward KL = +inf), 7 = the reference masks tokens the model keeps (reverse KL = +inf).
struct LogitsPair {
  SharedMatrix model;
  SharedMatrix reference;
};
LogitsPair MakeLogitsPair(std::mt19937_64& rng, FloatType t, int64_t n, int64_t v, double stddev);

// A ScoreJob plus the buffers its views point into. The buffers are shared and never move, so an
// OwnedJob may be copied or moved freely; every copy's views stay valid.
struct OwnedJob {
  ScoreJob job;
  std::vector<SharedMatrix> buffers;

  // Logits mode. Sets job.rows / job.vocab from the matrix.
  OwnedJob& SetModelLogits(SharedMatrix logits, float temperature = 1.0f,
                           std::string field = "logits");
  OwnedJob& SetReferenceLogits(SharedMatrix logits, float temperature = 1.0f,
                               std::string field = "reference_logits");
  // Hidden mode. Sets job.rows from the matrix and job.vocab from the head.
  OwnedJob& SetModelHidden(std::shared_ptr<const PreparedHead> head, SharedMatrix hidden,
                           float temperature = 1.0f, std::string field = "hidden");
  OwnedJob& SetReferenceHidden(std::shared_ptr<const PreparedHead> head, SharedMatrix hidden,
                               float temperature = 1.0f, std::string field = "reference_hidden");

  // Output requests (targets: ids_per_row = per_row, ids as given).
  OwnedJob& WithTargets(std::vector<int32_t> ids, int32_t per_row, int32_t ignore_index = -100);
  OwnedJob& WithTopK(int32_t k);
  OwnedJob& WithEntropy();
  OwnedJob& WithReferenceEntropy();
  OwnedJob& WithForwardKl();
  OwnedJob& WithReverseKl();
  OwnedJob& WithJsd(float beta);
  // Every output at once: targets, top-k, both entropies, both KLs and JSD_beta.
  OwnedJob& WithEverything(std::vector<int32_t> ids, int32_t per_row, int32_t top_k, float beta);

 private:
  DistributionInput Input(std::shared_ptr<const PreparedHead> head, SharedMatrix m,
                          float temperature, std::string field);
};

// A head with random weights normal(0, weight_std) of `dtype` (bf16 / fp16 rounded), optional
// bias normal(0, 1), and the given transform.
std::shared_ptr<HeadWeights> RandomHead(std::mt19937_64& rng, int64_t vocab, int64_t hidden,
                                        FloatType dtype, double weight_std, bool with_bias,
                                        const HeadTransform& transform);

// A way to build a backend, named for test names (letters, digits and '_' only), so that one
// parametrized suite runs against every backend and configuration.
struct BackendFactory {
  std::string name;
  std::function<absl::StatusOr<std::unique_ptr<Backend>>()> create;
};

// gtest prints a parameter by its name.
inline void PrintTo(const BackendFactory& f, std::ostream* os) { *os << f.name; }

// The backend under test, chosen at link time: a suite's program links exactly one definition,
// tests/kernels/cpu_factories.cc (CpuBackend, `threads` host threads) or tests/gpu/
// cuda_factories.cc (CudaBackend: one GPU per shard when that many are visible, else all shards
// on GPU 0; `threads` ignored). `name` names the layout without the backend ("2shards"); the
// factory is named "<backend>_<name>" ("cpu_2shards", "cuda_2shards").
BackendFactory TestBackend(std::string name, int shards, std::vector<int64_t> shard_weights = {},
                           int threads = 2);

// The shard layouts every suite sweeps on the backend under test: one shard, two even, three
// even, uneven {1, 3}, and {1, 0, 2} whose middle shard is empty (CUDA adds the trailing empty
// shards {1, 0} and {2, 1, 0}).
std::vector<BackendFactory> TestBackends();

// Runs a job; the status is returned, the result filled on success.
absl::StatusOr<ScoreResult> RunJob(Backend& backend, const ScoreJob& job);

// In a test body: scores `job` (a ScoreJob) on `backend` (a Backend&) and binds the result to a
// const ScoreResult& `name`; fails the test and returns from it when Score fails.
#define LOGITSERVE_ASSERT_SCORE(name, backend, job)                                          \
  const absl::StatusOr<ScoreResult> name##_or = ::logitserve::testing::RunJob(backend, job); \
  ASSERT_TRUE(name##_or.ok()) << name##_or.status();                                         \
  const ScoreResult& name = *name##_or

}  // namespace logitserve::testing
