// What a Score request makes the server hold, for admission against --memory-budget-bytes.
//
// Scheduler::EstimateItemBytes counts what the backend sees: the job's input tensors and its
// per-token outputs. A request holds more, and a small request can make the server produce far
// more than it sent (65 536 zero-length sequences with K = 1024 ids per row: a 65 KB request, a
// 537 MB response), so admission also counts, before anything is computed:
//   - the rest of the parsed request message: request_id, tensors no output needs, unknown
//     fields, repeated fields in their in-memory form (SpaceUsedLong, not the wire size);
//   - the validated copy of sequence_lengths;
//   - the per-sequence sums and means (S x (K + scalar outputs) floats, S token counts, each),
//     twice: the response message and its serialized copy;
//   - request_id echoed in the response, twice likewise.
//
// Thread safety: pure functions.
#pragma once

#include <cstdint>

#include "logitserve/v1/logitserve.pb.h"
#include "server/service/validate.h"

namespace logitserve {

// Bytes held beyond Scheduler::EstimateItemBytes(validated.job) (Scheduler::Item::extra_bytes).
int64_t ExtraHeldBytes(const v1::ScoreRequest& request, const ValidatedRequest& validated);

}  // namespace logitserve
