// ScorerService: the logitserve.v1.Scorer RPCs on gRPC's callback API.
//
// Score: the handler (on a gRPC thread) validates the request's shapes, ids and options
// (ValidateScoreRequest), then queues the computation on the service's own bounded WorkerPool and
// returns the reactor; the worker scans the hidden states for NaN / +-inf
// (CheckHiddenStatesFinite), runs the backend and finishes the reactor. The request stays alive
// until Finish, so the job's views into its bytes are valid for the whole computation (zero copy).
// A full queue answers RESOURCE_EXHAUSTED at once; a call that is cancelled or past its deadline
// when its turn comes is never computed. ListHeads answers inline (no compute).
//
// Thread safety: the RPC methods are called concurrently by gRPC. StartDraining and StopWorkers
// are for the shutdown sequence: StartDraining (new Score calls get UNAVAILABLE), then
// grpc::Server::Shutdown (waits for in-flight calls, which the workers keep finishing), then
// StopWorkers. The backend and head store must outlive the service.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "logitserve/v1/logitserve.grpc.pb.h"
#include "server/backend/backend.h"
#include "server/heads/head_store.h"
#include "server/service/validate.h"
#include "server/service/worker_pool.h"

namespace logitserve {

struct ServiceOptions {
  RequestLimits limits;
  // Reported by ListHeads; enforced by the gRPC server itself (ServerBuilder).
  int64_t max_receive_message_bytes = 0;
  int workers = 2;          // concurrent Score computations
  size_t queue_size = 256;  // Score calls waiting for a worker before RESOURCE_EXHAUSTED
};

class ScorerService final : public v1::Scorer::CallbackService {
 public:
  ScorerService(Backend* backend, const HeadStore* heads, const ServiceOptions& options);
  ~ScorerService() override;

  grpc::ServerUnaryReactor* Score(grpc::CallbackServerContext* context,
                                  const v1::ScoreRequest* request,
                                  v1::ScoreResponse* response) override;
  grpc::ServerUnaryReactor* ListHeads(grpc::CallbackServerContext* context,
                                      const v1::ListHeadsRequest* request,
                                      v1::ListHeadsResponse* response) override;

  // From now on, new Score calls fail with UNAVAILABLE; queued and running ones complete.
  void StartDraining();
  // Runs what is queued, then joins the workers. Call after grpc::Server::Shutdown returned.
  void StopWorkers();

 private:
  struct Call;
  // Runs on a worker: computes one validated call and finishes its reactor.
  void Compute(Call& call);

  Backend* const backend_;
  const HeadStore* const heads_;
  const ServiceOptions options_;
  std::atomic<bool> draining_{false};
  WorkerPool pool_;
};

}  // namespace logitserve
