// ScorerService: the logitserve.v1.Scorer RPCs on gRPC's callback API.
//
// Score and ScoreStream: the handler (on a gRPC thread) checks the bearer token, validates the
// request's shapes, ids and options (ValidateScoreRequest), scans the hidden states for NaN /
// +-inf (CheckHiddenStatesFinite: on the receiving thread, so the scans of many connections run
// in parallel and the workers only drive the backend) and submits it to the Scheduler (the
// token-budget batcher), then returns; admission is decided at once (RESOURCE_EXHAUSTED when the
// queue or memory budget is full). A scheduler worker runs the (possibly co-batched) backend job
// and finishes the call. The
// request stays alive until its result is written, so the job's views into its bytes stay valid
// (zero copy for requests computed alone). Admission counts every byte a request makes the server
// hold (held_bytes.h). Cancellation and deadlines are checked before launch and before every row
// tile. ScoreStream keeps up to kMaxInFlightPerStream requests of one stream in flight or unsent,
// within ServiceOptions::stream_window_bytes, and answers each with its request_id (a failed
// request carries status_code / status_message; the stream stays open). ListHeads answers inline;
// LoadHead (load_head.cc) uploads a head version.
//
// Thread safety: the RPC methods are called concurrently by gRPC. Shutdown: StartDraining (new
// calls and stream messages get UNAVAILABLE), wait for in_flight() to reach 0 (bounded by the
// drain timeout; grpc::Server::Shutdown would answer new calls CANCELLED rather than UNAVAILABLE),
// then grpc::Server::Shutdown, then StopWorkers. The backend and head store must
// outlive the service.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "logitserve/v1/logitserve.grpc.pb.h"
#include "server/backend/backend.h"
#include "server/heads/head_store.h"
#include "server/scheduler/scheduler.h"
#include "server/service/auth.h"
#include "server/service/shm_channel.h"
#include "server/service/validate.h"

namespace logitserve {

class Metrics;               // server/service/metrics.h
class SharedMemoryRegistry;  // server/service/shm_registry.h

struct ServiceOptions {
  RequestLimits limits;
  // Reported by ListHeads; enforced by the gRPC server itself (ServerBuilder).
  int64_t max_receive_message_bytes = 0;
  SchedulerOptions scheduler;
  // Bearer-token checks (nullptr = no auth); must outlive the service.
  const Authorizer* authorizer = nullptr;
  // Prometheus metrics sink (nullptr = none); must outlive the service.
  Metrics* metrics = nullptr;
  // Shared-memory regions tensors may name (nullptr = none: such tensors and the
  // (Un)RegisterSharedMemory RPCs fail); must outlive the service.
  SharedMemoryRegistry* shared_memory = nullptr;
  // ScoreStream: bytes one stream may hold in requests in flight plus responses the client has
  // not received yet before it stops reading (StreamReactor).
  int64_t stream_window_bytes = int64_t{64} << 20;
  // Shared-memory call channels (OpenSharedMemoryChannel, shm_channel.h): at most this many open
  // at once (each has a serving thread; 0 = none), and how long a channel's thread spins for the
  // client's next request after answering one before it sleeps on the futex.
  int max_shared_memory_channels = 64;
  std::chrono::microseconds shared_memory_channel_spin{200};
  // LoadHead: largest upload (weight + bias bytes) accepted.
  int64_t max_head_bytes = int64_t{16} << 30;
  // Called once (from a scheduler worker) when the backend reports a fatal device error; the
  // server then goes NOT_SERVING and exits non-zero. May be empty.
  std::function<void(const absl::Status&)> on_fatal;
};

// The generated CallbackService with Score and ScoreStream registered raw (ByteBuffer in and out):
// the service parses each request itself (request_parse.h), so an unparsable one is answered
// INVALID_ARGUMENT (and a stream goes on: gRPC's typed callback reads report a parse failure as
// ok = false, the same as the client's half-close, and would drop the requests after it).
using ScorerCallbackBase = v1::Scorer::WithRawCallbackMethod_Score<
    v1::Scorer::WithRawCallbackMethod_ScoreStream<v1::Scorer::WithCallbackMethod_ListHeads<
        v1::Scorer::WithCallbackMethod_LoadHead<v1::Scorer::WithCallbackMethod_RegisterSharedMemory<
            v1::Scorer::WithCallbackMethod_UnregisterSharedMemory<
                v1::Scorer::WithCallbackMethod_OpenSharedMemoryChannel<v1::Scorer::Service>>>>>>>;

class ScorerService final : public ScorerCallbackBase {
 public:
  ScorerService(Backend* backend, HeadStore* heads, const ServiceOptions& options);
  ~ScorerService() override;

