// The chunk pipeline behind Client::Score for large requests (issue 12 target 2): the chunks of
// one request go over one ScoreStream call, at most `depth` of them unanswered at a time, so the
// server computes chunk i while chunk i + 1 is on the wire and the client builds chunk i + 2. The
// responses come back in completion order and are put back in chunk order here.
//
// Deadline and cancellation: the call's context (its deadline covers every chunk, as the server
// checks it before each chunk's row tiles); on the first failed chunk the call is cancelled, so
// the server drops the chunks still queued and no further chunk is sent.
//
// Thread safety: RunPipeline uses one helper thread (the writer) for the duration of the call;
// `make_chunk` runs on it, one chunk at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "grpcpp/client_context.h"
#include "grpcpp/support/status.h"
#include "logitserve/v1/logitserve.grpc.pb.h"

namespace logitserve::client {

struct PipelineOutcome {
  // The ScoreStream call's own status (CANCELLED when a chunk failed and the call was cancelled).
  grpc::Status stream_status;
  // When failed_chunk < 0 and stream_status is OK: every chunk's response, in chunk order.
  std::vector<v1::ScoreResponse> responses;
  // The first chunk seen to fail (in completion order), and its status.
  int64_t failed_chunk = -1;
  absl::Status chunk_error;
};

// Sends `chunks` requests made by make_chunk(i) (their request_id is overwritten with i) over one
// ScoreStream on `context`, keeping at most `depth` (>= 1) unanswered. A response whose
// request_id names no outstanding chunk is INTERNAL.
PipelineOutcome RunPipeline(v1::Scorer::Stub& stub, grpc::ClientContext& context, size_t chunks,
                            absl::FunctionRef<v1::ScoreRequest(size_t)> make_chunk, int depth);

}  // namespace logitserve::client
