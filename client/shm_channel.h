// The client's half of a shared-memory call channel (issue 12 target 3; the protocol and layout
// are in common/wire/shm_channel.h). For a Score request whose row tensors all live in shared
// memory (so the server is on this host), a call posts the serialized request into a control
// region both processes map and waits on a futex for the answer: no HTTP/2 frames, no gRPC
// completion queue, no thread hand-off per call. Client::Score uses channels by itself
// (ClientOptions::shm_channels).
//
// A channel is this process's POSIX shared-memory object (mode 0600 unless `mode` says otherwise,
// unlinked once the server has mapped it, so nothing is left behind in /dev/shm) plus an
// OpenSharedMemoryChannel call that keeps the server's side alive; destroying the channel cancels
// the call, which closes the server's side (and cancels a request still in flight there).
//
// Waiting: a call spins for `spin` (the answer of a short request often comes within it), then
// sleeps on the futex in slices, checking its deadline and whether the server closed the channel.
// A call whose deadline passes asks the server to stop it (cancel_seq) and returns at once; the
// channel is then broken (its late answer must not be taken for the next call's).
//
// Thread safety: none; a channel belongs to one thread at a time (Client keeps idle ones in a
// pool, as it does session streams).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/client_context.h"
#include "grpcpp/completion_queue.h"
#include "logitserve/v1/logitserve.grpc.pb.h"

namespace logitserve::client {

class SharedMemoryBuffer;  // client/shm.h

struct ShmChannelOptions {
  uint64_t request_bytes = uint64_t{1} << 20;   // request area
  uint64_t response_bytes = uint64_t{8} << 20;  // response area
  absl::Duration spin = absl::ZeroDuration();   // 0: sleep on the futex at once
  unsigned mode = 0600;
};

class ShmChannel {
 public:
  // Creates the control region, opens the channel on `stub` ("authorization: Bearer <token>" when
  // `bearer_token` is not empty) and waits until `deadline` for the server to serve it. The
  // server's status when it refuses (UNIMPLEMENTED from a server without channels; NOT_FOUND when
  // it cannot see the object, i.e. it is not on this host; ...).
  static absl::StatusOr<std::unique_ptr<ShmChannel>> Open(v1::Scorer::Stub& stub,
                                                          const std::string& bearer_token,
                                                          const ShmChannelOptions& options,
                                                          absl::Time deadline);
  ~ShmChannel();  // cancels the call and waits for it to end
  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;

  // Whether `request` and the largest answer it can get fit the areas of a channel opened with
  // `options` (else send it over gRPC).
  static bool Fits(const ShmChannelOptions& options, const v1::ScoreRequest& request);

  // Posts `request` and waits until `deadline` for its answer: the response, or the request's own
  // error as the server reported it. *broken is set when the channel can no longer be used (the
  // server closed it: UNAVAILABLE; the deadline passed: DEADLINE_EXCEEDED); the caller then
  // discards it, and the request may or may not have run.
  absl::StatusOr<v1::ScoreResponse> Call(const v1::ScoreRequest& request, absl::Time deadline,
                                         bool* broken);

 private:
  ShmChannel(std::unique_ptr<SharedMemoryBuffer> region, const ShmChannelOptions& options);
  // Waits for response_seq == seq until `until`; false when it did not come (or the channel
  // closed: *closed set).
  bool WaitForAnswer(uint32_t seq, absl::Time until, bool* closed);

  std::unique_ptr<SharedMemoryBuffer> region_;
  const ShmChannelOptions options_;
  uint32_t seq_ = 0;
  grpc::ClientContext context_;
  grpc::CompletionQueue cq_;
  std::unique_ptr<grpc::ClientAsyncReader<v1::OpenSharedMemoryChannelResponse>> call_;
  int outstanding_ = 0;  // operations on cq_ whose tags have not come back
  bool broken_ = false;
};

}  // namespace logitserve::client
