#include "server/backend/backend.h"

#include "logitserve/kernels/cpu_kernels.h"

namespace logitserve {

absl::Status StartResult(const ScoreJob& job, ScoreResult* result) {
  const size_t n = static_cast<size_t>(job.rows);
  *result = ScoreResult{};
  result->target_logprobs.resize(n * static_cast<size_t>(job.ids_per_row));
  result->top_k_ids.resize(n * static_cast<size_t>(job.top_k));
  result->top_k_logprobs.resize(n * static_cast<size_t>(job.top_k));
  if (job.entropy) result->entropy.resize(n);
  if (job.reference_entropy) result->reference_entropy.resize(n);
  if (job.forward_kl) result->forward_kl.resize(n);
  if (job.reverse_kl) result->reverse_kl.resize(n);
  if (job.jsd_beta) result->jsd.resize(n);
  if (job.top_k > kernels::kMaxTopK || (job.rows > 0 && job.top_k > job.vocab)) {
    return absl::InvalidArgumentError("top_k exceeds the vocabulary or the kernel cap");
  }
  return absl::OkStatus();
}

}  // namespace logitserve
