#include "tests/kernels/job_builder.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "logitserve/kernels/dtype.h"

namespace logitserve::testing {

float RoundTo(FloatType type, float f) {
  switch (type) {
    case FloatType::kFloat32:
      return f;
    case FloatType::kBFloat16:
      return kernels::BFloat16ToFloat(kernels::FloatToBFloat16(f));
    case FloatType::kFloat16:
    default:
      return kernels::Float16ToFloat(kernels::FloatToFloat16(f));
  }
}

MatrixView HostMatrix::view() const {
  static const uint8_t kNoBytes[8] = {};
  return MatrixView{type, rows, cols, bytes.empty() ? kNoBytes : bytes.data()};
}

float HostMatrix::at(int64_t r, int64_t c) const {
  return kernels::LoadAsFloat(
      type, bytes.data() + static_cast<size_t>(r * cols * kernels::SizeOf(type)), c);
}

HostMatrix Encode(FloatType type, int64_t rows, int64_t cols, const std::vector<float>& values) {
  HostMatrix m;
  m.type = type;
  m.rows = rows;
  m.cols = cols;
  const size_t n = static_cast<size_t>(rows * cols);
  m.bytes.resize(n * static_cast<size_t>(kernels::SizeOf(type)));
  for (size_t i = 0; i < n; ++i) {
    switch (type) {
      case FloatType::kFloat32:
        std::memcpy(m.bytes.data() + 4 * i, &values[i], 4);
        break;
      case FloatType::kBFloat16: {
        const uint16_t b = kernels::FloatToBFloat16(values[i]);
        std::memcpy(m.bytes.data() + 2 * i, &b, 2);
        break;
      }
      case FloatType::kFloat16: {
        const uint16_t h = kernels::FloatToFloat16(values[i]);
        std::memcpy(m.bytes.data() + 2 * i, &h, 2);
        break;
      }
    }
  }
  return m;
}

std::vector<float> RandomNormal(std::mt19937_64& rng, int64_t count, double stddev) {
  std::normal_distribution<double> dist(0.0, stddev);
  std::vector<float> out(static_cast<size_t>(count));
  for (float& x : out) x = static_cast<float>(dist(rng));
  return out;
}

void MaskRandomTokens(std::mt19937_64& rng, std::vector<float>& values, int64_t cols, int64_t row,
                      double fraction) {
  std::bernoulli_distribution masked(fraction);
  std::uniform_int_distribution<int64_t> pick(0, cols - 1);
  float* r = values.data() + row * cols;
  const int64_t keep = pick(rng);
  for (int64_t j = 0; j < cols; ++j) {
    if (j != keep && masked(rng)) r[j] = -std::numeric_limits<float>::infinity();
  }
}

std::vector<int32_t> RandomTargets(std::mt19937_64& rng, int64_t rows, int32_t per_row,
                                   int64_t vocab, int32_t ignore_index, double ignore_fraction) {
  std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(vocab - 1));
  std::bernoulli_distribution ignored(ignore_fraction);
  std::vector<int32_t> out(static_cast<size_t>(rows * per_row));
  for (int32_t& t : out) t = ignored(rng) ? ignore_index : id(rng);
  return out;
}

SharedMatrix Share(HostMatrix m) { return std::make_shared<const HostMatrix>(std::move(m)); }

DistributionInput OwnedJob::Input(std::shared_ptr<const PreparedHead> head, SharedMatrix m,
                                  float temperature, std::string field) {
  DistributionInput in;
  if (head != nullptr) {
    in.head = std::move(head);
    in.hidden = m->view();
  } else {
    in.logits = m->view();
  }
  in.temperature = temperature;
  in.field = std::move(field);
  buffers.push_back(std::move(m));
  return in;
}

