// Per-sequence sums and means of per-token outputs (ScoreResponse.sequence_sums / sequence_means).
//
// The N rows of a request are `lengths.size()` consecutive sequences. For each sequence and each
// per-token output that was computed, the sum over the sequence's counted rows:
//   - a row is counted unless the request has target ids and every id of the row is
//     ignore_index (a prompt / padding row); without target ids every row counts;
//   - an ignored id contributes 0 to its target_logprobs column (the backend already gives 0).
// Sums accumulate in double in row order (deterministic), then round once to float; a mean is that
// double sum divided by the sequence's counted rows, rounded once (NaN when no row counts).
//
// Thread safety: a pure function; call it from any thread.
#pragma once

#include <cstdint>

#include "absl/types/span.h"
#include "logitserve/v1/logitserve.pb.h"
#include "server/backend/backend.h"

namespace logitserve {

// REQUIRES: the lengths are >= 0 and sum to job.rows; lengths.size() * job.ids_per_row fits a
// repeated field (ValidateScoreRequest bounds both factors); `result` is the backend's result of
// `job`.
void ComputeSequenceSums(const ScoreJob& job, absl::Span<const int64_t> lengths,
                         const ScoreResult& result, v1::SequenceStats* sums,
                         v1::SequenceStats* means);

}  // namespace logitserve
