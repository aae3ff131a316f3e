#include "server/service/sequence_sums.h"

#include <algorithm>
#include <cstddef>
#include <limits>
#include <vector>

#include "google/protobuf/repeated_field.h"

namespace logitserve {

namespace {

// Sums `values` ([rows * width], row-major) over the counted rows of each sequence into
// `out` ([sequences * width]).
void SumPerSequence(bool requested, const std::vector<float>& values, int64_t width,
                    absl::Span<const int64_t> lengths, const std::vector<bool>& counted,
                    google::protobuf::RepeatedField<float>* out) {
  if (!requested || width == 0) return;
  // REQUIRES (validation): lengths.size() * width <= INT32_MAX, the capacity of a repeated field.
  const size_t total = lengths.size() * static_cast<size_t>(width);
  out->Reserve(static_cast<int>(std::min<size_t>(total, std::numeric_limits<int>::max())));
  std::vector<double> acc(static_cast<size_t>(width));
  int64_t row = 0;
  for (const int64_t len : lengths) {
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int64_t r = row; r < row + len; ++r) {
      if (!counted[r]) continue;
      for (int64_t c = 0; c < width; ++c) acc[c] += values[r * width + c];
    }
    for (int64_t c = 0; c < width; ++c) out->Add(static_cast<float>(acc[c]));
    row += len;
  }
}

}  // namespace

void ComputeSequenceSums(const ScoreJob& job, absl::Span<const int64_t> lengths,
                         const ScoreResult& result, v1::SequenceSums* out) {
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
  SumPerSequence(k > 0, result.target_logprobs, k, lengths, counted,
                 out->mutable_target_logprobs());
  SumPerSequence(job.entropy, result.entropy, 1, lengths, counted, out->mutable_entropy());
  SumPerSequence(job.reference_entropy, result.reference_entropy, 1, lengths, counted,
                 out->mutable_reference_entropy());
  SumPerSequence(job.forward_kl, result.forward_kl, 1, lengths, counted, out->mutable_forward_kl());
  SumPerSequence(job.reverse_kl, result.reverse_kl, 1, lengths, counted, out->mutable_reverse_kl());
  SumPerSequence(job.jsd_beta.has_value(), result.jsd, 1, lengths, counted, out->mutable_jsd());
  int64_t row = 0;
  for (const int64_t len : lengths) {
    int64_t count = 0;
    for (int64_t r = row; r < row + len; ++r) count += counted[r] ? 1 : 0;
    out->add_token_count(count);
    row += len;
  }
}

}  // namespace logitserve
