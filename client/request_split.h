// Splitting of a Score request by rows, and concatenation of the chunks' responses. Used by
// Client::Score; separate so the planning rules are unit-tested without a server.
//
// Row tensors (first dimension = N): hidden, logits, reference_hidden, reference_logits,
// target_ids. Every other field is per request and copied into each chunk.
//
// Thread safety: free functions without shared state.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/client.h"
#include "logitserve/v1/logitserve.pb.h"

namespace logitserve::client {

// Rows [row_begin, row_end) of the request, holding sequences [seq_begin, seq_end) when
// sequence_lengths is set (else seq_begin == seq_end == 0).
struct RowChunk {
  int64_t row_begin = 0;
  int64_t row_end = 0;
  int64_t seq_begin = 0;
  int64_t seq_end = 0;
  int64_t rows() const { return row_end - row_begin; }
};

// Per-message headroom kept below max_bytes for the non-row fields and protobuf framing.
inline constexpr int64_t kMessageHeadroomBytes = int64_t{64} * 1024;

// N of the request: the first dimension of `hidden` or `logits`, or -1 when neither has a shape
// (the server will reject such a request).
int64_t RequestRows(const v1::ScoreRequest& request);

// Bytes of one row of every row tensor the request carries in `data` together (shared-memory
// tensors count 0); 0 when the tensors are inconsistent or N <= 0.
int64_t RowBytes(const v1::ScoreRequest& request);

// `message` (a server error about a chunk whose first row is `first_row` of the whole request)
// with every "row R" turned into "row R + first_row", so it names the row of the whole request.
std::string RebaseRowNumbers(absl::string_view message, int64_t first_row);

// Plans the chunks: one chunk covering the request when it has at most `max_rows` rows (0 = no
// row limit) and its row tensors fit in `max_bytes` (0 = no byte limit); else consecutive
// chunks of at most that many rows, cut only at sequence boundaries when sequence_lengths is
// set. Fails with INVALID_ARGUMENT when splitting is needed but the row tensors are inconsistent
// (first dimensions differ from N, bytes do not match shapes), the sequence lengths are invalid,
// or one sequence alone exceeds the limit. Never fails when no split is needed: the server
// validates such a request itself.
absl::StatusOr<std::vector<RowChunk>> PlanChunks(const v1::ScoreRequest& request, int64_t max_rows,
                                                 int64_t max_bytes);

// The request without its row tensors and sequence_lengths: every other field (present or added
// later to the proto, unknown fields included) as in `request`. Copies none of the row bytes
// (copying the request and clearing them would copy, and page in, every hidden byte first).
v1::ScoreRequest RequestWithoutRows(const v1::ScoreRequest& request);

// `request_without_rows` (the request with its row tensors and sequence_lengths cleared) plus the
// chunk's slices of `request`'s row tensors and sequence lengths.
v1::ScoreRequest MakeChunkRequest(const v1::ScoreRequest& request,
                                  const v1::ScoreRequest& request_without_rows,
                                  const RowChunk& chunk);

// Appends a chunk's response to `out` (rows, arrays, sums, timings). Fails with INTERNAL when the
// response's array sizes do not match the chunk's rows or K/k differ from earlier chunks.
absl::Status AppendChunkResponse(const v1::ScoreResponse& response, const RowChunk& chunk,
                                 ScoreOutput& out);

}  // namespace logitserve::client
