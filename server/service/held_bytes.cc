#include "server/service/held_bytes.h"

#include <algorithm>

namespace logitserve {

namespace {

int64_t ViewBytes(const MatrixView& v) {
  return v.empty() ? 0 : v.rows * v.cols * kernels::SizeOf(v.type);
}

// The bytes of the request message the job's views point into (already counted by the scheduler).
int64_t JobInputBytes(const ScoreJob& job) {
  int64_t bytes = 0;
  for (const DistributionInput* in : {&job.model, &job.reference}) {
    bytes += ViewBytes(in->hidden) + ViewBytes(in->logits);
  }
  return bytes;
}

}  // namespace

int64_t ExtraHeldBytes(const v1::ScoreRequest& request, const ValidatedRequest& validated) {
  const ScoreJob& job = validated.job;
  const int64_t message =
      std::max<int64_t>(0, static_cast<int64_t>(request.SpaceUsedLong()) - JobInputBytes(job));
  const int64_t sequences = static_cast<int64_t>(validated.sequence_lengths.size());
  const int64_t lengths_copy = sequences * static_cast<int64_t>(sizeof(int64_t));
  int64_t per_sequence = 0;
  if (sequences > 0) {
    const int64_t floats = job.ids_per_row + (job.entropy ? 1 : 0) +
                           (job.reference_entropy ? 1 : 0) + (job.forward_kl ? 1 : 0) +
                           (job.reverse_kl ? 1 : 0) + (job.jsd_beta.has_value() ? 1 : 0);
    const int64_t one_stats =
        sequences * (floats * static_cast<int64_t>(sizeof(float)) + sizeof(int64_t));
    per_sequence = 2 /* sums, means */ * 2 /* message, serialized */ * one_stats;
  }
  const int64_t echo = 2 * static_cast<int64_t>(request.request_id().size());
  return message + lengths_copy + per_sequence + echo;
}

}  // namespace logitserve
