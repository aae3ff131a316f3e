// The chunk pipeline behind Client::Score for large requests (issue 12 target 2): the chunks of
// one request go over one ScoreStream call, at most `depth` of them unanswered at a time, so the
// server computes chunk i while chunk i + 1 is on the wire. The responses come back in completion
// order and are put back in chunk order here.
//
// No copies of the tensor bytes: a chunk is sent as a grpc::ByteBuffer whose large slices point
// into the caller's request (ChunkBytes), through the generic callback API; the server parses it
// as an ordinary ScoreStreamRequest.
//
// Deadline and cancellation: the call's context (its deadline covers every chunk, as the server
// checks it before each chunk's row tiles); on the first failed chunk the call is cancelled, so
// the server drops the chunks still queued and no further chunk is sent.
//
// Thread safety: RunPipeline blocks the calling thread until the call is done; `make_chunk` runs
// on gRPC's callback threads, one chunk at a time. The request behind the chunks' slices must
// outlive their SliceLease's WaitReleased, which may be after the call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/client_context.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/status.h"
#include "logitserve/v1/logitserve.pb.h"

namespace logitserve::client {

struct RowChunk;  // client/request_split.h

// Counts the slices ChunkBytes and RequestBytes make over the caller's request bytes. gRPC's
// transport may hold such a slice after the call that sent it completed (a cancelled stream's
// frames still in a socket write), so the request must outlive the slices, not only the call:
// WaitReleased (and the destructor) blocks until gRPC has dropped every one. Declare the lease
// before the buffers and calls that use it, so it is destroyed after them.
//
// Thread safety: Wrap from any thread; gRPC releases slices on its own threads.
class SliceLease {
 public:
  SliceLease() = default;
  ~SliceLease() { WaitReleased(); }
  SliceLease(const SliceLease&) = delete;
  SliceLease& operator=(const SliceLease&) = delete;

  // A slice over `bytes` (not copied), counted until gRPC drops its last reference.
  grpc::Slice Wrap(absl::string_view bytes);
  void WaitReleased();
  int64_t held() const;

 private:
  static void Release(void* lease);

  mutable absl::Mutex mu_;
  int64_t held_ ABSL_GUARDED_BY(mu_) = 0;
};

struct PipelineOutcome {
  // The ScoreStream call's own status (CANCELLED when a chunk failed and the call was cancelled).
  grpc::Status stream_status;
  // When failed_chunk < 0 and stream_status is OK: every chunk's response, in chunk order.
  std::vector<v1::ScoreResponse> responses;
  // The first chunk seen to fail (in completion order), and its status.
  int64_t failed_chunk = -1;
  absl::Status chunk_error;
};

// The wire bytes of the ScoreStreamRequest carrying chunk `chunk` of `request` with request_id
// `request_id`. Its `request` is `request_without_rows` (the request with its row tensors and
// sequence_lengths cleared) with the chunk's shapes and sequence lengths, then each row tensor's
// rows as one more occurrence of the tensor field holding only `data` (protobuf parsers merge
// repeated occurrences of an embedded message). The data slices point into `request` and are
// counted by `lease`: `request` must outlive lease.WaitReleased().
grpc::ByteBuffer ChunkBytes(const v1::ScoreRequest& request,
                            const v1::ScoreRequest& request_without_rows, const RowChunk& chunk,
                            const std::string& request_id, SliceLease& lease);

// The wire bytes of `request` as one ScoreRequest message (the unary Score's body), without
// copying its tensor bytes: `request_without_rows` (RequestWithoutRows(request)) with the
// request's sequence lengths and each row tensor's dtype, shape and shared-memory reference, then
// each tensor's `data` as one more occurrence of its field, a slice pointing into `request`
// counted by `lease` (`request` must outlive lease.WaitReleased()). It parses as `request`
// itself: nothing is re-cut or checked.
grpc::ByteBuffer RequestBytes(const v1::ScoreRequest& request,
                              const v1::ScoreRequest& request_without_rows, SliceLease& lease);

// Sends `chunks` chunk buffers made by make_chunk(i) (which must carry request_id i, decimal)
// over one ScoreStream on `context`, keeping at most `depth` (>= 1) unanswered. A
// ScoreStreamResponse whose request_id names no outstanding chunk is INTERNAL; one with a non-zero
// status_code fails its chunk.
PipelineOutcome RunPipeline(grpc::GenericStub& stub, grpc::ClientContext& context, size_t chunks,
                            absl::FunctionRef<grpc::ByteBuffer(size_t)> make_chunk, int depth);

}  // namespace logitserve::client
