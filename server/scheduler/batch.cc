#include "server/scheduler/batch.h"

#include <cstring>

namespace logitserve {

namespace {

bool SameBits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

bool SameShapeOfInput(const MatrixView& a, const MatrixView& b) {
  return a.empty() == b.empty() && a.type == b.type && a.cols == b.cols;
}

bool SameDistribution(const DistributionInput& a, const DistributionInput& b) {
  return a.head == b.head && SameShapeOfInput(a.hidden, b.hidden) &&
         SameShapeOfInput(a.logits, b.logits) && SameBits(a.temperature, b.temperature) &&
         a.field == b.field;
}

// Concatenates the rows of one input (hidden or logits, whichever `pick` selects) of every part.
MatrixView Concatenate(const std::vector<const ScoreJob*>& parts,
                       const MatrixView& (*pick)(const ScoreJob&), StagingBytes* out) {
  const MatrixView& first = pick(*parts.front());
  if (first.empty()) return first;
  const size_t row_bytes = static_cast<size_t>(first.cols) * kernels::SizeOf(first.type);
  int64_t rows = 0;
  for (const ScoreJob* p : parts) rows += pick(*p).rows;
  std::byte* data = out->Reserve(static_cast<size_t>(rows) * row_bytes);
  size_t offset = 0;
  for (const ScoreJob* p : parts) {
    const MatrixView& v = pick(*p);
    const size_t bytes = static_cast<size_t>(v.rows) * row_bytes;
    if (bytes > 0) std::memcpy(data + offset, v.data, bytes);
    offset += bytes;
  }
  MatrixView merged = first;
  merged.rows = rows;
  merged.data = data;
  return merged;
}

template <typename T>
std::vector<T> Rows(const std::vector<T>& v, int64_t width, int64_t row0, int64_t rows) {
  if (v.empty() || width == 0) return {};
  return std::vector<T>(v.begin() + row0 * width, v.begin() + (row0 + rows) * width);
}

}  // namespace

bool CanShareBatch(const ScoreJob& a, const ScoreJob& b) {
  const bool same_beta = a.jsd_beta.has_value() == b.jsd_beta.has_value() &&
                         (!a.jsd_beta.has_value() || SameBits(*a.jsd_beta, *b.jsd_beta));
  return a.vocab == b.vocab && SameDistribution(a.model, b.model) &&
         SameDistribution(a.reference, b.reference) && a.ids_per_row == b.ids_per_row &&
         a.ignore_index == b.ignore_index && a.top_k == b.top_k && a.entropy == b.entropy &&
         a.reference_entropy == b.reference_entropy && a.forward_kl == b.forward_kl &&
         a.reverse_kl == b.reverse_kl && same_beta;
}

ScoreJob MergeJobs(const std::vector<const ScoreJob*>& parts, MergedInputs* storage) {
  ScoreJob merged = *parts.front();
  merged.stop = nullptr;
  merged.rows = 0;
  merged.target_ids.clear();
  for (const ScoreJob* p : parts) {
    merged.rows += p->rows;
    merged.target_ids.insert(merged.target_ids.end(), p->target_ids.begin(), p->target_ids.end());
  }
  // A distribution has either hidden states or logits; the other view stays empty.
  const DistributionInput& m = parts.front()->model;
  const DistributionInput& r = parts.front()->reference;
  if (!m.hidden.empty()) {
    merged.model.hidden = Concatenate(
        parts, [](const ScoreJob& j) -> const MatrixView& { return j.model.hidden; },
        &storage->model);
  } else if (!m.logits.empty()) {
    merged.model.logits = Concatenate(
        parts, [](const ScoreJob& j) -> const MatrixView& { return j.model.logits; },
        &storage->model);
  }
  if (!r.hidden.empty()) {
    merged.reference.hidden = Concatenate(
        parts, [](const ScoreJob& j) -> const MatrixView& { return j.reference.hidden; },
        &storage->reference);
  } else if (!r.logits.empty()) {
    merged.reference.logits = Concatenate(
        parts, [](const ScoreJob& j) -> const MatrixView& { return j.reference.logits; },
        &storage->reference);
  }
  return merged;
}

ScoreResult SliceResult(const ScoreJob& merged, const ScoreResult& result, int64_t row0,
                        int64_t rows) {
  ScoreResult out;
  out.target_logprobs = Rows(result.target_logprobs, merged.ids_per_row, row0, rows);
  out.top_k_ids = Rows(result.top_k_ids, merged.top_k, row0, rows);
  out.top_k_logprobs = Rows(result.top_k_logprobs, merged.top_k, row0, rows);
  out.entropy = Rows(result.entropy, 1, row0, rows);
  out.reference_entropy = Rows(result.reference_entropy, 1, row0, rows);
  out.forward_kl = Rows(result.forward_kl, 1, row0, rows);
  out.reverse_kl = Rows(result.reverse_kl, 1, row0, rows);
  out.jsd = Rows(result.jsd, 1, row0, rows);
  return out;
}

}  // namespace logitserve