  grpc::ServerUnaryReactor* Score(grpc::CallbackServerContext* context,
                                  const grpc::ByteBuffer* request,
                                  grpc::ByteBuffer* response) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ScoreStream(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* ListHeads(grpc::CallbackServerContext* context,
                                      const v1::ListHeadsRequest* request,
                                      v1::ListHeadsResponse* response) override;
  // Defined in load_head.cc.
  grpc::ServerReadReactor<v1::LoadHeadRequest>* LoadHead(grpc::CallbackServerContext* context,
                                                         v1::LoadHeadResponse* response) override;
  // Defined in shared_memory_rpc.cc. Unregister answers once no request reads the region.
  grpc::ServerUnaryReactor* RegisterSharedMemory(
      grpc::CallbackServerContext* context, const v1::RegisterSharedMemoryRequest* request,
      v1::RegisterSharedMemoryResponse* response) override;
  grpc::ServerUnaryReactor* UnregisterSharedMemory(
      grpc::CallbackServerContext* context, const v1::UnregisterSharedMemoryRequest* request,
      v1::UnregisterSharedMemoryResponse* response) override;
  // Defined in shared_memory_rpc.cc: serves the channel until the call ends.
  grpc::ServerWriteReactor<v1::OpenSharedMemoryChannelResponse>* OpenSharedMemoryChannel(
      grpc::CallbackServerContext* context,
      const v1::OpenSharedMemoryChannelRequest* request) override;

  // From now on, new Score calls fail with UNAVAILABLE; queued and running ones complete.
  void StartDraining();
  // Runs what is queued, then joins the workers. Call after grpc::Server::Shutdown returned.
  void StopWorkers();
  // Requests admitted and not yet answered (queued or computing).
  int64_t in_flight() const { return scheduler_.in_flight(); }
  // Bytes counted against the memory budget: admitted requests and unsent stream responses.
  int64_t admitted_bytes() const { return scheduler_.bytes_in_flight(); }

  // The description of a head that ListHeads and LoadHead return.
  static void FillHeadInfo(const HeadWeights& weights, const Backend& backend, v1::HeadInfo* info);

  // Requests of one ScoreStream computing or waiting to be sent; the stream reads no further
  // until one is sent (see also ServiceOptions::stream_window_bytes).
  static constexpr int kMaxInFlightPerStream = 64;

 private:
  class StreamReactor;
  class ChannelReactor;  // shared_memory_rpc.cc
  // What a finished request reports: the status and, when OK, the response fields.
  // `job` and `validated` are meaningful only when `status` is OK. `admitted_bytes`: what Submit
  // returned for it (0 when refused), still counted against the budget while this runs.
  using Completion = std::function<void(absl::Status status, const ScoreResult& result,
                                        const ScoreJob& job, const ValidatedRequest& validated,
                                        const Scheduler::Timing& timing, int64_t admitted_bytes)>;

  absl::Status Authorize(const grpc::CallbackServerContext& context, Role role) const;
  void RecordRequest(const char* method, const grpc::Status& status);
  // Validates `request` and submits it; `done` runs exactly once: inline when the request is
  // refused, else on a scheduler worker. `request` must stay valid until `done` has run. `stop`
  // reports the call's cancellation or deadline (OK = go on), checked before launch and every
  // row tile. Returns the bytes admitted against the memory budget (0 when refused).
  int64_t Submit(const v1::ScoreRequest& request, std::function<absl::Status()> stop,
                 Completion done);
  // Submit for a request of a shared-memory channel; `answer` gets the response or the error.
  void ServeChannelRequest(const v1::ScoreRequest& request, std::function<absl::Status()> stop,
                           ShmChannel::Answer answer);
  // Fills a successful response (`validated` gives the sequence lengths and head versions).
  static void FillResponse(const v1::ScoreRequest& request, const ScoreJob& job,
                           const ValidatedRequest& validated, const ScoreResult& result,
                           const Scheduler::Timing& timing, v1::ScoreResponse* out);

  Backend* const backend_;
  HeadStore* const heads_;  // LoadHead replaces heads
  const ServiceOptions options_;
  std::atomic<bool> draining_{false};
  std::atomic<int> open_channels_{0};
  Scheduler scheduler_;
};

}  // namespace logitserve
