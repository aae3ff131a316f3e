#include "server/backend/backend.h"

#include "logitserve/kernels/cpu_kernels.h"

namespace logitserve {

absl::Status StartResult(const ScoreJob& job, ScoreResult* result) {
  const size_t n = static_cast<size_t>(job.rows);
  // A reused result keeps its memory and is not cleared: every backend writes every element of a
  // requested output, so only a changed size touches memory (a large top-k output, 8192 rows x
  // k = 1024, is 64 MB: zero-filling it cost more than the kernels). An output not requested ends
  // empty.
  result->target_logprobs.resize(n * static_cast<size_t>(job.ids_per_row));
  result->top_k_ids.resize(n * static_cast<size_t>(job.top_k));
  result->top_k_logprobs.resize(n * static_cast<size_t>(job.top_k));
  result->entropy.resize(job.entropy ? n : 0);
  result->reference_entropy.resize(job.reference_entropy ? n : 0);
  result->forward_kl.resize(job.forward_kl ? n : 0);
  result->reverse_kl.resize(job.reverse_kl ? n : 0);
  result->jsd.resize(job.jsd_beta ? n : 0);
  if (job.top_k > kernels::kMaxTopK || (job.rows > 0 && job.top_k > job.vocab)) {
    return absl::InvalidArgumentError("top_k exceeds the vocabulary or the kernel cap");
  }
  return absl::OkStatus();
}

}  // namespace logitserve
