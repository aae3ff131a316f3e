// Request validation: turns a wire ScoreRequest into a backend ScoreJob, or explains exactly
// which field (and row) is wrong. Runs completely before any compute is scheduled.
//
// Error codes: INVALID_ARGUMENT for malformed input, NOT_FOUND for an unknown head,
// FAILED_PRECONDITION for a head-version pin that does not match, RESOURCE_EXHAUSTED for a
// request over the server's size limits. Every message starts with the request field it is about.
//
// Two value checks are not done here, so that validation never reads the bulk of a request:
// NaN / +-inf in hidden states is found by CheckHiddenStatesFinite, which the service runs after
// validation on the thread that received the request (before admission, so the scans of many
// connections run in parallel beside the backend); NaN / +inf in input logits (and in logits
// computed from hidden states) is found during the backend's single pass. Both are
// INVALID_ARGUMENT naming the field and the first bad row.
//
// Zero copy: the MatrixViews of the returned job point into `request`'s bytes (or into the
// shared-memory regions its tensors name), so the request must outlive the job. A reference input
// that no requested output needs is ignored (allowed, not validated, not attached to the job).
//
// Thread safety: a pure function of its arguments; call it from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "logitserve/v1/logitserve.pb.h"
#include "server/backend/backend.h"

namespace logitserve {

// Server limits a request is checked against (from the command line).
struct RequestLimits {
  int32_t max_top_k = 64;                  // --max-top-k (<= 1024)
  int64_t max_tokens_per_request = 65536;  // --max-tokens-per-request (N; also caps the number
                                           // of sequence_lengths entries)
  int32_t max_target_ids_per_row = 1024;   // --max-target-ids-per-row (K of [N, K] target_ids)
};

// Looks a head up by name: the head currently served under it, or nullptr when there is none.
using HeadResolver =
    absl::FunctionRef<std::shared_ptr<const PreparedHead>(const std::string& name)>;

struct ValidatedRequest {
  ScoreJob job;
  // Lengths of the packed sequences (sum == job.rows); empty when no sums were asked for.
  std::vector<int64_t> sequence_lengths;
  // Versions of the heads the job uses (0 in logits mode or when there is no reference).
  uint64_t head_version = 0;
  uint64_t reference_head_version = 0;
  // Microseconds CheckHiddenStatesFinite took on this request (set by the service, which reports
  // it inside compute_us).
  int64_t finite_check_us = 0;
};

// Where the bytes of a tensor with Tensor.shared_memory set are: `ref` resolved to a view of
// `bytes` bytes (the count its shape and dtype imply, already checked against ref.byte_size)
// that stays valid until the job is done; or an error whose message starts with `field`.
using SharedMemoryResolver = absl::FunctionRef<absl::StatusOr<absl::string_view>(
    absl::string_view field, const v1::SharedMemoryRef& ref, uint64_t bytes)>;

// Tensors naming shared memory are refused (INVALID_ARGUMENT) by this overload.
absl::StatusOr<ValidatedRequest> ValidateScoreRequest(const v1::ScoreRequest& request,
                                                      HeadResolver heads,
                                                      const RequestLimits& limits);
// The job's views of shared-memory tensors point where `shared_memory` said. A tensor's range is
// resolved only after its dtype and shape passed, so nothing is read before it is known to be
// inside a region.
absl::StatusOr<ValidatedRequest> ValidateScoreRequest(const v1::ScoreRequest& request,
                                                      HeadResolver heads,
                                                      const RequestLimits& limits,
                                                      SharedMemoryResolver shared_memory);

// OK when every hidden state of the job (model and reference, hidden mode only) is finite;
// otherwise INVALID_ARGUMENT naming the field ("hidden" / "reference_hidden"), the first bad row,
// its column and the value (NaN, +inf, -inf): a non-finite hidden state would poison every logit
// of its row. Reads every hidden byte once (vectorised), so it is separate from the validation
// of shapes; a large tensor is scanned in row ranges on up to `max_threads` threads (0: up to
// 8 and half the cores, one per 4 MiB), with the same answer. REQUIRES: `job` came from
// ValidateScoreRequest (its views are valid).
absl::Status CheckHiddenStatesFinite(const ScoreJob& job, int max_threads = 0);

}  // namespace logitserve
