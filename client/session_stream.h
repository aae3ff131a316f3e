// A long-lived ScoreStream for small Score calls (issue 12 target 3): a request whose row tensors
// all live in shared memory is a few hundred bytes, and a unary call spends most of its fixed cost
// on HTTP/2 stream set-up, headers, a deadline timer and a server call object per request (on the
// 2-core build box: unary 0.24-0.29 ms of fixed cost per 64-row call against 0.16-0.19 ms for a
// Write + Read on a stream kept open). Client::Score sends such requests over a SessionStream.
//
// One request at a time per stream, from one thread: Client keeps a stream per calling thread, so
// the thread that writes a request reads its answer on the stream's own completion queue (no
// hand-off to another thread, no matching of answers to callers).
//
// Deadline: each call waits at most until its own deadline (the stream itself has none). A call
// that times out, or any failed operation, leaves the stream broken: it is cancelled and drained
// and the caller discards it. A request whose answer never came may still run on the server (a
// unary call's cancellation would stop it); the caller reports DEADLINE_EXCEEDED either way.
//
// Thread safety: none; a SessionStream belongs to one thread at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/client_context.h"
#include "grpcpp/completion_queue.h"
#include "grpcpp/generic/generic_stub.h"
#include "logitserve/v1/logitserve.pb.h"

namespace logitserve::client {

class SessionStream {
 public:
  // Starts a ScoreStream on `stub` ("authorization: Bearer <token>" when `bearer_token` is not
  // empty). The start is awaited in the first Call.
  SessionStream(grpc::GenericStub& stub, const std::string& bearer_token);
  ~SessionStream();  // cancels the call and drains its completion queue
  SessionStream(const SessionStream&) = delete;
  SessionStream& operator=(const SessionStream&) = delete;

  // Sends `request` and waits until `deadline` for its answer: the response, or the request's
  // own error as the server reported it (status_code, status_message). When the stream failed
  // (UNAVAILABLE) or the deadline passed (DEADLINE_EXCEEDED), *broken is set: the stream must
  // then be discarded, and the request may or may not have run.
  absl::StatusOr<v1::ScoreResponse> Call(const v1::ScoreRequest& request, absl::Time deadline,
                                         bool* broken);

  bool broken() const { return broken_; }

 private:
  enum Tag : intptr_t { kStart = 1, kWrite = 2, kRead = 4, kFinish = 8 };
  // Waits for `tag` (tags that arrive first are noted); false when the deadline passed or any
  // operation failed (the stream is broken then). *timed_out tells which.
  bool Await(Tag tag, absl::Time deadline, bool* timed_out);

  grpc::ClientContext context_;
  grpc::CompletionQueue cq_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call_;
  int outstanding_ = 0;   // operations whose tags have not come back
  intptr_t arrived_ = 0;  // tags that came back and were not awaited yet
  bool started_ = false;
  bool broken_ = false;
};

}  // namespace logitserve::client
