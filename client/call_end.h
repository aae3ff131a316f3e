// Ending a client call that reports to a completion queue of its own (SessionStream, ShmChannel):
// one sequence, because gRPC requires every tag back before the queue may be destroyed.
#pragma once

#include "grpcpp/client_context.h"
#include "grpcpp/completion_queue.h"
#include "grpcpp/support/status.h"

namespace logitserve::client {

// Cancels `call` (when not null), waits for its `outstanding` operations in flight (after the
// cancellation each comes back promptly, with ok = false), finishes it with `finish_tag`, then
// shuts `cq` down and drains it.
template <typename Call>
void CancelAndDrain(grpc::ClientContext& context, grpc::CompletionQueue& cq, Call* call,
                    int outstanding, void* finish_tag) {
  void* tag = nullptr;
  bool ok = false;
  if (call != nullptr) {
    context.TryCancel();
    while (outstanding > 0 && cq.Next(&tag, &ok)) --outstanding;
    grpc::Status status;
    call->Finish(&status, finish_tag);
    cq.Next(&tag, &ok);
  }
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
}

}  // namespace logitserve::client
