#include "server/service/sequence_sums.h"

#include <algorithm>
#include <cstddef>
#include <limits>
#include <vector>

#include "google/protobuf/repeated_field.h"

namespace logitserve {

namespace {

using FloatField = google::protobuf::RepeatedField<float>;

// Sums `values` ([rows * width], row-major) over the counted rows of each sequence into `sums`
// ([sequences * width]) and divides them by the counts into `means`.
void ReducePerSequence(bool requested, const std::vector<float>& values, int64_t width,
                       absl::Span<const int64_t> lengths, const std::vector<bool>& counted,
                       FloatField* sums, FloatField* means) {
  if (!requested || width == 0) return;
  // REQUIRES (validation): lengths.size() * width <= INT32_MAX, the capacity of a repeated field.
  const size_t total = lengths.size() * static_cast<size_t>(width);
  const int capacity = static_cast<int>(std::min<size_t>(total, std::numeric_limits<int>::max()));
  sums->Reserve(capacity);
  means->Reserve(capacity);
  std::vector<double> acc(static_cast<size_t>(width));
  int64_t row = 0;
  for (const int64_t len : lengths) {
    std::fill(acc.begin(), acc.end(), 0.0);
    int64_t count = 0;
    for (int64_t r = row; r < row + len; ++r) {
      if (!counted[r]) continue;
      ++count;
      for (int64_t c = 0; c < width; ++c) acc[c] += values[r * width + c];
    }
    for (int64_t c = 0; c < width; ++c) {
      sums->Add(static_cast<float>(acc[c]));
      means->Add(count == 0 ? std::numeric_limits<float>::quiet_NaN()
                            : static_cast<float>(acc[c] / static_cast<double>(count)));
    }
    row += len;
  }
}

}  // namespace

void ComputeSequenceSums(const ScoreJob& job, absl::Span<const int64_t> lengths,
                         const ScoreResult& result, v1::SequenceStats* sums,
                         v1::SequenceStats* means) {
  const int64_t k = job.ids_per_row;
  std::vector<bool> counted(job.rows, true);
  if (k > 0) {
    for (int64_t r = 0; r < job.rows; ++r) {
      bool all_ignored = true;
      for (int64_t c = 0; c < k; ++c) {
        all_ignored = all_ignored && job.target_ids[r * k + c] == job.ignore_index;
      }
      counted[r] = !all_ignored;
    }
  }
  ReducePerSequence(k > 0, result.target_logprobs, k, lengths, counted,
                    sums->mutable_target_logprobs(), means->mutable_target_logprobs());
  ReducePerSequence(job.entropy, result.entropy, 1, lengths, counted, sums->mutable_entropy(),
                    means->mutable_entropy());
  ReducePerSequence(job.reference_entropy, result.reference_entropy, 1, lengths, counted,
                    sums->mutable_reference_entropy(), means->mutable_reference_entropy());
  ReducePerSequence(job.forward_kl, result.forward_kl, 1, lengths, counted,
                    sums->mutable_forward_kl(), means->mutable_forward_kl());
  ReducePerSequence(job.reverse_kl, result.reverse_kl, 1, lengths, counted,
                    sums->mutable_reverse_kl(), means->mutable_reverse_kl());
  ReducePerSequence(job.jsd_beta.has_value(), result.jsd, 1, lengths, counted, sums->mutable_jsd(),
                    means->mutable_jsd());
  int64_t row = 0;
  for (const int64_t len : lengths) {
    int64_t count = 0;
    for (int64_t r = row; r < row + len; ++r) count += counted[r] ? 1 : 0;
    sums->add_token_count(count);
    means->add_token_count(count);
    row += len;
  }
}

}  // namespace logitserve