LogitsPair MakeLogitsPair(std::mt19937_64& rng, FloatType t, int64_t n, int64_t v, double stddev) {
  std::vector<float> m = RandomNormal(rng, n * v, stddev);
  std::vector<float> r = RandomNormal(rng, n * v, stddev);
  const std::vector<float> noise = RandomNormal(rng, n * v, 1.0);
  for (int64_t row = 0; row < n; ++row) {
    if (row % 2 == 0) {
      for (int64_t j = 0; j < v; ++j) r[row * v + j] = m[row * v + j] + noise[row * v + j];
    }
    switch (row % 8) {
      case 5:
        MaskRandomTokens(rng, m, v, row, 0.1);
        for (int64_t j = 0; j < v; ++j) {
          if (std::isinf(m[row * v + j])) r[row * v + j] = m[row * v + j];
        }
        break;
      case 6:
        MaskRandomTokens(rng, m, v, row, 0.1);
        break;
      case 7:
        MaskRandomTokens(rng, r, v, row, 0.1);
        break;
      default:
        break;
    }
  }
  return {Share(Encode(t, n, v, m)), Share(Encode(t, n, v, r))};
}

OwnedJob& OwnedJob::SetModelLogits(SharedMatrix logits, float temperature, std::string field) {
  job.rows = logits->rows;
  job.vocab = logits->cols;
  job.model = Input(nullptr, std::move(logits), temperature, std::move(field));
  return *this;
}

OwnedJob& OwnedJob::SetReferenceLogits(SharedMatrix logits, float temperature, std::string field) {
  job.reference = Input(nullptr, std::move(logits), temperature, std::move(field));
  return *this;
}

OwnedJob& OwnedJob::SetModelHidden(std::shared_ptr<const PreparedHead> head, SharedMatrix hidden,
                                   float temperature, std::string field) {
  job.rows = hidden->rows;
  job.vocab = head->weights().vocab_size;
  job.model = Input(std::move(head), std::move(hidden), temperature, std::move(field));
  return *this;
}

OwnedJob& OwnedJob::SetReferenceHidden(std::shared_ptr<const PreparedHead> head,
                                       SharedMatrix hidden, float temperature, std::string field) {
  job.reference = Input(std::move(head), std::move(hidden), temperature, std::move(field));
  return *this;
}

OwnedJob& OwnedJob::WithTargets(std::vector<int32_t> ids, int32_t per_row, int32_t ignore_index) {
  job.target_ids = std::move(ids);
  job.ids_per_row = per_row;
  job.ignore_index = ignore_index;
  return *this;
}

OwnedJob& OwnedJob::WithTopK(int32_t k) {
  job.top_k = k;
  return *this;
}

OwnedJob& OwnedJob::WithEntropy() {
  job.entropy = true;
  return *this;
}

OwnedJob& OwnedJob::WithReferenceEntropy() {
  job.reference_entropy = true;
  return *this;
}

OwnedJob& OwnedJob::WithForwardKl() {
  job.forward_kl = true;
  return *this;
}

OwnedJob& OwnedJob::WithReverseKl() {
  job.reverse_kl = true;
  return *this;
}

OwnedJob& OwnedJob::WithJsd(float beta) {
  job.jsd_beta = beta;
  return *this;
}

OwnedJob& OwnedJob::WithEverything(std::vector<int32_t> ids, int32_t per_row, int32_t top_k,
                                   float beta) {
  WithTargets(std::move(ids), per_row);
  return WithTopK(top_k)
      .WithEntropy()
      .WithReferenceEntropy()
      .WithForwardKl()
      .WithReverseKl()
      .WithJsd(beta);
}

std::shared_ptr<HeadWeights> RandomHead(std::mt19937_64& rng, int64_t vocab, int64_t hidden,
                                        FloatType dtype, double weight_std, bool with_bias,
                                        const HeadTransform& transform) {
  auto head = std::make_shared<HeadWeights>();
  head->name = "test_head";
  head->vocab_size = vocab;
  head->hidden_size = hidden;
  head->dtype = dtype;
  head->weight = Encode(dtype, vocab, hidden, RandomNormal(rng, vocab * hidden, weight_std)).bytes;
  if (with_bias) head->bias = RandomNormal(rng, vocab, 1.0);
  head->transform = transform;
  head->source = "synthetic:test";
  return head;
}

absl::StatusOr<ScoreResult> RunJob(Backend& backend, const ScoreJob& job) {
  ScoreResult result;
  absl::Status status = backend.Score(job, &result);
  if (!status.ok()) return status;
  return result;
}

}  // namespace logitserve::testing
